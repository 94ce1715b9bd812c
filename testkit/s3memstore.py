"""The in-memory state behind the test S3 server: buckets, objects, multipart uploads,
request statistics and pending injected faults.

Object bytes are never copied after aiohttp parsed them: a body stays the list of
chunks it arrived in (:class:`_Data`), completing an upload concatenates the parts'
chunk lists, and a ranged read yields memoryview slices of those chunks.  That is the
whole reason this server exists (moto copies and re-reads whole objects), so the
representation lives here, apart from the HTTP layer in ``s3protocol``.

Standard library only (no aiohttp, nothing from objckpt): ``python
testkit/s3server.py`` loads it as a plain sibling module, without importing torch.
"""
from __future__ import annotations

import bisect
import calendar
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple, Union

Buffer = Union[bytes, bytearray]
_DEFAULT_MIN_PART = 5 << 20  # S3's minimum for every part but the last
_MAX_SKEW_S = 15 * 60  # how far S3 lets a request's signing time be from its clock
#: S3's refusals of credentials: code -> (status, message)
_CREDENTIAL_REFUSALS = {
    "ExpiredToken": (400, "The provided token has expired."),
    "InvalidToken": (400, "The provided token is malformed or otherwise invalid."),
    "SignatureDoesNotMatch": (403, "The request signature we calculated does not match the signature you provided. "
                                   "Check your key and signing method."),
    "InvalidAccessKeyId": (403, "The AWS Access Key Id you provided does not exist in our records."),
    "AccessDenied": (403, "Access Denied"),
}


class S3Error(Exception):
    """An S3 error answer: HTTP status plus the XML ``<Code>`` that botocore maps to an exception."""

    def __init__(self, status: int, code: str, message: str = "", resource: str = "") -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.resource = status, code, message or code, resource


