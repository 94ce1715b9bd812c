"""How an :class:`~objckpt.storage.s3.S3Store` routes requests over the direct
HTTP path (:mod:`.s3_direct`): deciding once per store whether the path can be
used, running its blocking exchanges on pool threads under the store's retry
policy, limiter and first-answer bound (:func:`.retry.retrying`, shared with
botocore's side), and turning to botocore for good when an endpoint refuses it.
Also what a failed or short read means, which both sides share.  A mixin, so
the store's own module keeps botocore's side and the object calls that choose
between the two.

A bucket in another region than the one signed for is followed, not fled:
S3's refusal (301 PermanentRedirect, 400 AuthorizationHeaderMalformed, a bare
400 or 301 to a HEAD; see :mod:`.s3_answers`) names the region, or one
HeadBucket reads it from ``x-amz-bucket-region``, as botocore's
``S3RegionRedirectorv2`` does; the client is re-targeted (signing region, and
on AWS the regional host), the region is kept per bucket for later stores in
the process, and the refused request is sent again on the same path, its body
included.  botocore's side follows the same redirects itself (its bodies are
re-sendable, see :mod:`.http_body`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
from typing import Any, Awaitable, Callable, Optional

from .. import _runtime
from ..errors import BucketNotFoundError, CorruptCheckpointError, NotS3EndpointError, StorageError
from ..logs import get_logger
from . import s3_direct
from .base import not_found
from .retry import callers_map, is_missing, is_past_end, no_answer, retrying
from .s3_answers import WrongRegion
from .s3_direct import DirectClient, Sink, Target, Unsupported

log = get_logger("objckpt.storage")


NOT_DIRECT: Any = object()
"""What :meth:`DirectRoutes._try_direct` returns when the request must go through botocore."""


def _direct_passes(e: BaseException) -> bool:
    """Errors of the direct path that go up unretried: Unsupported (the caller turns
    to botocore), a region redirect (followed by :meth:`DirectRoutes._direct_call`),
    an endpoint that is not S3, and what callers map (missing key, precondition,
    range past the end)."""
    return isinstance(e, (Unsupported, WrongRegion, NotS3EndpointError)) or callers_map(e)


#: (endpoint, bucket) -> the region S3 said the bucket is in, for stores made later in this process
_regions: dict[tuple[str, str], str] = {}
_regions_lock = threading.Lock()
_AWS_HOST = re.compile(r"(^|\.)s3([.-][a-z0-9-]+)?\.amazonaws\.com$")


def known_region(endpoint: str, bucket: str) -> Optional[str]:
    """The region a redirect taught this process for ``bucket`` at ``endpoint`` (None: none did)."""
    with _regions_lock:
        return _regions.get((endpoint, bucket))


def _remember_region(endpoint: str, bucket: str, region: str) -> None:
    with _regions_lock:
        _regions[(endpoint, bucket)] = region


def _after_fork() -> None:
    """A forked child keeps what was learned, with a lock no parent thread can be holding."""
    global _regions_lock
    _regions_lock = threading.Lock()


_runtime.on_reset(_after_fork)


def retargeted(target: Target, region: str) -> Target:
    """``target`` for a bucket in ``region``: signed for it, and on AWS sent to its
    regional host (``s3.<region>.amazonaws.com``, the bucket's virtual host under
    it), as botocore's endpoint rules resolve it; a custom endpoint keeps its host."""
    m = _AWS_HOST.search(target.host)
    if m is None:
        return dataclasses.replace(target, region=region)
    host = target.host[: m.start()] + f"{m.group(1)}s3.{region}.amazonaws.com"
    header = host if target.port == (443 if target.scheme == "https" else 80) else f"{host}:{target.port}"
    return dataclasses.replace(target, host=host, host_header=header, region=region)


