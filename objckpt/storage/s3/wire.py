"""Body bytes between a socket and the caller's buffers, for the direct S3 path.

:class:`Sink` is where a response body lands: consecutive destination buffers
(tensor memory, staging), filled by ``recv_into`` with no copy of ours, each
piece hashed right there when the reader asked for it (``tally``).
:func:`receive` is the loop that fills it, waking once per :data:`RECV_LOWAT`
bytes on plain TCP rather than once per arriving segment.
:class:`Deadline` is the time one whole request may take; every blocking
call here waits no longer than what is left of it.
"""
from __future__ import annotations

import array
import ctypes
import errno
import os
import select
import socket
import ssl
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

try:
    import fcntl
    import termios
except ImportError:  # not a Unix: no low-water mark (see Conn.lowat)
    fcntl = termios = None  # type: ignore[assignment]

from ...checksum import CellCrcs

#: bytes a plain-TCP body receive waits for before it wakes (see :func:`receive`)
RECV_LOWAT = 1 << 20
#: the largest piece a :class:`GrowingSink` allocates at once
GROW_PIECE = 8 << 20
#: buffers at least this large are spliced on plain TCP, not copied (see :func:`send_views`)
SPLICE_MIN = 64 << 10
#: pipe sizes tried for splicing, largest first (1 MiB is the default limit for non-root)
PIPE_SIZES = (1 << 20, 256 << 10)
_F_SETPIPE_SZ = 1031
_LINUX = sys.platform.startswith("linux")


class ShortBody(ConnectionError):
    """The connection ended before the announced body did (retried for the rest)."""


class AnswerTimeout(TimeoutError):
    """A timeout after the endpoint began to answer (it is alive, not silent):
    retried under the timeout budget, then reported as what it says."""


class SlowAnswer(AnswerTimeout):
    """A request ran past its :class:`Deadline`: the peer moved its bytes slower than
    the minimum rate."""


def rate_text(bytes_per_s: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}/s"
    return f"{bytes_per_s:.3g} B/s"


@dataclass
class Deadline:
    """The time one request may take in all, head and body, both ways:
    ``max(floor, size / min_rate)`` seconds from its start.

    The per-read timeout bounds a silence; it does not bound a peer that sends
    one byte a second, which would hold a read (and its buffers) forever.  This
    does.  ``size`` is what the request moves as far as it is known (its body and
    the answer body asked for); :meth:`cover` grows it when an answer's head says
    more (a whole-object GET).  ``moved`` counts the bytes that did move, for the
    rate the error reports."""

    floor: float
    min_rate: float
    size: int = 0
    start: float = field(default_factory=time.monotonic)
    moved: int = 0
    at: float = field(init=False)

    def __post_init__(self) -> None:
        self.at = self.start + self.seconds()

    def seconds(self) -> float:
        return max(self.floor, self.size / self.min_rate)

    def cover(self, size: int) -> None:
        """The request moves ``size`` bytes in all (never less than said before)."""
        if size > self.size:
            self.size = size
            self.at = self.start + self.seconds()

    def bound(self, per_op: float) -> float:
        """``per_op`` seconds, or what is left of the deadline if that is less;
        :class:`SlowAnswer` when nothing is left."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise SlowAnswer("request deadline passed")
        return min(per_op, left)

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def error(self, what: str) -> SlowAnswer:
        """The exception for a request ``what`` that ran out of its deadline: what moved,
        at which rate, and the rule (with the options that set it)."""
        took = max(time.monotonic() - self.start, 1e-9)
        return SlowAnswer(
            f"{what}: {self.moved} bytes moved in {took:.1f} s ({rate_text(self.moved / took)}), "
            f"slower than the minimum rate: the request may take {self.seconds():.3g} s for its {self.size} bytes "
            f"= max(deadline_floor {self.floor:g} s, bytes / min_rate {rate_text(self.min_rate)}) "
            "(storage options deadline_floor, min_rate; OBJCKPT_S3_DEADLINE_FLOOR, OBJCKPT_S3_MIN_RATE)")


@dataclass
class Sink:
    """Consecutive destination buffers and how far they are filled.

    It outlives one attempt: after a broken response the retry asks for the
    rest of the range from ``got`` on.  With ``tally``, every piece is hashed
    in the receiving thread right after it landed, while it is still in the
    CPU cache (see :class:`~objckpt.checksum.CellCrcs`)."""

    views: list[memoryview]
    got: int = 0
    cancelled: bool = False  # set by the waiting side: stop writing into these buffers
    tally: Optional[CellCrcs] = None
    _vi: int = 0
    _vpos: int = 0
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in self.views if len(v)]
        self.total = sum(len(v) for v in self.views)

    def room(self) -> memoryview:
        """Where the next bytes go (the rest of the current buffer)."""
        return self.views[self._vi][self._vpos:]

    def advance(self, n: int) -> None:
        """``n`` more bytes were written at :meth:`room`."""
        if self.tally is not None:
            self.tally.feed(self.views[self._vi][self._vpos : self._vpos + n])
        self.got += n
        self._vpos += n
        if self._vpos == len(self.views[self._vi]):
            self._vi, self._vpos = self._vi + 1, 0

    def write(self, data: memoryview) -> None:
        while len(data) and self.got < self.total:
            room = self.room()
            n = min(len(room), len(data))
            room[:n] = data[:n]
            data = data[n:]
            self.advance(n)

    def data(self) -> bytes:
        """The bytes received, as one ``bytes``."""
        return b"".join(self.views)[:self.got]


class GrowingSink(Sink):
    """A sink of at most ``limit`` bytes whose memory is allocated as bytes arrive,
    in pieces of up to :data:`GROW_PIECE`: an answer that announces gigabytes and
    sends a few costs a few, not what it announced."""

    def __init__(self, limit: int) -> None:
        super().__init__([])
        self.total = limit

    def room(self) -> memoryview:
        if self._vi == len(self.views):
            self.views.append(memoryview(bytearray(min(GROW_PIECE, self.total - self.got))))
        return super().room()


class Conn:
    """One kept-alive connection and the bytes read past the last response head."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.extra = bytearray()
        self.used = False
        self.lowat = RECV_LOWAT if _plain_tcp(sock) else 1
        self.pipe: Optional[tuple[int, int]] = None  # for spliced sends (see send_views), made on first use
        # True while spliced body bytes may still sit in the socket: the kernel then holds
        # the caller's pages, not a copy, until the peer acknowledges them (a 2xx answer)
        self.lent = False

    def close(self) -> None:
        """Close; abortively while bytes are lent (see :func:`send_views`)."""
        try:
            if self.lent:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
        except OSError:
            pass
        if self.pipe is not None:
            for fd in self.pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.pipe = None


