"""The one loop every S3 request of a store goes through, whatever moves its bytes.

:meth:`Pipeline.send` runs one operation of the store's transport
(:mod:`.transport`, chosen once by the store's config) until it succeeds or
its kind of failure has used up its budget (:class:`~.retry.RetryPolicy`):

* **limiter**: each attempt holds a slot of the store's AIMD limiter; throttling
  shrinks it, successes grow it;
* **first-answer bound**: until the endpoint has answered once, a request
  without a body gets ``first_answer_timeout`` for its first byte instead of
  ``read_timeout``, so a silent endpoint is reported in seconds;
* **failure budgets**: each kind of failure (throttling, server errors,
  timeouts, refused connections) has its own number of attempts and backs off
  with full jitter;
* **body continuation**: an operation that writes into a sink (a ranged GET)
  asks, on each attempt, only for what has not arrived; a body to send is sent
  whole again from the caller's buffers;
* **region redirects**: a refusal that says the bucket is in another region is
  followed (the region S3 named, else HeadBucket's ``x-amz-bucket-region``), the
  transport re-targeted and the request sent again; a second refusal for the
  region S3 named is final;
* **error mapping**: a missing bucket is :class:`BucketNotFoundError`; refused
  credentials (a skewed clock, an expired token, a wrong key) are
  :class:`CredentialsRefusedError` at once, naming the fix (:mod:`.refusals`); what
  callers map (missing key, failed precondition, a range past the end) and an
  endpoint that is not S3 go up at once, and so does an https:// endpoint that answers
  the TLS handshake in plain HTTP (:func:`.tls.not_tls_reason`: a
  :class:`~objckpt.errors.PlainHttpEndpointError` naming the http:// URL); anything
  else, when its budget is spent, is a StorageError naming the operation, the endpoint,
  the HTTP status, the kind and the attempts (:class:`StorageTimeoutError` when out of
  time).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional, TypeVar

from ...errors import BucketNotFoundError, NotS3EndpointError, StorageError, StorageTimeoutError
from ...logs import get_logger
from ..limiter import AimdLimiter
from .retry import Failure, callers_map, classify, http_status, is_missing, is_no_bucket, no_answer
from .answers import WrongRegion
from .config import S3Config
from .refusals import credentials_refused
from . import tls
from .request import MalformedAnswer
from .transport import S3Transport, open_transport

log = get_logger("objckpt.storage")
T = TypeVar("T")


def _passes(e: BaseException) -> bool:
    """Errors that go up unretried: what callers map, an endpoint that is not S3 and an
    answer that is not what the operation returns (retrying cannot change either)."""
    return callers_map(e) or isinstance(e, (NotS3EndpointError, MalformedAnswer))


class Pipeline:
    """How one store's requests go out: its transport, limiter and budgets."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.bucket = config.bucket
        self.policy = config.policy
        # adaptive=False keeps a fixed number of requests in flight (no AIMD)
        self.limiter = AimdLimiter(config.concurrency, name=f"s3://{config.bucket}") if config.adaptive else None
        self.answered = False  # the endpoint has sent an HTTP answer (even an error): it is alive
        self._transport: Optional[S3Transport] = None
        self._lock: Optional[asyncio.Lock] = None

    def endpoint(self) -> str:
        return self.config.endpoint()

    def no_bucket(self) -> BucketNotFoundError:
        return BucketNotFoundError(self.bucket, f"bucket {self.bucket!r} does not exist at s3://{self.bucket} at "
                                                f"{self.endpoint()}")

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def transport(self) -> S3Transport:
        """The transport the config chose, opened once (and again after fork)."""
        if self._transport is None:
            async with self._locked():
                if self._transport is None:
                    self._transport = await open_transport(self.config, self.endpoint())
        return self._transport

    async def send(self, what: str, op: Callable[[S3Transport, float], Awaitable[T]], *,
                   has_body: bool = False) -> T:
        """``op(transport, first_byte)`` until it succeeds or its failure's budget is spent
        (see the module docstring).  ``what`` names the request in errors and logs."""
        transport = await self.transport()
        attempt = refusals = 0
        while True:
            policy = self.policy
            first = policy.read_timeout if self.answered or has_body else min(
                policy.first_answer_timeout, policy.read_timeout)
            answered = self.answered
            sent_at = time.monotonic()
            try:
                if self.limiter is None:
                    r = await op(transport, first)
                else:
                    async with self.limiter:
                        sent_at = time.monotonic()  # a refusal counts from when the request left, not the queue
                        r = await op(transport, first)
                    self.limiter.succeeded()
                self.answered = True
                return r
            except WrongRegion as refused:
                self.answered = True
                refusals += 1
                region = await self.follow_region(transport, refused)
                if region is None or refusals > 3 or (refusals > 1 and region == refused.signed_region):
                    raise self._region_error(refused, what, region) from None
                continue  # sent again, signed for the bucket's region: not a failure of the budget
            except Exception as caught:
                e: Exception = caught
                if type(e) is TimeoutError and not answered and not self.answered:
                    e = no_answer(self.endpoint(), first)  # the bound of a silent endpoint ran out
                if http_status(e):
                    self.answered = True
                if is_no_bucket(e):
                    raise self.no_bucket() from None
                if _passes(e):
                    raise
                plain = tls.not_tls_reason(e) if self.config.target.scheme == "https" else None
                if plain is not None:  # an https:// URL for a plain HTTP port: no attempt can pass
                    raise tls.plain_http_error(what, self.endpoint(), self.config.endpoint_url.value,
                                               self.config.endpoint_url.source, plain) from e
                # (the endpoint's URL alone: its notes name the region, which is not what is wrong)
                named = credentials_refused(e, f"S3 {what} at {self.config.client_endpoint}")
                if named is not None:  # the clock or the keys: sending again cannot help
                    raise named from e
                kind = classify(e)
                if kind is Failure.THROTTLE and self.limiter is not None:
                    self.limiter.throttled(sent_at)
                attempt += 1
                status = f"HTTP {http_status(e)}, " if http_status(e) else ""
                text = f"{type(e).__name__}: {e}" if transport.names_type else str(e)
                if attempt >= policy.attempts(kind):
                    tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                    error = StorageTimeoutError if kind is Failure.TIMEOUT else StorageError
                    raise error(f"S3 {what} at {self.endpoint()} failed ({status}{kind.value}, {tries}): "
                                f"{text}") from e
                log.warning("S3 %s (%s%s), attempt %d of %d; retrying: %s", what, status, kind.value, attempt,
                            policy.attempts(kind), text)
                await policy.backoff(attempt)

    # -- region redirects ------------------------------------------------------------
    async def follow_region(self, transport: Any, e: WrongRegion) -> Optional[str]:
        """The region to send the refused request to next, with the transport
        re-targeted there: the region the refusal named, else HeadBucket's
        ``x-amz-bucket-region``; None when neither says.  One HeadBucket for all the
        requests refused at once: those signed before another one moved the transport
        are simply sent again."""
        async with self._locked():
            current = transport.region
            if current != e.signed_region:
                return str(current)
            region = e.region
            if region is None:
                try:
                    region = await self.send(f"HeadBucket s3://{self.bucket} (the bucket's region)",
                                             lambda t, first: transport.bucket_region(first))
                except Exception as asked:
                    if is_missing(asked):
                        raise self.no_bucket() from None
                    raise
            if region is not None and region != current:
                log.info("s3://%s is in %s, not %s (S3 answered %s): requests are signed for %s from now on; "
                         "set storage option region_name (or AWS_REGION) to skip this redirect",
                         self.bucket, region, current, e.code or f"HTTP {e.status}", region)
                transport.retarget(region)
            return region

    def _region_error(self, e: WrongRegion, what: str, region: Optional[str]) -> StorageError:
        if not e.code and e.status == 400:  # a bare 400 to a HEAD that a GET of the key did not explain either
            said = (f"again after it was signed for {region}, the bucket's region (x-amz-bucket-region): not a "
                    "region problem" if region is not None else
                    "and HeadBucket named no region (x-amz-bucket-region): if the bucket is in another region than "
                    f"{e.signed_region}, pass storage option region_name (S3 refuses a HEAD signed for the wrong "
                    "region so, but not only that)")
            return StorageError(f"S3 {what} at {self.endpoint()} was refused with a bare HTTP 400 (an answer to a "
                                f"HEAD has no body, and a GET of the key gave no reason either), {said}")
        if region is None:
            why = ("and HeadBucket did not say where (no x-amz-bucket-region); pass storage option region_name "
                   "(or set AWS_REGION) to the bucket's region")
        else:
            why = f"again after the request was signed for {region}, the region S3 named"
        return StorageError(f"S3 {what} at {self.endpoint()}: S3 refused it as sent to the wrong region "
                            f"({e}), {why}")

    # -- the process's life ----------------------------------------------------------
    def forget(self) -> None:
        """After fork: sockets, clients and locks belong to the parent; start afresh."""
        if self._transport is not None:
            self._transport.forget()
        self._transport = None
        self._lock = None
        self.answered = False
        if self.limiter is not None:
            self.limiter._cond = None  # bound to the loop that is gone

    async def close(self) -> None:
        t, self._transport = self._transport, None
        if t is not None:
            await t.close()
