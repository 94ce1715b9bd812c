"""A counting HTTP proxy: put it in front of an S3 endpoint (moto) to count real requests.

Why: "how many requests does ``latest_step()`` make" must be measured where
the requests are — on the wire — not by a wrapper around the store, which
would miss what the client does on its own (a HeadBucket to tell a missing
key from a missing bucket, retries, redirects).  Every request the client
sends through the proxy is forwarded unchanged (HTTP/1.1, keep-alive) and
recorded as a :class:`Request` with its S3 operation class.

    with CountingProxy(moto_endpoint) as proxy:
        opts = {..., "endpoint_url": proxy.url}
        ...
        proxy.requests  # [Request(method="GET", path="/bucket/run/_objckpt_index/head.json", ...)]
"""
from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_HOP = {"connection", "keep-alive", "expect", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    status: int

    @property
    def kind(self) -> str:
        """LIST (a bucket listing), GET, PUT, HEAD, DELETE, POST."""
        parts = self.path.strip("/").split("/", 1)
        q = parse_qs(self.query, keep_blank_values=True)
        if self.method == "GET" and len(parts) == 1 and ("list-type" in q or "prefix" in q or not q):
            return "LIST"
        return self.method


class CountingProxy:
    """A threaded reverse proxy to ``upstream`` (``http://host:port``) on a free local port."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self._upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def reset(self) -> None:
        with self._lock:
            self._requests.clear()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests:
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def start(self) -> "CountingProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "CountingProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _record(self, r: Request) -> None:
        with self._lock:
            self._requests.append(r)

    def _handler_class(self) -> type:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body if length else None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    u = urlsplit(self.path)
                    proxy._record(Request(self.command, u.path, u.query, resp.status))
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", resp.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD" and data:
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler


class DropsIfNoneMatch(CountingProxy):
    """An S3-compatible endpoint that accepts ``If-None-Match`` and ignores it, as some do:
    the upstream (moto) behind a proxy that drops the header, so every request still
    reaches a real S3 server over HTTP, and is counted."""

    def _handler_class(self) -> type:
        base = super()._handler_class()

        class Handler(base):  # type: ignore[valid-type, misc]
            def _forward(self) -> None:
                del self.headers["If-None-Match"]
                super()._forward()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