def _plain_tcp(sock: Any) -> bool:
    """Whether the low-water mark may be raised and pages spliced: plain TCP on Linux
    (the behaviour relied on is Linux's).  Under TLS the record layer reads what it
    needs (a mark above a record's size could stall it) and sends what it encrypted."""
    return (_LINUX and fcntl is not None and hasattr(socket, "SO_RCVLOWAT") and isinstance(sock, socket.socket)
            and not isinstance(sock, ssl.SSLSocket))


def _set_lowat(sock: socket.socket, n: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)


def receive(conn: Conn, sink: Sink, left: int, deadline: Optional[Deadline] = None,
            read_timeout: Optional[float] = None) -> int:
    """Receive up to ``left`` body bytes into ``sink`` (until it is full); the bytes
    of the body still unread.

    Each ``recv_into`` lands in the destination and is hashed there (``sink.tally``).
    On plain TCP the socket's receive low-water mark is raised to :data:`RECV_LOWAT`
    (never above what the body still holds), so the thread wakes once per MiB
    rather than for every segment that arrives: measured on a 1 GiB load from a
    local server, 0.44 -> 0.36 client CPU-s/GB (destinations resident).  A sender
    slower than the mark per read timeout is not a stalled one: when the wait times
    out with bytes queued, the mark goes back to 1 for this body and the read goes
    on; with nothing queued, the timeout is raised as before.  The mark is back at 1
    when this returns (the next response head is read byte-exact).

    With a ``deadline``, each read waits at most ``read_timeout`` (default: the
    socket's timeout) or what is left of the deadline, and its bytes count as moved."""
    sock, mark, cur = conn.sock, conn.lowat, 1
    per = sock.gettimeout() if read_timeout is None else read_timeout
    timeout = None if read_timeout is None else sock.gettimeout()
    try:
        while left > 0 and sink.got < sink.total:
            if sink.cancelled:
                raise ConnectionAbortedError("read cancelled")
            if deadline is not None and per is not None:
                t = deadline.bound(per)
                if t < per or timeout != per:  # near the deadline, each read may wait only for what is left
                    sock.settimeout(t)
                    timeout = t
            room = sink.room()
            want = min(len(room), left)
            lw = min(mark, want)
            if lw != cur:
                _set_lowat(sock, lw)
                cur = lw
            try:
                n = sock.recv_into(room, want)
            except TimeoutError:
                if cur <= 1 or not _queued(sock):
                    raise
                mark = 1  # a slow sender: wake for every byte, as without the mark
                continue
            if n == 0:
                raise ShortBody("connection closed mid-body")
            sink.advance(n)
            left -= n
            if deadline is not None:
                deadline.moved += n
    finally:
        if cur != 1:
            try:
                _set_lowat(sock, 1)
            except OSError:
                pass  # the connection is broken; it is closed, never reused
    return left


def _queued(sock: socket.socket) -> bool:
    """Whether received bytes wait unread in the socket (``FIONREAD``: a peeking
    ``recv`` would first wait for the low-water mark again)."""
    n = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, n)  # (only called where _plain_tcp)
    except OSError:
        return False
    return n[0] > 0


