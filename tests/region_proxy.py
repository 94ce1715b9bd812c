"""A proxy in front of moto that answers like S3 does for a bucket in another region.

The bucket "lives" in ``bucket_region``.  A request signed for any other region
(the region in its ``Authorization`` credential scope) is refused the way AWS
S3 refuses it, and never reaches moto:

* HeadObject: a bare ``400`` (no body, no region header), as S3 answers a HEAD
  it cannot put an error body in; only a HeadBucket tells the region;
* HeadBucket: a bare ``301`` with ``x-amz-bucket-region``;
* anything else, ``mode="301"``: ``301 PermanentRedirect`` (XML naming the
  endpoint) with ``x-amz-bucket-region``; ``mode="400"``: ``400
  AuthorizationHeaderMalformed`` whose XML names the expected ``<Region>``.

It also serves as an HTTP proxy (``HTTP_PROXY``) in front of moto: requests in
absolute form are handled alike.  A request with a body sent with ``Expect: 100-continue`` is refused before its
body is read (the connection is then closed); one sent without reads the body
first.  Requests signed for ``bucket_region`` are forwarded to moto, and
HeadBucket answers carry ``x-amz-bucket-region: bucket_region``.  ``refused``
counts the refusals by method, so a test can prove the redirects happened.
"""
from __future__ import annotations

import collections
import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_CREDENTIAL = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "host", "proxy-connection", "te", "upgrade"}


class RegionProxy:
    """``with RegionProxy(moto_url, mode="301") as p:`` ... ``p.endpoint_url``, ``p.refused``."""

    def __init__(self, upstream: str, *, bucket_region: str = "eu-west-1", mode: str = "301") -> None:
        assert mode in ("301", "400")
        up = urlsplit(upstream)
        self.upstream = (str(up.hostname), int(up.port or 80))
        self.bucket_region = bucket_region
        self.mode = mode
        self.refused: "collections.Counter[str]" = collections.Counter()
        self.log: list[tuple[str, str, "str | None"]] = []  # the refused requests: method, path, region signed
        #: refuse every HeadObject with a bare 400, whatever it was signed for (a 400 not about the region)
        self.always_refuse_head_object = False
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def handle_expect_100(self) -> bool:
                return True  # answered (or not) below, once the region is checked

            def _handle(self) -> None:
                owner._serve(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- one request --------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        m = _CREDENTIAL.search(h.headers.get("Authorization", ""))
        signed = m.group(1) if m else None
        path = urlsplit(h.path).path
        bucket = path.strip("/").split("/")[0]
        is_bucket = "/" not in path.strip("/")
        expects = h.headers.get("Expect", "").lower() == "100-continue"
        length = int(h.headers.get("Content-Length") or 0)
        odd_head = self.always_refuse_head_object and h.command == "HEAD" and not is_bucket
        if signed != self.bucket_region or odd_head:
            with self._lock:
                self.refused[h.command] += 1
                self.log.append((h.command, h.path, signed))
            if length and not expects:
                h.rfile.read(length)
            self._refuse(h, bucket, is_bucket, close=bool(length and expects))
            return
        if expects:
            h.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            h.wfile.flush()
        body = h.rfile.read(length) if length else None
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            u = urlsplit(h.path)  # origin-form, also when asked as an HTTP proxy (absolute-form)
            conn.request(h.command, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
        finally:
            conn.close()
        h.send_response_only(r.status, r.reason)
        for k, v in r.getheaders():
            if k.lower() not in _HOP and k.lower() not in ("content-length", "x-amz-bucket-region"):
                h.send_header(k, v)
        if is_bucket and h.command == "HEAD":
            h.send_header("x-amz-bucket-region", self.bucket_region)
        h.send_header("Content-Length", str(len(data) if h.command != "HEAD" else r.getheader("Content-Length", "0")))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _refuse(self, h: BaseHTTPRequestHandler, bucket: str, is_bucket: bool, close: bool) -> None:
        region_header = True
        if h.command == "HEAD":
            status, body = (301, b"") if is_bucket else (400, b"")
            region_header = is_bucket
        elif self.mode == "301":
            status = 301
            body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>PermanentRedirect</Code>"
                    "<Message>The bucket you are attempting to access must be addressed using the specified "
                    f"endpoint. Please send all future requests to this endpoint.</Message><Bucket>{bucket}</Bucket>"
                    f"<Endpoint>{bucket}.s3.{self.bucket_region}.amazonaws.com</Endpoint>"
                    "<RequestId>PROXY</RequestId></Error>").encode()
        else:
            status, region_header = 400, False
            body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AuthorizationHeaderMalformed</Code>"
                    "<Message>The authorization header is malformed; the region 'us-east-1' is wrong; expecting "
                    f"'{self.bucket_region}'</Message><Region>{self.bucket_region}</Region>"
                    "<RequestId>PROXY</RequestId></Error>").encode()
        h.send_response_only(status)
        h.send_header("x-amz-request-id", "PROXY")
        if region_header:
            h.send_header("x-amz-bucket-region", self.bucket_region)
        if body:
            h.send_header("Content-Type", "application/xml")
        h.send_header("Content-Length", str(len(body)))
        if close:
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    # -- lifetime -------------------------------------------------------------------
    def __enter__(self) -> "RegionProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
