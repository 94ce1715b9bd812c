"""An HTTP server that is not S3: every request gets the same HTML page.

It stands for an endpoint URL that points at the wrong port (a storage
console, a dashboard, a proxy's own page): ``status`` 200 answers every GET,
HEAD, PUT and POST with a page, 404 with a "not found" page.  It records the
requests it saw, so a test can check that nothing was written.
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PAGE = (b"<!DOCTYPE html><html><head><title>Storage Console</title></head>"
        b"<body><div id='root'>Loading...</div></body></html>")
NOT_FOUND = b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body>Not Found</body></html>"


class WebPageServer:
    """``with WebPageServer(200) as srv:`` ... ``srv.endpoint_url``, ``srv.requests``."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                owner.requests.append((self.command, self.path))
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                page = PAGE if owner.status < 300 else NOT_FOUND
                self.send_response(owner.status)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(page)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def writes(self) -> list[tuple[str, str]]:
        """The requests that would have written or deleted something."""
        return [r for r in self.requests if r[0] in ("PUT", "POST", "DELETE")]

    def __enter__(self) -> "WebPageServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
