"""A raw-socket HTTP/1.1 server that answers S3 object requests the way a broken or
hostile endpoint does, for tests of objckpt's own HTTP client (storage/s3/direct.py).

It serves one object, ``data``, under any key: a ranged GET gets its bytes, a
whole GET all of them, a HEAD their size, a PUT or POST is read and answered
200.  ``mode`` (settable between requests) says how it misbehaves:

- ``ok``: as a plain server would;
- ``trickle_head``: the answer's head one byte per ``interval`` seconds;
- ``trickle_body``: a proper head, then the body one byte per ``interval``;
- ``continue``: ``100 Continue`` and ``103 Early Hints`` before every real answer;
- ``chunked``: the body in small chunks, with chunk extensions and a trailer;
- ``huge_chunk``: a 206 whose chunked body announces a 1 GiB chunk, then sends
  ``flood`` zero bytes of it as fast as it can and stalls;
- ``wrong_range``: a 206 that holds the bytes one past those asked for, and says so;
- ``widen_range``: a valid 206 of the asked range widened to multiples of ``WIDEN``
  bytes (within the object), as a CDN or cache aligning ranges sends, and says so;
- ``huge_length``: every answer announces a Content-Length of 1 TiB, sends a few
  bytes and stalls;
- ``slow_reader``: request bodies are read 64 KiB per ``interval`` seconds.

Threads, port 0; every connection's socket is closed by :meth:`close`.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable, Optional

HUGE = 1 << 30
WIDEN = 64 << 10  #: the alignment of ``widen_range`` answers


class HostileServer:
    def __init__(self, data: bytes, mode: str = "ok", interval: float = 0.05, flood: int = 0) -> None:
        self.data, self.mode, self.interval, self.flood = data, mode, interval, flood
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []  # request lines, in order
        self.sent = 0  # body bytes sent, all answers together
        self.connections = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for c in list(self._conns):
            try:
                c.close()
            except OSError:
                pass

    def __enter__(self) -> "HostileServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(c)
            self.connections += 1
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        buf = b""
        try:
            while not self._stop.is_set():
                while b"\r\n\r\n" not in buf:
                    d = c.recv(65536)
                    if not d:
                        return
                    buf += d
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
                n = int(headers.get("content-length", "0"))
                if self.mode == "continue":
                    c.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
                while len(buf) < n:  # the request body (PUT, POST)
                    if self.mode == "slow_reader" and self._stop.wait(self.interval):
                        return
                    d = c.recv(64 << 10 if self.mode == "slow_reader" else 1 << 20)
                    if not d:
                        return
                    buf += d
                buf = buf[n:]
                self.requests.append(lines[0])
                if not self._answer(c, lines[0].split(" ")[0], headers.get("range")):
                    return
        except OSError:
            return

    def _answer(self, c: socket.socket, method: str, rng: Optional[str]) -> bool:
        """Answer one request; False when the connection is to end."""
        d = self.data
        if self.mode == "huge_length":
            c.sendall(b"HTTP/1.1 200 OK\r\nx-amz-request-id: r\r\nContent-Length: %d\r\n\r\n<?xml" % (1 << 40))
            self._stop.wait()
            return False
        if method in ("PUT", "POST"):
            body = b"<Result><UploadId>u1</UploadId><ETag>\"e\"</ETag></Result>" if method == "POST" else b""
            c.sendall(b"HTTP/1.1 200 OK\r\nETag: \"e\"\r\nx-amz-request-id: r\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            return True
        lo, hi = 0, len(d) - 1
        status = b"200 OK"
        extra = b""
        if rng is not None:
            lo, hi = (int(x) for x in rng.split("=")[1].split("-"))
            hi = min(hi, len(d) - 1)
            status = b"206 Partial Content"
            if self.mode == "wrong_range":
                lo, hi = lo + 1, min(hi + 1, len(d) - 1)
            elif self.mode == "widen_range":
                lo, hi = lo - lo % WIDEN, min(len(d) - 1, hi - hi % WIDEN + WIDEN - 1)
            extra = b"Content-Range: bytes %d-%d/%d\r\n" % (lo, hi, len(d))
        body = d[lo:hi + 1]
        common = b"HTTP/1.1 " + status + b"\r\nx-amz-request-id: r\r\nETag: \"e\"\r\n" + extra
        if self.mode == "huge_chunk":
            c.sendall(common + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % HUGE)
            zeros = memoryview(bytes(1 << 20))
            left = self.flood
            while left > 0:
                n = min(left, len(zeros))
                c.sendall(zeros[:n])
                left -= n
            self._stop.wait()  # stall: the rest never comes
            return False
        if self.mode == "chunked":
            out = [common + b"Transfer-Encoding: chunked\r\n\r\n"]
            for i in range(0, len(body), 7777):
                piece = body[i:i + 7777]
                out.append(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            out.append(b"0\r\nx-amz-checksum-crc32c: AAAAAA==\r\n\r\n")
            c.sendall(b"".join(out))
            self.sent += len(body)
            return True
        answer = common + b"Content-Length: %d\r\n\r\n" % len(body) + (b"" if method == "HEAD" else body)
        if self.mode == "trickle_head":
            return self._trickle(c, answer)
        if self.mode == "trickle_body":
            head_end = answer.index(b"\r\n\r\n") + 4
            c.sendall(answer[:head_end])
            return self._trickle(c, answer[head_end:])
        c.sendall(answer)
        self.sent += len(body)
        return True

    def _trickle(self, c: socket.socket, data: bytes) -> bool:
        for i in range(len(data)):
            if self._stop.wait(self.interval):
                return False
            c.sendall(data[i:i + 1])
            self.sent += 1
        return True


def wait_for(fn: Callable[[], object], limit: float = 60.0) -> tuple[bool, object]:
    """Run ``fn`` in a thread; (returned in time, its result or exception).  Used so
    that a client that hangs fails the test instead of hanging it."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    return (not t.is_alive()), (out[0] if out else None)