class DirectRoutes:
    """The direct-path half of S3Store (see the module docstring)."""

    bucket: str
    policy: Any
    limiter: Any
    _answered: bool
    config: Any  # the store's S3Config
    _direct_wanted: bool
    _direct_client: Optional[DirectClient]
    _direct_decided: bool
    _direct_lock: Optional[asyncio.Lock]

    # provided by S3Store
    def _no_bucket(self) -> BucketNotFoundError:
        raise NotImplementedError

    async def _check_bucket(self) -> None:
        raise NotImplementedError

    def endpoint(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


    async def _direct(self) -> Optional[DirectClient]:
        """The direct reader, decided once per store (and after fork): ``None`` when
        switched off, when the endpoint needs what only botocore does, or after
        the endpoint refused it once."""
        if self._direct_decided:
            return self._direct_client
        if self._direct_lock is None:
            self._direct_lock = asyncio.Lock()
        async with self._direct_lock:
            if not self._direct_decided:
                self._direct_client = await self._make_direct() if self._direct_wanted else None
                self._direct_decided = True
        return self._direct_client

    async def _make_direct(self) -> Optional[DirectClient]:
        config = self.config  # resolved once when the store opened (s3_config)
        target = config.target
        # botocore's provider chain may do network calls (roles, IMDS): off the loop
        creds = await _runtime.in_thread(config.credentials)
        region = known_region(self.endpoint(), self.bucket)
        if region is not None and region != target.region:  # learned from a redirect earlier in this process
            target = retargeted(target, region)
        return DirectClient(self.bucket, target, creds, connect_timeout=self.policy.connect_timeout,
                            read_timeout=self.policy.read_timeout, deadline_floor=self.policy.deadline_floor,
                            min_rate=self.policy.min_rate, extra_headers=config.extra_headers)

    async def _try_direct(self, call: Callable[[DirectClient], Awaitable[Any]]) -> Any:
        """``await call(direct)`` when the direct path is on; :data:`NOT_DIRECT` when it is
        off or the endpoint refuses it (then botocore from now on), so that each object
        call is "direct, else botocore" in one place.  Other errors go up."""
        direct = await self._direct()
        if direct is None:
            return NOT_DIRECT
        try:
            return await call(direct)
        except Unsupported as e:
            self._direct_refused(e)
            return NOT_DIRECT

    def _direct_refused(self, e: Unsupported) -> None:
        """The endpoint wants something the direct path does not do: botocore from now on."""
        reader, self._direct_client = self._direct_client, None
        if reader is not None:
            log.info("direct S3 requests off for %s (%s); botocore from now on", self.describe(), e)
            reader.close()

    async def _direct_call(self, fn: Any, *args: Any, where: str, has_body: bool = False) -> Any:
        """``fn(*args, first_byte)`` on a pool thread, under the same retry policy,
        limiter and first-answer bound as botocore calls (:func:`.retry.retrying`);
        a body is sent again whole on each attempt.  A refusal that says the bucket
        is in another region is followed (:meth:`_follow_region`) and the request
        sent again; once S3 has named a region, a second refusal for the same region is final."""
        loop = asyncio.get_running_loop()

        async def send(first: float) -> Any:
            try:
                return await loop.run_in_executor(s3_direct.pool(), fn, *args, first)
            except TimeoutError as e:
                if self._answered or isinstance(e, s3_direct.AnswerTimeout):  # it answered (slowly): as it says
                    raise
                raise no_answer(self.endpoint(), first) from None

        refusals = 0
        while True:
            try:
                return await retrying(self, where, send, has_body=has_body, passes=_direct_passes, name_type=True)
            except WrongRegion as e:
                refusals += 1
                region = await self._follow_region(e)
                if region is None or refusals > 3 or (refusals > 1 and region == e.signed_region):
                    raise self._region_error(e, where, region) from None

    def _region_error(self, e: WrongRegion, where: str, region: Optional[str]) -> StorageError:
        if region is None:
            why = ("and HeadBucket did not say where (no x-amz-bucket-region); pass storage option region_name "
                   "(or set AWS_REGION) to the bucket's region")
        else:
            why = f"again after the request was signed for {region}, the region S3 named"
        return StorageError(f"S3 {where} at {self.endpoint()}: S3 refused it as sent to the wrong region "
                            f"({e}), {why}")

    async def _follow_region(self, e: WrongRegion) -> Optional[str]:
        """The region to send the refused request to next, with the direct client
        re-targeted there: the region the refusal named, else HeadBucket's
        ``x-amz-bucket-region``; None when neither says.  One HeadBucket for all the
        requests refused at once: those signed before another one moved the client
        are simply sent again."""
        direct = self._direct_client
        if direct is None:  # another request turned the store to botocore meanwhile: so does this one
            raise Unsupported(str(e))
        if self._direct_lock is None:
            self._direct_lock = asyncio.Lock()
        async with self._direct_lock:
            current = direct.target.region
            if current != e.signed_region:
                return current
            region = e.region
            if region is None:
                try:
                    region = await self._direct_call(direct.bucket_region,
                                                     where=f"HeadBucket s3://{self.bucket} (the bucket's region)")
                except Exception as asked:
                    if is_missing(asked):
                        raise self._no_bucket() from None
                    raise
            if region is not None and region != current:
                log.info("s3://%s is in %s, not %s (S3 answered %s): requests are signed for %s from now on; "
                         "set storage option region_name (or AWS_REGION) to skip this redirect",
                         self.bucket, region, current, e.code or f"HTTP {e.status}", region)
                direct.retarget(retargeted(direct.target, region))
                _remember_region(self.endpoint(), self.bucket, region)
            return region

    async def direct_server_header(self, timeout: float) -> tuple[bool, Optional[str]]:
        """(answered, Server header) of one HeadBucket on the direct path; (False,
        None) when the direct path is off or nothing answered (see shape.py)."""
        direct = await self._direct()
        if direct is None:
            return False, None
        loop = asyncio.get_running_loop()
        for _ in range(2):
            try:
                return True, await loop.run_in_executor(s3_direct.pool(), direct.server_header, timeout)
            except NotS3EndpointError:
                raise  # a definite answer: no save or read can go on
            except WrongRegion as e:  # the probe learns the region for the requests that follow
                try:
                    if await self._follow_region(e) is None:
                        return False, None
                except Exception:
                    return False, None
            except Exception:
                return False, None
        return False, None

    async def _read_direct(self, reader: DirectClient, key: str, offset: int, sink: Sink, *,
                           allow_short: bool) -> int:
        where = f"GET s3://{self.bucket}/{key} at {offset}"
        try:
            while sink.got < sink.total:
                before = sink.got
                await self._direct_call(reader.read_range, key, offset, sink, where=where)
                if sink.got == before:
                    break  # the object ends before the range does
        except asyncio.CancelledError:
            sink.cancelled = True  # the receiving thread stops at its next buffer
            raise
        except Exception as e:
            if not await self._read_ends_short(key, e):
                raise
        return self._delivered(key, offset, sink, allow_short)

    # -- what a read's outcome means, on either path --------------------------
    async def _raise_if_missing(self, key: str, e: BaseException) -> None:
        """A 404 for ``key`` as :class:`NotFoundError` naming the object, or as
        :class:`BucketNotFoundError` when it is the bucket that is missing; else nothing."""
        if is_missing(e):
            await self._check_bucket()
            raise not_found(f"s3://{self.bucket}/{key}") from None

    async def _read_ends_short(self, key: str, e: Exception) -> bool:
        """Whether a ranged GET of ``key`` that raised ``e`` has merely ended: True when
        the range starts past the object's end (the length check decides); a missing
        key or bucket is raised as such; False: a failure the caller retries or raises."""
        if isinstance(e, BucketNotFoundError):
            raise e
        await self._raise_if_missing(key, e)
        return is_past_end(e)

    def _delivered(self, key: str, offset: int, sink: Sink, allow_short: bool) -> int:
        """The bytes a ranged GET delivered; fewer than asked is corruption unless ``allow_short``."""
        if sink.got != sink.total and not allow_short:
            raise CorruptCheckpointError(
                f"object s3://{self.bucket}/{key} is truncated: wanted bytes {offset}..{offset + sink.total}, "
                f"got {sink.got}")
        return sink.got