# -- sending: splice instead of copy --------------------------------------------------------
class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_vmsplice: Any = None  # libc's, once found; False where there is none
#: splicing is possible here (False for good once the kernel refused it)
SPLICE = hasattr(os, "splice") and _LINUX


def _get_vmsplice() -> Any:
    global _vmsplice
    if _vmsplice is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).vmsplice
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_size_t, ctypes.c_uint]
            fn.restype = ctypes.c_ssize_t
            _vmsplice = fn
        except (OSError, AttributeError):
            _vmsplice = False
    return _vmsplice


def _pipe(conn: Conn) -> Optional[tuple[int, int]]:
    """The connection's pipe for splicing, at least 256 KiB; None where none can be had."""
    if conn.pipe is None:
        r, w = os.pipe2(os.O_CLOEXEC)
        for size in PIPE_SIZES:
            try:
                fcntl.fcntl(w, _F_SETPIPE_SZ, size)
                conn.pipe = (r, w)
                break
            except OSError:  # over the user's pipe limits: copy instead
                continue
        else:
            os.close(r)
            os.close(w)
            return None
    return conn.pipe


def send_views(conn: Conn, views: "list[memoryview] | tuple[memoryview, ...]", deadline: Optional[Deadline] = None,
               stall: Optional[float] = None, splice: bool = False) -> None:
    """Send ``views`` in order.  With ``splice`` (the store's ``OBJCKPT_SPLICE_BODIES``, read
    when it opened: :mod:`.request_settings`, off by default), on plain TCP (Linux) each large
    writable buffer is spliced: ``vmsplice`` lends its pages to a pipe and ``splice`` moves them into the
    socket, so the kernel sends from the caller's memory instead of copying it first
    (the copy was ~40% of a save's client CPU on a local server).  The caller's bytes
    must not change until the answer comes (tensors of a blocking save, staging
    buffers held until their upload returns): a 2xx answer means the peer read them
    all; until then ``conn.lent`` is set and :meth:`Conn.close` discards what the
    socket still holds (an abortive close) rather than let it go out later.

    Time: the peer must take some bytes every ``stall`` seconds (default: the
    socket's timeout), and all of them before the ``deadline``; without one, the
    socket's timeout bounds each body buffer whole (as ``sendall`` does).  A
    64 MiB body leaves in about 40 ``send`` calls on loopback: the loop costs
    nothing measurable next to ``sendall``."""
    splice = splice and SPLICE and _plain_tcp(conn.sock)
    per = conn.sock.gettimeout() if stall is None else stall
    for v in views:
        if splice and len(v) >= SPLICE_MIN and not v.readonly and v.contiguous and _splice(conn, v, deadline, per):
            continue
        if deadline is None or per is None:
            conn.sock.sendall(v)
            continue
        off, cur = 0, -1.0
        while off < len(v):  # send() takes what the socket has room for: each wait is bounded anew
            t = deadline.bound(per)
            if t != cur:  # only near the deadline does the bound change
                conn.sock.settimeout(t)
                cur = t
            n = conn.sock.send(v[off:])
            off += n
            deadline.moved += n


def _splice(conn: Conn, v: memoryview, dl: Optional[Deadline] = None, stall: Optional[float] = None) -> bool:
    """Splice all of ``v`` into the socket; False (nothing sent) where splicing is not
    available, after which it is not tried again.  Waits as :func:`send_views` says."""
    global SPLICE
    vmsplice = _get_vmsplice()
    pipe = _pipe(conn) if vmsplice else None
    if pipe is None:
        return False
    r, w = pipe
    addr = ctypes.addressof(ctypes.c_char.from_buffer(v))
    fd = conn.sock.fileno()
    timeout = conn.sock.gettimeout()
    deadline = None if timeout is None or dl is not None else time.monotonic() + timeout  # all of v, as sendall's
    wait = select.poll()
    wait.register(fd, select.POLLOUT)
    off, total = 0, len(v)
    while off < total:
        n = vmsplice(w, ctypes.byref(_Iovec(addr + off, total - off)), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            if off == 0 and err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                SPLICE = False  # e.g. a sandbox without vmsplice: copy from now on
                return False
            raise OSError(err, f"vmsplice: {os.strerror(err)}")
        left = n
        while left:
            try:
                sent = os.splice(r, fd, left)
            except BlockingIOError:  # the socket is full (it is non-blocking under a timeout)
                if dl is not None:
                    ms: Optional[float] = None if stall is None else dl.bound(stall) * 1000
                else:
                    ms = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
                if not wait.poll(ms):
                    raise TimeoutError("timed out sending the request body") from None
                continue
            except OSError as e:
                if off == 0 and left == n and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    conn.close()  # the pipe holds pages nobody will read: drop it with the connection
                    SPLICE = False
                    raise ConnectionAbortedError("splice into the socket refused; sending by copy from now on") from e
                raise
            conn.lent = True
            left -= sent
            if dl is not None:
                dl.moved += sent
        off += n
    return True