class _Data:
    """Immutable object bytes kept as the chunks they arrived in.  Never joined:
    completing a 1 GiB upload is O(parts) and does not double the server's memory."""

    __slots__ = ("chunks", "starts", "size")

    def __init__(self, chunks: List[Buffer]) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self.starts = list(itertools.accumulate((len(c) for c in self.chunks[:-1]), initial=0))
        self.size = self.starts[-1] + len(self.chunks[-1]) if self.chunks else 0

    @classmethod
    def concat(cls, parts: List["_Data"]) -> "_Data":
        return cls([c for p in parts for c in p.chunks])

    def views(self, start: int, end: int) -> Iterator[memoryview]:
        """memoryview slices covering [start, end): no byte is copied."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while start < end and i < len(self.chunks):
            c, s0 = self.chunks[i], self.starts[i]
            lo, hi = start - s0, min(len(c), end - s0)
            if hi > lo:
                yield memoryview(c)[lo:hi]
                start = s0 + hi
            i += 1

    def tobytes(self) -> bytes:
        return b"".join(self.chunks)


_EMPTY = _Data([])


@dataclass
class _Obj:
    data: _Data
    etag: str
    mtime: float
    content_type: str = "binary/octet-stream"
    meta: Dict[str, str] = field(default_factory=dict)
    crc32c: str = ""  # the x-amz-checksum-crc32c it was written with ("" when none)


@dataclass
class _Upload:
    key: str
    upload_id: str
    initiated: float
    content_type: str
    meta: Dict[str, str]
    parts: Dict[int, _Obj] = field(default_factory=dict)
    checksum_algorithm: str = ""


@dataclass
class _Bucket:
    created: float
    objects: Dict[str, _Obj] = field(default_factory=dict)
    uploads: Dict[str, _Upload] = field(default_factory=dict)


class _State:
    """Buckets, request statistics and pending faults.  Everything runs on one event loop
    (the server's), so no locks; :class:`s3protocol._S3App` adds the request handling."""

    def __init__(self, min_part_size: int = _DEFAULT_MIN_PART, latency_s: float = 0.0) -> None:
        self.min_part_size, self.latency_s = min_part_size, latency_s
        self.buckets: Dict[str, _Bucket] = {}
        self.faults: List[List[Any]] = []  # [op, remaining, status, code]
        self.throttle_above = 0  # > 0: answer 503 SlowDown to requests beyond this many in flight
        self.corrupt_bodies = 0  # > 0: flip a byte of the next uploaded bodies (damage in flight)
        self.lost_replies: List[List[Any]] = []  # [op, remaining]: done, then the connection dropped unanswered
        self.widen_ranges = 0  # > 0: answer ranged GETs with the range widened to this alignment (as CDNs do)
        self.in_flight = 0
        self._etags = itertools.count(1)
        self._reset_quirks()
        self.reset_stats()

    # ---- control (in-process via S3Server, or over HTTP) ------------------------------------
    def reset_stats(self) -> None:
        self.requests = {m: 0 for m in ("GET", "PUT", "POST", "HEAD", "DELETE")}
        self.ops: Dict[str, int] = {}
        self.bytes_in = self.bytes_out = 0

    def reset(self) -> None:
        self.buckets.clear()
        self.faults.clear()
        self.throttle_above = 0
        self.corrupt_bodies = 0
        self.lost_replies.clear()
        self.widen_ranges = 0
        self._reset_quirks()
        self.reset_stats()

    def stats(self) -> Dict[str, Any]:
        return {"requests": dict(self.requests), "ops": dict(self.ops), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out}

    def add_fault(self, op: str = "*", count: int = 1, status: int = 500, code: str = "") -> None:
        if count > 0:
            code = code or {500: "InternalError", 503: "SlowDown"}.get(status, "InjectedFault")
            self.faults.append([op, count, status, code])

    def add_lost_reply(self, op: str = "*", count: int = 1) -> None:
        """The next ``count`` ``op`` operations are carried out, then their connection is
        closed before any answer: the client cannot tell whether they happened (a reply
        lost on the network)."""
        if count > 0:
            self.lost_replies.append([op, count])

    def take_lost_reply(self, op: str) -> bool:
        """Whether the answer to this ``op``, just carried out, is to be lost."""
        for f in self.lost_replies:
            if f[0] in (op, "*"):
                f[1] -= 1
                if f[1] <= 0:
                    self.lost_replies.remove(f)
                return True
        return False

    def set_widen_ranges(self, align: int) -> None:
        """Answer a ranged GET with a 206 of the range widened outwards to multiples of
        ``align`` bytes (within the object), as a CDN or cache that aligns ranges does;
        0: the range asked for."""
        self.widen_ranges = max(0, int(align))

    def widened(self, start: int, end: int, size: int) -> "tuple[int, int]":
        """[start, end) as answered: widened when :meth:`set_widen_ranges` says so."""
        a = self.widen_ranges
        if a <= 0:
            return start, end
        return start - start % a, min(size, -(-end // a) * a)

    # ---- a store's clock, credentials and checksums ------------------------------------------
    def _reset_quirks(self) -> None:
        self.clock_offset = 0.0  # seconds the server's clock runs ahead of the host's (negative: behind)
        self.refused_code = ""  # an S3 code of refused credentials: every request is answered so
        self.checks_checksums = True  # False: x-amz-checksum-* accepted unchecked, none stored or echoed (Ceph RGW)
        self.refuses_checksum_headers = False  # True: object requests carrying x-amz-checksum-* are refused (400)
        self.seen_headers: Optional[Deque[Tuple[str, Dict[str, str]]]] = None  # (op, headers) per request, when kept

    def set_clock(self, offset_s: float) -> None:
        """Run the server's clock ``offset_s`` seconds off the host's: a request whose
        ``x-amz-date`` is more than 15 minutes off it is refused (403
        RequestTimeTooSkewed), as S3 does, and error answers carry its ``Date``."""
        self.clock_offset = float(offset_s)

    def refuse_credentials(self, code: str) -> None:
        """Refuse every request with S3's ``code`` for bad credentials (ExpiredToken,
        InvalidToken: 400; SignatureDoesNotMatch, InvalidAccessKeyId, AccessDenied: 403),
        as S3 refuses keys it does not accept; "": accept them again."""
        if code and code not in _CREDENTIAL_REFUSALS:
            raise ValueError(f"refuse_credentials: {code!r} is none of {sorted(_CREDENTIAL_REFUSALS)}")
        self.refused_code = code

    def set_checksums_checked(self, on: bool) -> None:
        """False: behave as a store that ignores ``x-amz-checksum-crc32c`` (Ceph RGW): a
        part or object whose bytes do not match it is accepted, and no checksum is stored
        or reported back."""
        self.checks_checksums = bool(on)

    def set_checksum_headers_refused(self, on: bool) -> None:
        """True: refuse every object request (all but DeleteObjects, whose checksum S3
        requires) that carries an ``x-amz-checksum-*`` header (``-crc32c``, ``-algorithm``,
        ``-mode``...) with 400 InvalidArgument, as S3-compatible stores without flexible
        checksums do."""
        self.refuses_checksum_headers = bool(on)

    def check_checksum_headers(self, op: str, headers: Any) -> None:
        if self.refuses_checksum_headers and op != "DeleteObjects":
            said = sorted(k.lower() for k in headers if k.lower().startswith("x-amz-checksum-"))
            if said:
                raise S3Error(400, "InvalidArgument", f"this store does not support the header {said[0]}")

    def keep_headers(self, on: bool) -> None:
        """True: keep each S3 request's operation and headers (lower-cased names; the
        last 10000) in :attr:`seen_headers`, emptied; False: keep none."""
        self.seen_headers = collections.deque(maxlen=10000) if on else None

    def now(self) -> float:
        """The server's clock."""
        return time.time() + self.clock_offset

    def check_credentials(self, amz_date: str) -> None:
        """Refuse the request as S3 refuses credentials (see :meth:`refuse_credentials`,
        :meth:`set_clock`); ``amz_date``: its ``x-amz-date`` (``YYYYMMDDTHHMMSSZ``)."""
        if self.refused_code:
            status, message = _CREDENTIAL_REFUSALS[self.refused_code]
            raise S3Error(status, self.refused_code, message)
        try:
            signed = calendar.timegm(time.strptime(amz_date, "%Y%m%dT%H%M%SZ"))
        except ValueError:
            return  # unsigned, or signed without x-amz-date: nothing to compare
        if abs(self.now() - signed) > _MAX_SKEW_S:
            raise S3Error(403, "RequestTimeTooSkewed",
                          "The difference between the request time and the current time is too large.")

    def set_throttle(self, max_in_flight: int) -> None:
        """Emulate a throttling bucket: requests beyond ``max_in_flight`` at once get 503 SlowDown (0: off)."""
        self.throttle_above = max(0, int(max_in_flight))

    def set_corrupt(self, count: int) -> None:
        """Flip one byte of each of the next ``count`` uploaded bodies (PutObject, UploadPart)
        after they arrive, as a damaged network path would."""
        self.corrupt_bodies = max(0, int(count))

    def take_corruption(self, body: _Data) -> _Data:
        """``body`` with one byte flipped when a corruption is pending, else ``body``."""
        if self.corrupt_bodies <= 0 or body.size == 0:
            return body
        self.corrupt_bodies -= 1
        first = bytearray(body.chunks[0])
        first[len(first) // 2] ^= 0xFF
        return _Data([bytes(first)] + body.chunks[1:])

    def _check_fault(self, op: str) -> None:
        if self.throttle_above and self.in_flight > self.throttle_above:
            raise S3Error(503, "SlowDown", f"more than {self.throttle_above} requests in flight")
        for f in self.faults:
            if f[0] in (op, "*"):
                f[1] -= 1
                if f[1] <= 0:
                    self.faults.remove(f)
                raise S3Error(f[2], f[3], f"injected fault for {op}")

    def _etag(self, parts: int = 0) -> str:
        """Unique per write; deliberately not an MD5 (hashing would cost ~1.5 s/GB)."""
        return f'"{next(self._etags):032x}-{parts}"' if parts else f'"{next(self._etags):032x}"'
