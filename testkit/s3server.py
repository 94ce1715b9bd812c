"""In-memory S3-compatible HTTP server: a BENCHMARK AND TEST TARGET ONLY, not a store.

Nothing is persisted or authenticated (SigV4 signatures are not checked: only
``x-amz-date`` against the server's clock, and credentials are refused on demand);
ETags are a counter, NOT MD5 digests; Content-MD5 is not verified, of
x-amz-checksum-* only crc32c (unless told not to); aws-chunked bodies get 501; no
versioning, ACLs, encryption or lifecycle.

Why: moto ingests multipart parts at ~50 MB/s and reads whole objects per
ranged GET, so behind moto every client looks equally slow.  Here object bytes
are never copied after aiohttp parsed them: a body stays the list of chunks it
arrived in, completing an upload concatenates the parts' chunk lists, and a
ranged GET writes memoryview slices of those chunks.  For benchmarks run it in
its own process (``python -m testkit.s3server --port 0``, or this file
as a script, which skips importing torch) so its CPU is not charged to the
client; the first stdout line is the endpoint URL.  Path-style addressing only.

Control endpoints, never counted in the stats:
``GET /_objckpt/stats`` -> ``{"requests": {"GET": n, ...}, "ops": {"UploadPart": n, ...},
"bytes_in": n, "bytes_out": n}`` (object bytes of PutObject/UploadPart in, GetObject out);
``POST /_objckpt/reset_stats``; ``POST /_objckpt/reset`` (drop everything, zero stats);
``POST /_objckpt/fail?op=UploadPart&count=N&status=500``: the next N such operations
(``op=*``: any) fail after reading their body, with an S3 XML error (500 InternalError,
503 SlowDown, else ``&code=`` or InjectedFault);
``POST /_objckpt/lose_reply?op=CompleteMultipartUpload&count=N``: the next N such operations
are carried out, then their connection is closed unanswered (a reply lost on the network);
``POST /_objckpt/widen_ranges?align=N``: ranged GETs are answered with the range widened to
multiples of N bytes (a valid 206 that starts before the asked offset, as aligning CDNs send;
0: off).  A HEAD (or whole GET) with ``x-amz-checksum-mode: ENABLED`` returns the object's
stored ``x-amz-checksum-crc32c``, as S3 does.

``POST /_objckpt/clock?offset=S``: the server's clock runs S seconds off (requests signed more
than 15 minutes off it: 403 RequestTimeTooSkewed, error answers carry its ``Date``);
``POST /_objckpt/refuse_credentials?code=ExpiredToken``: every request refused with that code
(``code=``: off); ``POST /_objckpt/checksums?checked=false``: checksums accepted unchecked and
none reported back, as Ceph RGW does. In process only (:class:`S3Server`): ``refuse_checksum_headers``
(object requests carrying ``x-amz-checksum-*`` answered 400, as stores without flexible checksums
do) and ``keep_headers`` / ``headers_seen`` (each request's operation and headers).

Three modules: ``s3memstore`` (buckets, objects, uploads, stats, faults), ``s3protocol``
(the S3 REST operations over aiohttp) and this one (running it: :class:`S3Server` on a
thread for tests, :func:`main` as its own process for benchmarks).  Run as a script, this
file imports its siblings as top-level modules, so the objckpt package (and torch) is
never imported.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import signal
import socket
import threading
from typing import Any, Dict, List, Optional

from aiohttp import web

if __package__:
    from .s3memstore import _DEFAULT_MIN_PART, S3Error
    from .s3protocol import _S3App
else:  # ``python testkit/s3server.py``: its folder is on sys.path; the package would import torch
    from s3memstore import _DEFAULT_MIN_PART, S3Error  # type: ignore[no-redef]
    from s3protocol import _S3App  # type: ignore[no-redef]

__all__ = ["S3Error", "S3Server", "main", "make_app"]


# ---- running it -------------------------------------------------------------------------------
def make_app(state: Optional[_S3App] = None) -> web.Application:
    """An aiohttp application with one catch-all route (keys may hold any character)."""
    app = web.Application(client_max_size=1 << 40)
    app.router.add_route("*", "/{tail:.*}", (state or _S3App()).handle)
    return app


async def _serve(state: _S3App, sock: socket.socket) -> web.AppRunner:
    # read_bufsize: fewer pause/resume cycles of the socket while large bodies stream in
    # shutdown_timeout: a stop waits this long for requests still in flight, then cancels them
    # (aiohttp's 60 s default would outlast S3Server.stop's own wait)
    runner = web.AppRunner(make_app(state), access_log=None, read_bufsize=1 << 20, handle_signals=False,
                           shutdown_timeout=2.0)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=1024).start()
    return runner


def _bind(host: str, port: int) -> socket.socket:
    """Bind before starting, so port 0 gives a known port and no race (pytest-xdist safe)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class S3Server:
    """The server on a background thread with its own event loop, for tests.

    Benchmarks should run it in another process (``python -m testkit.s3server``)
    so that its CPU time is not counted as the client's.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, min_part_size: int = _DEFAULT_MIN_PART,
                 latency_s: float = 0.0) -> None:
        self.host, self.port = host, port
        self.state = _S3App(min_part_size, latency_s)
        self.endpoint_url = ""
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> str:
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self.endpoint_url = f"http://{self.host}:{self.port}"
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="objckpt-s3server", daemon=True)
        self._thread.start()  # set up on that thread too: start() may be called from inside a running loop
        self._runner = asyncio.run_coroutine_threadsafe(_serve(self.state, sock), loop).result(timeout=30)
        return self.endpoint_url

    def _call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` on the server loop: the state is only ever touched from that thread."""
        assert self._loop is not None, "server not started"

        async def call() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def stats(self) -> Dict[str, Any]:
        return self._call(self.state.stats)

    def reset_stats(self) -> None:
        self._call(self.state.reset_stats)

    def reset(self) -> None:
        self._call(self.state.reset)

    def fail(self, op: str = "*", count: int = 1, status: int = 500, code: str = "") -> None:
        """The next ``count`` ``op`` operations answer ``status`` with an S3 XML error."""
        self._call(self.state.add_fault, op, count, status, code)

    def clear_faults(self) -> None:
        """Forget the faults :meth:`fail` set that were not used up."""
        self._call(self.state.faults.clear)

    def throttle(self, max_in_flight: int) -> None:
        """Answer 503 SlowDown to requests beyond ``max_in_flight`` at once (0: off)."""
        self._call(self.state.set_throttle, max_in_flight)

    def corrupt(self, count: int = 1) -> None:
        """Flip one byte of each of the next ``count`` uploaded bodies (damage in flight)."""
        self._call(self.state.set_corrupt, count)

    def set_clock(self, offset_s: float) -> None:
        """Run the server's clock ``offset_s`` seconds off the host's: requests signed more
        than 15 minutes off it get 403 RequestTimeTooSkewed (bare to a HEAD), as on S3."""
        self._call(self.state.set_clock, offset_s)

    def refuse_credentials(self, code: str) -> None:
        """Refuse every request as S3 refuses bad credentials, with ``code`` (ExpiredToken,
        InvalidToken, SignatureDoesNotMatch, InvalidAccessKeyId, AccessDenied; bare to a
        HEAD); "": accept them again."""
        self._call(self.state.refuse_credentials, code)

    def check_checksums(self, on: bool) -> None:
        """False: accept any ``x-amz-checksum-crc32c`` unchecked and report none back, as
        Ceph RGW does; True (the default): refuse a body that does not match it."""
        self._call(self.state.set_checksums_checked, on)

    def refuse_checksum_headers(self, on: bool) -> None:
        """True: refuse object requests carrying ``x-amz-checksum-*`` headers (400
        InvalidArgument), as S3-compatible stores without flexible checksums do."""
        self._call(self.state.set_checksum_headers_refused, on)

    def keep_headers(self, on: bool = True) -> None:
        """Keep each S3 request's (operation, headers) from now on (:meth:`headers_seen`)."""
        self._call(self.state.keep_headers, on)

    def headers_seen(self) -> List[Any]:
        """(operation, headers with lower-cased names) of each S3 request since :meth:`keep_headers`."""
        return self._call(lambda: list(self.state.seen_headers or ()))

    def lose_reply(self, op: str = "*", count: int = 1) -> None:
        """The next ``count`` ``op`` operations are carried out, then their connection is
        closed before any answer (a reply lost on the network)."""
        self._call(self.state.add_lost_reply, op, count)

    def widen_ranges(self, align: int) -> None:
        """Answer ranged GETs with the range widened to multiples of ``align`` bytes (0: off)."""
        self._call(self.state.set_widen_ranges, align)

    def stop(self) -> None:
        loop, thread, runner = self._loop, self._thread, self._runner
        if loop is None or thread is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._loop = self._thread = self._runner = None

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _retain_freed_memory() -> None:
    """Ask glibc to serve body-sized chunks from its heap and keep freed memory.

    Why: on some VMs the first touch of fresh pages costs 2-3 CPU-s/GB, which would
    dominate the server's cost on every round of a benchmark; this way only the first
    round pays it (benchmarks should warm up).  A no-op off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's maximum
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: do not give memory back
    except (OSError, AttributeError):
        pass


def main(argv: Optional[List[str]] = None) -> None:
    """Foreground server; prints the endpoint URL as its first stdout line, exits on SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(description="In-memory S3-compatible server for objckpt benchmarks and tests.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--min-part-size", type=int, default=_DEFAULT_MIN_PART)
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay per S3 request (emulate a remote store)")
    args = p.parse_args(argv)
    _retain_freed_memory()  # process-wide, so only here and not in S3Server (it lives in the test process)
    sock = _bind(args.host, args.port)

    async def run() -> None:
        runner = await _serve(_S3App(args.min_part_size, args.latency_ms / 1000.0), sock)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT alone is ignored in background shell jobs
            try:
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # no signal handlers here (e.g. Windows)
                pass
        print(f"http://{args.host}:{sock.getsockname()[1]}", flush=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
