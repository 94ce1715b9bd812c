"""How an :class:`~objckpt.storage.s3.S3Store` routes requests over the direct
HTTP path (:mod:`.s3_direct`): deciding once per store whether the path can be
used, running its blocking exchanges on pool threads under the store's retry
policy, limiter and first-answer bound, and turning to botocore for good when
an endpoint refuses it.  A mixin, so the store's own module keeps botocore's
side and the object calls that choose between the two.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from .. import _runtime
from ..checksum import CellCrcs
from ..errors import BucketNotFoundError, CorruptCheckpointError, StorageError
from ..logs import get_logger
from . import s3_direct
from .base import not_found
from .retry import Failure, classify, error_code, http_status
from .s3_direct import DirectClient, Sink, Unsupported

log = get_logger("objckpt.storage")


def _is_missing(e: BaseException) -> bool:
    return error_code(e) in ("NoSuchKey", "404", "NotFound") or http_status(e) == 404


def _is_no_bucket(e: BaseException) -> bool:
    return error_code(e) == "NoSuchBucket"


def _is_precondition(e: BaseException) -> bool:
    return error_code(e) in ("PreconditionFailed", "ConditionalRequestConflict") or http_status(e) in (409, 412)


class DirectRoutes:
    """The direct-path half of S3Store (see the module docstring)."""

    bucket: str
    policy: Any
    limiter: Any
    _answered: bool
    _options: dict[str, Any]
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
        from .sigv4 import resolve_credentials

        target = s3_direct.resolve_target(self.bucket, self._options)
        if target is None:
            return None
        try:
            # botocore's provider chain may do network calls (roles, IMDS): off the loop
            creds = await _runtime.in_thread(resolve_credentials, self._options)
        except Exception as e:  # e.g. a profile that does not exist: botocore's path says it best
            log.debug("direct S3 requests off for %s: credentials: %s", self.describe(), e)
            return None
        if creds is None:
            return None
        return DirectClient(self.bucket, target, creds, connect_timeout=self.policy.connect_timeout,
                            read_timeout=self.policy.read_timeout)

    def _direct_refused(self, e: Unsupported) -> None:
        """The endpoint wants something the direct path does not do: botocore from now on."""
        reader, self._direct_client = self._direct_client, None
        if reader is not None:
            log.info("direct S3 requests off for %s (%s); botocore from now on", self.describe(), e)
            reader.close()

    async def _direct_call(self, fn: Any, *args: Any, where: str, has_body: bool = False) -> Any:
        """``fn(*args, first_byte)`` on a pool thread, under the same retry policy,
        limiter and first-answer bound as botocore calls (see _retrying); a body
        is sent again whole on each attempt."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            first = self.policy.read_timeout if self._answered or has_body else min(
                self.policy.first_answer_timeout, self.policy.read_timeout)
            sent_at = time.monotonic()
            try:
                if self.limiter is None:
                    r = await loop.run_in_executor(s3_direct.pool(), fn, *args, first)
                else:
                    async with self.limiter:
                        sent_at = time.monotonic()
                        r = await loop.run_in_executor(s3_direct.pool(), fn, *args, first)
                    self.limiter.succeeded()
                self._answered = True
                return r
            except Unsupported:
                raise
            except Exception as e:
                if http_status(e):
                    self._answered = True
                if _is_no_bucket(e):
                    raise self._no_bucket() from None
                if _is_missing(e) or _is_precondition(e) or error_code(e) == "InvalidRange" or http_status(e) == 416:
                    raise
                if isinstance(e, TimeoutError) and not self._answered:
                    e = asyncio.TimeoutError(f"no answer from {self.endpoint()} within {first:g} s "
                                             "(storage option first_answer_timeout)")
                kind = classify(e)
                if kind is Failure.THROTTLE and self.limiter is not None:
                    self.limiter.throttled(sent_at)
                attempt += 1
                status = f"HTTP {http_status(e)}, " if http_status(e) else ""
                if attempt >= self.policy.attempts(kind):
                    tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
                    raise StorageError(f"S3 {where} at {self.endpoint()} failed ({status}{kind.value}, {tries}): "
                                       f"{type(e).__name__}: {e}") from e
                log.warning("S3 %s (%s%s), attempt %d of %d; retrying: %s: %s", where, status, kind.value, attempt,
                            self.policy.attempts(kind), type(e).__name__, e)
                await self.policy.backoff(attempt)

    async def direct_server_header(self, timeout: float) -> tuple[bool, Optional[str]]:
        """(answered, Server header) of one HeadBucket on the direct path; (False,
        None) when the direct path is off or nothing answered (see shape.py)."""
        direct = await self._direct()
        if direct is None:
            return False, None
        try:
            loop = asyncio.get_running_loop()
            return True, await loop.run_in_executor(s3_direct.pool(), direct.server_header, timeout)
        except Exception:
            return False, None

    async def _read_direct(self, reader: DirectClient, key: str, offset: int, views: list[memoryview], *,
                           allow_short: bool, tally: Optional[CellCrcs] = None) -> int:
        sink = Sink(views, tally=tally)
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
        except BucketNotFoundError:
            raise
        except Exception as e:
            if _is_missing(e):
                await self._check_bucket()
                raise not_found(f"s3://{self.bucket}/{key}") from None
            if not (error_code(e) == "InvalidRange" or http_status(e) == 416):
                raise
        if sink.got != sink.total and not allow_short:
            raise CorruptCheckpointError(
                f"object s3://{self.bucket}/{key} is truncated: wanted bytes {offset}..{offset + sink.total}, "
                f"got {sink.got}")
        return sink.got
