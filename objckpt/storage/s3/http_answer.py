"""Reading an HTTP/1.1 answer off a :class:`~.wire.Conn`, for the direct S3 path,
as a client must when the server may be broken or hostile.

- Interim answers (``100 Continue``, ``103 Early Hints``) come before the real
  one and are skipped: a client that took them for the answer failed every
  request of a server that sends them.
- Every wait is bounded by the request's :class:`~.wire.Deadline` as well as by
  the per-read timeout, so a head or a body sent one byte a second ends.
- A chunked body is decoded as it streams into the caller's sink: nothing is
  buffered beyond one socket read, and a chunk announced larger than what was
  asked for is refused before any of it is read (it would otherwise be held
  whole, gigabytes for a few megabytes asked).
- A ``206`` must cover the range that was asked for (``Content-Range``): a range
  widened by the server (aligned by a CDN or cache) gives the asked bytes out of it.

Malformed answers raise :class:`BadAnswer`, a ``ConnectionError``: the retry
budget for broken connections applies, then the error is reported by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .wire import Conn, Deadline, ShortBody, Sink, receive

MAX_HEAD = 64 << 10  #: bytes of one answer head
MAX_INTERIM = 16  #: interim (1xx) answers skipped before the real one
MAX_CHUNK_LINE = 4 << 10  #: a chunk-size line with its extensions, or a trailer line
MAX_TRAILERS = 64 << 10  #: bytes of trailers after the last chunk
_SCRATCH = 1 << 20  #: bytes read at once when they are to be dropped
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")
_CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,15}")


class BadAnswer(ConnectionError):
    """The answer breaks HTTP/1.1 (or what S3 answers to the request sent)."""


class WrongRange(BadAnswer):
    """A ``206`` whose ``Content-Range`` does not cover the range that was asked for."""


@dataclass(frozen=True)
class Span:
    """Where the asked bytes are in a ``206``'s body: after ``before`` bytes, followed by
    ``after`` bytes nobody asked for (both 0 unless the server widened the range)."""

    before: int = 0
    after: int = 0


@dataclass
class Head:
    status: int
    headers: dict[str, str]
    body: Optional[Sink] = None  # a whole object's or a small answer's bytes (see DirectClient)

    @property
    def reusable(self) -> bool:
        """The server keeps the connection open after this answer."""
        return self.headers.get("connection", "").lower() != "close"


class Reader:
    """Reads the answers on one connection for one request: ``host`` names the
    endpoint in errors, ``dl`` bounds the request as a whole, ``per`` each wait."""

    def __init__(self, conn: Conn, host: str, dl: Deadline, first_byte: float, read_timeout: float) -> None:
        self.conn, self.host, self.dl = conn, host, dl
        self.first_byte, self.read_timeout = first_byte, read_timeout

    def recv(self, n: int, per: Optional[float] = None) -> bytes:
        """Up to ``n`` bytes off the socket (never ``b""``: a closed connection raises)."""
        self.conn.sock.settimeout(self.dl.bound(self.read_timeout if per is None else per))
        data = self.conn.sock.recv(n)
        if not data:
            raise ShortBody(f"{self.host} closed the connection mid-answer")
        self.dl.moved += len(data)
        return data

    # -- heads ----------------------------------------------------------------
    def head(self) -> Head:
        """The final answer's head; interim 1xx answers are read and dropped."""
        for _ in range(MAX_INTERIM + 1):
            h = self._one_head()
            if not 100 <= h.status < 200:
                return h
            if h.status == 101:
                raise BadAnswer(f"{self.host}: 101 Switching Protocols to a request that asked for no upgrade")
        raise BadAnswer(f"{self.host}: over {MAX_INTERIM} interim (1xx) answers before the real one")

    def _one_head(self) -> Head:
        buf = self.conn.extra
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > MAX_HEAD:
                raise BadAnswer(f"{self.host}: response head over {MAX_HEAD} bytes")
            try:
                buf += self.recv(16 << 10, self.first_byte)
            except ShortBody:
                raise ConnectionResetError(f"{self.host} closed the connection before answering") from None
        if end > MAX_HEAD:
            raise BadAnswer(f"{self.host}: response head over {MAX_HEAD} bytes")
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        del buf[:end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not re.fullmatch(r"\d{3}", parts[1]):
            raise BadAnswer(f"{self.host}: not an HTTP/1.1 answer: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if sep:
                headers[k.strip().lower()] = v.strip()
        return Head(int(parts[1]), headers)

    # -- bodies -----------------------------------------------------------------
    def deliver(self, data: memoryview, sink: Optional[Sink], skip: int) -> int:
        """``data`` into ``sink`` past the first ``skip`` bytes; the skip still left."""
        if sink is not None and len(data) > skip:
            sink.write(data[skip:])
        return max(0, skip - len(data))

    def drop(self, n: int) -> None:
        """Read ``n`` body bytes and drop them (a server that ignored Range, an
        error body's rest), a bounded piece at a time."""
        buf = self.conn.extra
        take = min(len(buf), n)
        del buf[:take]
        n -= take
        while n > 0:
            n -= len(self.recv(min(n, _SCRATCH)))

    def body(self, h: Head, sink: Optional[Sink], skip: int, strict: bool) -> bool:
        """Receive ``h``'s body into ``sink`` after dropping its first ``skip``
        bytes; True when the connection can be reused.  ``strict``: the sink is
        all that was asked for, so a chunk announced beyond it is a protocol
        error; otherwise the rest is not read and the connection is dropped."""
        if "chunked" in h.headers.get("transfer-encoding", "").lower():
            return self._chunked(h, sink, skip, strict)
        left = content_length(h, self.host)
        if left is None:
            raise BadAnswer(f"{self.host}: an answer without Content-Length or chunking")
        buf = self.conn.extra
        if buf:  # bytes read with the head
            take = bytes(buf[:left])
            del buf[:len(take)]
            left -= len(take)
            skip = self.deliver(memoryview(take), sink, skip)
        if skip:
            n = min(left, skip)
            self.drop(n)
            left -= n
        if sink is not None:
            left = receive(self.conn, sink, left, self.dl, self.read_timeout)
        if left > 0:  # more than the caller wants: read and drop a little, else close
            if left > 4 << 20:
                return False
            self.drop(left)
        return h.reusable

    def _line(self) -> bytes:
        """The next CRLF-ended line of a chunked body (without the CRLF), bounded."""
        buf = self.conn.extra
        while True:
            i = buf.find(b"\r\n", 0, MAX_CHUNK_LINE + 2)
            if i >= 0:
                line = bytes(buf[:i])
                del buf[:i + 2]
                return line
            if len(buf) > MAX_CHUNK_LINE:
                raise BadAnswer(f"{self.host}: a chunked body's line over {MAX_CHUNK_LINE} bytes")
            buf += self.recv(16 << 10)

    def _chunked(self, h: Head, sink: Optional[Sink], skip: int, strict: bool) -> bool:
        buf = self.conn.extra
        while True:
            text = self._line().partition(b";")[0].strip()
            if not _CHUNK_SIZE.fullmatch(text):
                raise BadAnswer(f"{self.host}: not a chunk size: {text[:40]!r}")
            size = int(text, 16)
            if size == 0:
                trailers = 0
                while True:
                    line = self._line()
                    if not line:
                        return h.reusable
                    trailers += len(line) + 2
                    if trailers > MAX_TRAILERS:
                        raise BadAnswer(f"{self.host}: over {MAX_TRAILERS} bytes of trailers")
            room = 0 if sink is None else sink.total - sink.got
            if size > skip + room:
                if strict:
                    raise BadAnswer(f"{self.host}: a chunk of {size} bytes announced where {skip + room} bytes "
                                    "were asked for (refused unread)")
                if skip + room == 0:
                    return False  # nothing more wanted: drop the connection, not the bytes
            left = size
            take = min(len(buf), left)
            if take:
                data = bytes(buf[:take])
                del buf[:take]
                left -= take
                skip = self.deliver(memoryview(data), sink, skip)
            if skip and left:
                n = min(skip, left)
                self.drop(n)
                skip -= n
                left -= n
            if left and sink is not None and sink.got < sink.total:
                left = receive(self.conn, sink, left, self.dl, self.read_timeout)
            if left:  # past what was wanted (not strict): the rest is not read
                return False
            if self._line():
                raise BadAnswer(f"{self.host}: a chunk longer than its announced {size} bytes")


def content_length(h: Head, host: str) -> Optional[int]:
    """The answer's Content-Length (``None`` if absent); a malformed one raises."""
    text = h.headers.get("content-length")
    if text is None:
        return None
    if not re.fullmatch(r"\d{1,19}", text):
        raise BadAnswer(f"{host}: malformed Content-Length {text[:40]!r}")
    return int(text)


def check_range(h: Head, lo: int, hi: int, what: str) -> Span:
    """Where bytes ``lo..`` are in a 206 to ``Range: bytes=lo-hi``, whose
    ``Content-Range`` ``a-b/total`` (and ``Content-Length``) must cover them:
    ``a <= lo <= b``.  A server may widen a range (``a < lo``, ``b > hi``: a CDN
    or cache aligning ranges; HTTP allows it) and may end it early (``b < hi``,
    where the object ends; the rest is asked for again).  Anything else is
    :class:`WrongRange` (its bytes would land at the wrong offsets, or be taken
    for a truncated object), naming the range asked for and the one answered.
    A 206 without ``Content-Range`` (HTTP requires one; S3 always sends it) is
    taken as the range asked for when its length fits it: botocore does not look.
    Both S3 transports judge 206 answers here."""
    text = h.headers.get("content-range")
    n = content_length(h, what)
    if text is None and (n is None or n <= hi - lo + 1):
        return Span()
    m = _CONTENT_RANGE.match(text or "")
    if m is None:
        raise WrongRange(f"{what}: asked for bytes {lo}-{hi}, the 206 answer has Content-Range {text!r}"
                         + (f" and Content-Length {n}" if n is not None else ""))
    a, b, total = int(m.group(1)), int(m.group(2)), m.group(3)
    if not a <= lo <= b or (total != "*" and b >= int(total)) or (n is not None and n != b - a + 1):
        raise WrongRange(f"{what}: asked for bytes {lo}-{hi}, the 206 answer holds {text!r}"
                         + (f" with Content-Length {n}" if n is not None else ""))
    return Span(lo - a, max(0, b - hi))
