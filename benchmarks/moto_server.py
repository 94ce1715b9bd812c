"""A moto S3 server on a free port; prints its endpoint URL as the first stdout line.

    python -m benchmarks.moto_server [--ranged-reads]

Like objckpt's test server it counts requests and bytes:
``GET /_objckpt/stats`` -> ``{"requests": {op: n}, "bytes_in": n, "bytes_out": n}``
and ``POST /_objckpt/reset_stats``.

Stock moto answers a ranged GET by copying the whole object and slicing it,
so loads that issue many ranged GETs against one large object (DCP over s3fs,
TensorStore/OCDBT, objckpt) measure moto rather than the client.
``--ranged-reads`` patches moto (in this process only) to read just the
requested bytes of the object, as baselines.md did; everything else is stock.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading
from typing import Any, Optional

_tls = threading.local()
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def patch_ranged_reads() -> None:
    """Make moto serve ``Range: bytes=a-b`` GETs by reading only those bytes."""
    from moto.s3 import models, responses

    value_prop = models.FakeKey.value

    def value_get(self: Any) -> bytes:
        rng: Optional[tuple[Optional[int], Optional[int]]] = getattr(_tls, "range", None)
        if rng is None:
            return value_prop.fget(self)  # type: ignore[misc]
        size = self.contentsize
        begin, end = rng
        if begin is None:  # suffix range: last `end` bytes
            begin, end = max(size - (end or 0), 0), size - 1
        else:
            end = size - 1 if end is None else min(end, size - 1)
        if size == 0 or begin > end:  # let stock moto handle odd cases
            _tls.range = None
            return value_prop.fget(self)  # type: ignore[misc]
        with self.lock:
            self._value_buffer.seek(begin)
            data = self._value_buffer.read(end - begin + 1)
        _tls.served = (begin, end, size)
        return data

    models.FakeKey.value = property(value_get, value_prop.fset)  # type: ignore[assignment]

    orig_get_object = responses.S3Response.get_object
    orig_handle_range = responses.S3Response._handle_range_header

    def get_object(self: Any) -> Any:
        _tls.range, _tls.served = None, None
        m = _RANGE.match((self.headers.get("range") or self.headers.get("Range") or "").strip())
        if m and (m.group(1) or m.group(2)) and not self._get_int_param("partNumber"):
            _tls.range = (int(m.group(1)) if m.group(1) else None, int(m.group(2)) if m.group(2) else None)
        try:
            return orig_get_object(self)
        finally:
            _tls.range = None

    def handle_range(self: Any, request: Any, response_headers: dict[str, Any], response_content: Any) -> Any:
        served = getattr(_tls, "served", None)
        _tls.served = None
        if request.method != "GET" or served is None:
            return orig_handle_range(self, request, response_headers, response_content)
        begin, end, size = served
        for h in [h for h in response_headers if h.startswith("x-amz-checksum-")]:
            del response_headers[h]
        response_headers["content-range"] = f"bytes {begin}-{end}/{size}"
        response_headers["content-length"] = str(len(response_content))
        return 206, response_headers, response_content

    responses.S3Response.get_object = get_object  # type: ignore[method-assign]
    responses.S3Response._handle_range_header = handle_range  # type: ignore[method-assign]


class StatsMiddleware:
    """WSGI middleware counting requests (by S3 operation) and body bytes in and out."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.requests: dict[str, int] = {}
            self.bytes_in = 0
            self.bytes_out = 0

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"requests": dict(self.requests), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    @staticmethod
    def op_name(environ: dict[str, Any]) -> str:
        m = environ.get("REQUEST_METHOD", "?")
        q = environ.get("QUERY_STRING", "")
        path = environ.get("PATH_INFO", "/").strip("/")
        has_key = "/" in path
        if m == "GET":
            if not has_key:
                return "ListObjects" if path else "ListBuckets"
            return "GetObjectRange" if environ.get("HTTP_RANGE") else "GetObject"
        if m == "PUT":
            if not has_key:
                return "CreateBucket"
            if "partNumber=" in q:
                return "UploadPart"
            return "CopyObject" if environ.get("HTTP_X_AMZ_COPY_SOURCE") else "PutObject"
        if m == "POST":
            if "uploads" in q.split("&"):
                return "CreateMultipartUpload"
            if "uploadId=" in q:
                return "CompleteMultipartUpload"
            return "DeleteObjects" if "delete" in q else "POST"
        if m == "HEAD":
            return "HeadObject" if has_key else "HeadBucket"
        if m == "DELETE":
            return "AbortMultipartUpload" if "uploadId=" in q else "DeleteObject"
        return m

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/_objckpt/stats":
            body = json.dumps(self.snapshot()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == "/_objckpt/reset_stats":
            self.reset()
            start_response("204 No Content", [])
            return [b""]
        op = self.op_name(environ)
        try:
            n_in = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            n_in = 0
        with self.lock:
            self.requests[op] = self.requests.get(op, 0) + 1
            self.bytes_in += n_in
        return self._count(self.app(environ, start_response))

    def _count(self, body: Any) -> Any:
        try:
            for chunk in body:
                with self.lock:
                    self.bytes_out += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="moto S3 server on a free port (prints endpoint URL first)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ranged-reads", action="store_true", help="serve ranged GETs without copying the whole object")
    args = ap.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if args.ranged_reads:
        patch_ranged_reads()
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = StatsMiddleware(DomainDispatcherApplication(create_backend_app))
    server = make_server(args.host, args.port, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"http://{args.host}:{server.server_port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
