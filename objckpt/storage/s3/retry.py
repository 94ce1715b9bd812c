"""How long objckpt keeps trying an S3 request, by kind of failure.

botocore's own retries treat a refused connection, a silent endpoint and a
throttled bucket alike (up to ``max_attempts`` with backoff), so a dead
endpoint took 30-40 s to report and a silent one minutes.  Here each kind of
failure has its own budget: throttling (503 SlowDown, 429) is retried long,
since it is the server asking for patience; server errors a few times; timeouts
and refused connections once or twice, since waiting rarely fixes them.
Connect time and first-byte time are bounded separately by the client
(``connect_timeout``, ``read_timeout``), and each request of the direct path
as a whole by its deadline, ``max(deadline_floor, bytes / min_rate)``: an
answer (or an upload) that keeps trickling is a timeout like a silent one.

This module holds the policy and the reading of failures; the one loop that
applies them to every request of an S3 store, on either transport, is
:meth:`.send.Pipeline.send`.
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from enum import Enum

_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException"}
# BadDigest / XAmzContentChecksumMismatch / IncompleteBody: the body arrived damaged or
# short (it left objckpt intact: its checksum was computed here); sending it again may pass.
# (RequestTimeTooSkewed is not here: requests are signed with this machine's clock, so sending
# again cannot pass; .refusals names it at once.)
# ConditionalRequestConflict (409): a conditional write raced another write of the key; S3
# asks for a retry, which then succeeds or meets the winner's object (412).
_SERVER_CODES = {"InternalError", "ServiceUnavailable", "RequestTimeout", "BadDigest",
                 "XAmzContentChecksumMismatch", "IncompleteBody", "ConditionalRequestConflict"}


class Failure(Enum):
    """What kind of failure an exception is, for the retry budget."""

    THROTTLE = "throttle"
    SERVER = "server"
    TIMEOUT = "timeout"
    CONNECT = "connect"
    FATAL = "fatal"


@dataclass(frozen=True)
class RetryPolicy:
    """Retry and timeout budgets of one S3 store (all settable via ``storage_options``;
    resolved with the AWS retry settings by :mod:`.retry_settings`).

    Attempts count the first try.  With the defaults a refused connection is
    reported in well under 2 s, a silent endpoint after about 2 x read_timeout
    (under a minute), a permanent 500 after about 2 s, and throttling is
    waited out for about a minute.  Until an endpoint has answered once, a
    request without a body (the HEAD or GET that starts every save and read)
    gets only ``first_answer_timeout`` per attempt, so an endpoint that accepts
    TCP and never answers is reported in seconds, while ``read_timeout`` stays
    long enough for a busy but live server.

    Each request of the direct path must also be done, head and body, within
    ``max(deadline_floor, bytes / min_rate)`` seconds of being sent (bytes: its
    body plus the answer's body as asked for): a server that answers at one byte
    a second never trips ``read_timeout``, but it trips this.  The defaults
    (60 s, 1 MiB/s) let a 16 MiB part or an 8 MiB ranged GET take a minute;
    ``OBJCKPT_S3_DEADLINE_FLOOR`` and ``OBJCKPT_S3_MIN_RATE`` set them where
    the options do not.  ``max_attempts`` (option or AWS setting) caps the four
    attempt budgets at once."""

    connect_timeout: float = 5.0  #: seconds to open a TCP/TLS connection
    read_timeout: float = 20.0  #: seconds to wait for the first (or next) byte of a response
    first_answer_timeout: float = 3.0  #: seconds for a body-less request before the endpoint ever answered
    throttle_attempts: int = 12  #: 503 SlowDown / 429
    error_attempts: int = 4  #: other 5xx and broken connections
    timeout_attempts: int = 2  #: connect or read timeouts
    connect_attempts: int = 2  #: connection refused / unreachable
    base_backoff: float = 0.1  #: first backoff (seconds); doubles per attempt, full jitter
    max_backoff: float = 10.0  #: cap of one backoff
    deadline_floor: float = 60.0  #: seconds any one request may take, whatever its size
    min_rate: float = float(1 << 20)  #: bytes/s below which a large request runs out of time

    def deadline(self, size: int) -> float:
        """Seconds a request moving ``size`` bytes may take in all (see the class docstring)."""
        return max(self.deadline_floor, size / self.min_rate)

    def attempts(self, kind: Failure) -> int:
        return {
            Failure.THROTTLE: self.throttle_attempts, Failure.SERVER: self.error_attempts,
            Failure.TIMEOUT: self.timeout_attempts, Failure.CONNECT: self.connect_attempts, Failure.FATAL: 1,
        }[kind]

    async def backoff(self, attempt: int) -> None:
        await asyncio.sleep(random.random() * min(self.max_backoff, self.base_backoff * 2 ** attempt))


def error_code(e: BaseException) -> str:
    """S3's error code of a botocore ClientError ("" otherwise)."""
    resp = getattr(e, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", ""))


def http_status(e: BaseException) -> int:
    """The HTTP status of a botocore ClientError (0 otherwise)."""
    resp = getattr(e, "response", None) or {}
    return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_missing(e: BaseException) -> bool:
    """A 404: the key is missing, or the bucket (a HEAD's 404 has no body to say which)."""
    return error_code(e) in ("NoSuchKey", "404", "NotFound") or http_status(e) == 404


def is_no_bucket(e: BaseException) -> bool:
    return error_code(e) == "NoSuchBucket"


def is_precondition(e: BaseException) -> bool:
    """A conditional request refused (``If-None-Match: *`` on an object that exists): 412
    only.  A 409 ConditionalRequestConflict says nothing of what is at the key (a write
    raced this one), so it is retried (:data:`_SERVER_CODES`), never taken for this."""
    return error_code(e) == "PreconditionFailed" or http_status(e) == 412


def is_past_end(e: BaseException) -> bool:
    """A ranged GET that starts past the object's end: a short read, not a failure."""
    return error_code(e) == "InvalidRange" or http_status(e) == 416


def callers_map(e: BaseException) -> bool:
    """Errors that go up unretried on either S3 path: the callers map them (missing key,
    precondition, a range that starts past the object's end)."""
    return is_missing(e) or is_precondition(e) or is_past_end(e)


def no_answer(endpoint: str, seconds: float) -> asyncio.TimeoutError:
    """The timeout of a request sent before the endpoint ever answered: it names the
    option, since a silent endpoint is what that bound is there to report."""
    return asyncio.TimeoutError(f"no answer from {endpoint} within {seconds:g} s "
                                "(storage option first_answer_timeout)")


def classify(e: BaseException) -> Failure:
    """The kind of ``e`` (a botocore/aiohttp/OS exception, an S3 error answer of the
    direct read path, or one wrapping it as its cause)."""
    cause = e.__cause__ if getattr(e, "response", None) is None and e.__cause__ is not None else e
    code, status = error_code(cause), http_status(cause)
    if code in _THROTTLE_CODES or status == 429:
        return Failure.THROTTLE
    if code == "NotImplemented" or status == 501:  # the store lacks the operation: asking again cannot help
        return Failure.FATAL
    if code in _SERVER_CODES or status >= 500:
        return Failure.SERVER
    if status:
        return Failure.FATAL
    if isinstance(cause, (asyncio.TimeoutError, TimeoutError)):
        return Failure.TIMEOUT
    if isinstance(cause, ConnectionRefusedError):
        return Failure.CONNECT
    if isinstance(cause, ConnectionError):
        return Failure.SERVER
    # botocore's own exception types (imported here: a restore on the direct path has no botocore)
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError, ConnectTimeoutError, EndpointConnectionError,
        HTTPClientError, ReadTimeoutError,
    )

    if isinstance(cause, (ConnectTimeoutError, ReadTimeoutError)):
        return Failure.TIMEOUT
    if isinstance(cause, EndpointConnectionError):
        return Failure.CONNECT
    if isinstance(cause, (BotoConnectionError, HTTPClientError)) or _is_payload_error(e):
        return Failure.SERVER
    if isinstance(cause, OSError):  # unreachable network, DNS, TLS: the connection never worked
        return Failure.CONNECT
    return Failure.FATAL


def _is_payload_error(e: BaseException) -> bool:
    """A response body cut or reset mid-stream (aiohttp), like a broken connection."""
    try:
        from aiohttp import ClientPayloadError
    except ImportError:  # pragma: no cover - aiohttp comes with aiobotocore
        return False
    return isinstance(e, ClientPayloadError)
