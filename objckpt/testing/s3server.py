"""A small, fast, in-memory S3-compatible HTTP server -- a BENCHMARK AND TEST TARGET ONLY.

Not a production store: nothing is persisted, nothing is authenticated, ETags
are NOT MD5 digests (a cheap counter, so the server never hashes payloads),
Content-MD5 / x-amz-checksum-* headers are ignored, aws-chunked bodies are
refused, and there is no versioning, ACL, encryption or lifecycle.

Why it exists: moto ingests multipart parts at ~50 MB/s (it hashes parts and
reassembles serially) and reads whole objects per ranged GET, so behind moto
every client looks equally slow.  This server keeps objects as immutable
``bytes`` and answers ranged GETs from a ``memoryview`` slice, so the numbers a
benchmark sees are the client's.  Run it in a separate process
(``python -m objckpt.testing.s3server --port 0``; the first stdout line is the
endpoint URL) so that its CPU time is not charged to the client.

Path-style addressing only (``http://127.0.0.1:PORT/bucket/key``).  Control
endpoints (never counted in the stats):

* ``GET  /_objckpt/stats``        -> ``{"requests": {...}, "ops": {...}, "bytes_in": n, "bytes_out": n}``
* ``POST /_objckpt/reset_stats``  -> zero the counters
* ``POST /_objckpt/reset``        -> drop all buckets, objects, uploads; zero the counters
* ``POST /_objckpt/fail?op=UploadPart&count=N&status=500`` -> the next N such
  operations (``op=*``: any operation) fail with an S3 XML error
  (500 InternalError, 503 SlowDown, else ``code=`` or InjectedFault).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import email.utils
import itertools
import json
import signal
import socket
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union
from urllib.parse import quote, unquote
from xml.sax.saxutils import escape

from aiohttp import web

Buffer = Union[bytes, bytearray]
_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_CHUNK = 1 << 20  # bytes per transport write: bounds the server's send buffer
_DEFAULT_MIN_PART = 5 << 20  # S3's minimum size for every part but the last
_BUCKET_SUBRESOURCES_UNSUPPORTED = frozenset(
    "acl policy versioning versions tagging lifecycle cors website logging notification "
    "replication encryption object-lock accelerate analytics inventory metrics "
    "requestPayment ownershipControls publicAccessBlock intelligent-tiering".split()
)


class S3Error(Exception):
    """An S3 error answer: HTTP status plus the XML ``<Code>`` botocore maps to an exception."""

    def __init__(self, status: int, code: str, message: str = "", resource: str = "") -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.resource = status, code, message or code, resource


@dataclass
class _Obj:
    data: Buffer
    etag: str
    mtime: float
    content_type: str = "binary/octet-stream"
    meta: Dict[str, str] = field(default_factory=dict)


@dataclass
class _Upload:
    key: str
    upload_id: str
    initiated: float
    content_type: str
    meta: Dict[str, str]
    parts: Dict[int, _Obj] = field(default_factory=dict)


@dataclass
class _Bucket:
    created: float
    objects: Dict[str, _Obj] = field(default_factory=dict)
    uploads: Dict[str, _Upload] = field(default_factory=dict)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".%03dZ" % int((ts % 1) * 1000)


def _xml(root: str, body: str) -> web.Response:
    text = f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} xmlns="{_NS}">{body}</{root}>'
    return web.Response(body=text.encode(), content_type="application/xml")


def _el(tag: str, value: Any) -> str:
    return f"<{tag}>{escape(str(value))}</{tag}>"


def _parse_xml(body: Buffer) -> ET.Element:
    """Parse a request body, dropping namespaces so ``find('Part')`` works with or without xmlns."""
    try:
        root = ET.fromstring(bytes(body))
    except ET.ParseError as e:
        raise S3Error(400, "MalformedXML", str(e)) from None
    for el in root.iter():
        el.tag = el.tag.rsplit("}", 1)[-1]
    return root


def _meta_of(request: web.Request) -> Dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-amz-meta-")}


def _parse_range(header: str, size: int) -> Optional[Tuple[int, int]]:
    """(start, end_exclusive) for one ``bytes=`` range; None = serve everything
    (no, malformed or multi-range header, as S3 does); S3Error 416 if unsatisfiable."""
    if not header.startswith("bytes=") or "," in header:
        return None
    first, sep, last = header[6:].strip().partition("-")
    try:
        if not sep:
            return None
        if first == "":  # suffix: the last N bytes
            n = int(last)
            if n <= 0 or size == 0:
                raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
            return max(0, size - n), size
        start = int(first)
        end = int(last) + 1 if last else size
    except ValueError:
        return None
    if end <= start:
        return None
    if start >= size:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
    return start, min(end, size)


class _S3App:
    """State and request handling; everything runs on one event loop, so no locks."""

    def __init__(self, min_part_size: int = _DEFAULT_MIN_PART, latency_s: float = 0.0) -> None:
        self.min_part_size = min_part_size
        self.latency_s = latency_s
        self.buckets: Dict[str, _Bucket] = {}
        self.faults: List[List[Any]] = []  # [op, remaining, status, code]
        self._etags = itertools.count(1)
        self.reset_stats()

    # ---- control -------------------------------------------------------------
    def reset_stats(self) -> None:
        self.requests = {m: 0 for m in ("GET", "PUT", "POST", "HEAD", "DELETE")}
        self.ops: Dict[str, int] = {}
        self.bytes_in = 0
        self.bytes_out = 0

    def reset(self) -> None:
        self.buckets.clear()
        self.faults.clear()
        self.reset_stats()

    def stats(self) -> Dict[str, Any]:
        return {"requests": dict(self.requests), "ops": dict(self.ops),
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def add_fault(self, op: str, count: int = 1, status: int = 500, code: str = "") -> None:
        code = code or {500: "InternalError", 503: "SlowDown"}.get(status, "InjectedFault")
        self.faults.append([op, count, status, code])

    def _check_fault(self, op: str) -> None:
        for f in self.faults:
            if f[0] in (op, "*") and f[1] > 0:
                f[1] -= 1
                if f[1] == 0:
                    self.faults.remove(f)
                raise S3Error(f[2], f[3], f"injected fault for {op}")

    async def _control(self, request: web.Request, name: str) -> web.Response:
        if name == "stats":
            return web.json_response(self.stats())
        if request.method != "POST":
            raise S3Error(405, "MethodNotAllowed")
        if name == "reset_stats":
            self.reset_stats()
        elif name == "reset":
            self.reset()
        elif name == "fail":
            q = request.query
            self.add_fault(q.get("op", "*"), int(q.get("count", "1")), int(q.get("status", "500")), q.get("code", ""))
        else:
            raise S3Error(404, "NoSuchControl", name)
        return web.json_response({"ok": True})

    # ---- plumbing --------------------------------------------------------------
    def _etag(self) -> str:
        return f'"{next(self._etags):032x}"'  # unique per write; deliberately not an MD5

    def _bucket(self, name: str) -> _Bucket:
        b = self.buckets.get(name)
        if b is None:
            raise S3Error(404, "NoSuchBucket", "The specified bucket does not exist", name)
        return b

    def _upload(self, b: _Bucket, key: str, upload_id: str) -> _Upload:
        up = b.uploads.get(upload_id)
        if up is None or up.key != key:
            raise S3Error(404, "NoSuchUpload", "The specified upload does not exist", upload_id)
        return up

    @staticmethod
    def _check_conditions(request: web.Request, existing: Optional[_Obj], key: str) -> None:
        """Conditional writes: the commit protocol relies on ``If-None-Match: *``."""
        inm = request.headers.get("If-None-Match")
        if inm is not None and inm.strip() == "*" and existing is not None:
            raise S3Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold", key)
        im = request.headers.get("If-Match")
        if im is not None:
            if existing is None:
                raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key)
            if im.strip() not in ("*", existing.etag):
                raise S3Error(412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold", key)

    async def _read_body(self, request: web.Request) -> Buffer:
        """The whole body as one buffer: chunks joined once (no zero-filled prealloc, no extra copy)."""
        if ("aws-chunked" in request.headers.get("Content-Encoding", "")
                or "x-amz-decoded-content-length" in request.headers):
            raise S3Error(501, "NotImplemented", "aws-chunked bodies are not supported by this test server")
        if not request.body_exists:
            return b""
        chunks: List[bytes] = []
        n = 0
        while True:
            c = await request.content.readany()
            if not c:
                break
            chunks.append(c)
            n += len(c)
        if request.content_length is not None and n != request.content_length:
            raise S3Error(400, "IncompleteBody", "body shorter than Content-Length")
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _error(self, request: web.Request, e: S3Error) -> web.Response:
        headers = {"x-amz-request-id": uuid.uuid4().hex[:16]}
        if request.method == "HEAD":  # S3 sends no body to HEAD; botocore maps the bare status
            return web.Response(status=e.status, headers=headers)
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error>{_el("Code", e.code)}{_el("Message", e.message)}'
                f'{_el("Resource", e.resource)}{_el("RequestId", headers["x-amz-request-id"])}</Error>')
        return web.Response(status=e.status, body=body.encode(), content_type="application/xml", headers=headers)

    # ---- entry point ---------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = request.raw_path.split("?", 1)[0]
        if raw.startswith("/_objckpt/"):
            try:
                return await self._control(request, raw[len("/_objckpt/"):])
            except S3Error as e:
                return self._error(request, e)
        method = request.method
        self.requests[method] = self.requests.get(method, 0) + 1
        bucket, _, key = raw[1:].partition("/")
        bucket, key = unquote(bucket), unquote(key)
        q = request.query
        try:
            body = await self._read_body(request) if method in ("PUT", "POST") else b""
            op = self._op(method, bucket, key, q, request)
            if op in ("PutObject", "UploadPart"):
                self.bytes_in += len(body)  # object data only, not XML request bodies
            self.ops[op] = self.ops.get(op, 0) + 1
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            self._check_fault(op)
            return await getattr(self, "op_" + op)(request, bucket, key, body)
        except S3Error as e:
            return self._error(request, e)

    @staticmethod
    def _op(method: str, bucket: str, key: str, q: Any, request: web.Request) -> str:
        """Name the S3 operation the way botocore does (also the fault-injection key)."""
        if not bucket:
            if method == "GET":
                return "ListBuckets"
        elif not key:
            if method == "GET":
                if "uploads" in q:
                    return "ListMultipartUploads"
                if "location" in q:
                    return "GetBucketLocation"
                if any(s in q for s in _BUCKET_SUBRESOURCES_UNSUPPORTED):
                    raise S3Error(501, "NotImplemented", "bucket subresource not supported by this test server")
                return "ListObjectsV2" if q.get("list-type") == "2" else "ListObjects"
            ops = {"PUT": "CreateBucket", "HEAD": "HeadBucket", "DELETE": "DeleteBucket"}
            if method == "POST" and "delete" in q:
                return "DeleteObjects"
            if method in ops and not (method == "PUT" and q):
                return ops[method]
        elif method == "PUT":
            if "partNumber" in q and "uploadId" in q:
                if "x-amz-copy-source" in request.headers:
                    raise S3Error(501, "NotImplemented", "UploadPartCopy is not supported by this test server")
                return "UploadPart"
            return "CopyObject" if "x-amz-copy-source" in request.headers else "PutObject"
        elif method == "GET":
            return "ListParts" if "uploadId" in q else "GetObject"
        elif method == "HEAD":
            return "HeadObject"
        elif method == "DELETE":
            return "AbortMultipartUpload" if "uploadId" in q else "DeleteObject"
        elif method == "POST":
            if "uploads" in q:
                return "CreateMultipartUpload"
            if "uploadId" in q:
                return "CompleteMultipartUpload"
        raise S3Error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")

    # ---- buckets -------------------------------------------------------------
    async def op_ListBuckets(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        items = "".join(f"<Bucket>{_el('Name', n)}{_el('CreationDate', _iso(b.created))}</Bucket>"
                        for n, b in sorted(self.buckets.items()))
        owner = "<Owner><ID>objckpt</ID><DisplayName>objckpt</DisplayName></Owner>"
        return _xml("ListAllMyBucketsResult", f"{owner}<Buckets>{items}</Buckets>")

    async def op_CreateBucket(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        if bucket in self.buckets:
            raise S3Error(409, "BucketAlreadyOwnedByYou", "Your previous request to create the named bucket succeeded", bucket)
        self.buckets[bucket] = _Bucket(created=time.time())
        return web.Response(headers={"Location": "/" + bucket})

    async def op_HeadBucket(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        self._bucket(bucket)
        return web.Response(headers={"x-amz-bucket-region": "us-east-1"})

    async def op_DeleteBucket(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        if self._bucket(bucket).objects:
            raise S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty", bucket)
        del self.buckets[bucket]
        return web.Response(status=204)

    async def op_GetBucketLocation(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        self._bucket(bucket)
        return _xml("LocationConstraint", "")

    async def op_ListObjects(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        return self._list(request, bucket, v2=False)

    async def op_ListObjectsV2(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        return self._list(request, bucket, v2=True)

    def _list(self, request: web.Request, bucket: str, v2: bool) -> web.Response:
        """V1 and V2 listing; common prefixes count toward max-keys, as on S3."""
        b, q = self._bucket(bucket), request.query
        prefix, delim = q.get("prefix", ""), q.get("delimiter", "")
        max_keys = min(int(q.get("max-keys", "1000")), 1000)
        url = q.get("encoding-type") == "url"
        enc = (lambda s: quote(s, safe="/")) if url else (lambda s: s)
        if v2:
            token = q.get("continuation-token")
            marker = base64.urlsafe_b64decode(token.encode()).decode() if token else q.get("start-after", "")
        else:
            marker = q.get("marker", "")

        def rollup(k: str) -> Optional[str]:
            i = k.find(delim, len(prefix)) if delim else -1
            return k[: i + len(delim)] if i >= 0 else None

        skip = rollup(marker) if marker.startswith(prefix) else None  # resuming after a common prefix
        contents: List[str] = []
        prefixes: List[str] = []
        last, truncated = "", False
        for k in sorted(k for k in b.objects if k.startswith(prefix) and k > marker):
            if skip is not None and k.startswith(skip):
                continue
            cp = rollup(k)
            if cp is not None and prefixes and prefixes[-1] == cp:
                continue
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            if cp is not None:
                prefixes.append(cp)
                last = cp
            else:
                o = b.objects[k]
                contents.append(f"<Contents>{_el('Key', enc(k))}{_el('LastModified', _iso(o.mtime))}{_el('ETag', o.etag)}"
                                f"{_el('Size', len(o.data))}<StorageClass>STANDARD</StorageClass></Contents>")
                last = k
        parts = [_el("Name", bucket), _el("Prefix", enc(prefix)), _el("MaxKeys", max_keys),
                 _el("IsTruncated", "true" if truncated else "false")]
        if delim:
            parts.append(_el("Delimiter", enc(delim)))
        if url:
            parts.append(_el("EncodingType", "url"))
        if v2:
            parts.append(_el("KeyCount", len(contents) + len(prefixes)))
            if q.get("continuation-token"):
                parts.append(_el("ContinuationToken", q["continuation-token"]))
            if q.get("start-after"):
                parts.append(_el("StartAfter", enc(q["start-after"])))
            if truncated:
                parts.append(_el("NextContinuationToken", base64.urlsafe_b64encode(last.encode()).decode()))
        else:
            parts.append(_el("Marker", enc(marker)))
            if truncated:
                parts.append(_el("NextMarker", enc(last)))
        cps = "".join(f"<CommonPrefixes>{_el('Prefix', enc(p))}</CommonPrefixes>" for p in prefixes)
        return _xml("ListBucketResult", "".join(parts) + "".join(contents) + cps)

    async def op_DeleteObjects(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        b, root = self._bucket(bucket), _parse_xml(body)
        quiet = (root.findtext("Quiet") or "").strip().lower() == "true"
        out = []
        for obj in root.findall("Object"):
            k = obj.findtext("Key") or ""
            b.objects.pop(k, None)  # deleting a missing key succeeds, as on S3
            if not quiet:
                out.append(f"<Deleted>{_el('Key', k)}</Deleted>")
        return _xml("DeleteResult", "".join(out))

    async def op_ListMultipartUploads(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        b, q = self._bucket(bucket), request.query
        prefix = q.get("prefix", "")
        ups = sorted((u for u in b.uploads.values() if u.key.startswith(prefix)), key=lambda u: (u.key, u.initiated))
        items = "".join(f"<Upload>{_el('Key', u.key)}{_el('UploadId', u.upload_id)}{_el('Initiated', _iso(u.initiated))}"
                        f"<StorageClass>STANDARD</StorageClass></Upload>" for u in ups)
        head = (_el("Bucket", bucket) + _el("KeyMarker", "") + _el("UploadIdMarker", "") + _el("Prefix", prefix)
                + _el("MaxUploads", 10000) + _el("IsTruncated", "false"))
        return _xml("ListMultipartUploadsResult", head + items)

    # ---- objects -------------------------------------------------------------
    async def op_PutObject(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        b = self._bucket(bucket)
        self._check_conditions(request, b.objects.get(key), key)
        o = _Obj(body, self._etag(), time.time(), request.headers.get("Content-Type", "binary/octet-stream"), _meta_of(request))
        b.objects[key] = o
        return web.Response(headers={"ETag": o.etag})

    async def op_CopyObject(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        src_b, _, src_k = unquote(request.headers["x-amz-copy-source"].split("?", 1)[0]).lstrip("/").partition("/")
        src = self._bucket(src_b).objects.get(src_k)
        if src is None:
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", src_k)
        b = self._bucket(bucket)
        self._check_conditions(request, b.objects.get(key), key)
        o = _Obj(src.data, self._etag(), time.time(), src.content_type, dict(src.meta))  # immutable: share bytes
        b.objects[key] = o
        return _xml("CopyObjectResult", _el("ETag", o.etag) + _el("LastModified", _iso(o.mtime)))

    def _get(self, bucket: str, key: str) -> _Obj:
        o = self._bucket(bucket).objects.get(key)
        if o is None:
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", key)
        return o

    @staticmethod
    def _obj_headers(o: _Obj) -> Dict[str, str]:
        h = {"ETag": o.etag, "Last-Modified": email.utils.formatdate(o.mtime, usegmt=True),
             "Accept-Ranges": "bytes", "Content-Type": o.content_type}
        h.update(o.meta)
        return h

    async def op_HeadObject(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        o = self._get(bucket, key)
        resp = web.StreamResponse(headers=self._obj_headers(o))
        resp.content_length = len(o.data)  # HEAD: aiohttp sends the header, never a body
        await resp.prepare(request)
        await resp.write_eof()
        return resp

    async def op_GetObject(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.StreamResponse:
        o = self._get(bucket, key)
        size = len(o.data)
        headers = self._obj_headers(o)
        try:
            rng = _parse_range(request.headers.get("Range", ""), size)
        except S3Error as e:
            resp = self._error(request, e)
            resp.headers["Content-Range"] = f"bytes */{size}"
            return resp
        start, end = rng if rng is not None else (0, size)
        if rng is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        resp = web.StreamResponse(status=206 if rng is not None else 200, headers=headers)
        resp.content_length = end - start
        await resp.prepare(request)
        view = memoryview(o.data)[start:end]  # no copy of the object; chunks bound the send buffer
        for i in range(0, len(view), _CHUNK):
            await resp.write(view[i: i + _CHUNK])
            self.bytes_out += min(_CHUNK, len(view) - i)
        await resp.write_eof()
        return resp

    async def op_DeleteObject(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        self._bucket(bucket).objects.pop(key, None)
        return web.Response(status=204)

    # ---- multipart -----------------------------------------------------------
    async def op_CreateMultipartUpload(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        b = self._bucket(bucket)
        up = _Upload(key, uuid.uuid4().hex, time.time(), request.headers.get("Content-Type", "binary/octet-stream"),
                     _meta_of(request))
        b.uploads[up.upload_id] = up
        return _xml("InitiateMultipartUploadResult", _el("Bucket", bucket) + _el("Key", key) + _el("UploadId", up.upload_id))

    async def op_UploadPart(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        up = self._upload(self._bucket(bucket), key, request.query["uploadId"])
        try:
            n = int(request.query["partNumber"])
        except ValueError:
            n = 0
        if not 1 <= n <= 10000:
            raise S3Error(400, "InvalidArgument", "Part number must be an integer between 1 and 10000, inclusive")
        part = _Obj(body, self._etag(), time.time())
        up.parts[n] = part
        return web.Response(headers={"ETag": part.etag})

    async def op_ListParts(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        up = self._upload(self._bucket(bucket), key, request.query["uploadId"])
        items = "".join(f"<Part>{_el('PartNumber', n)}{_el('LastModified', _iso(p.mtime))}{_el('ETag', p.etag)}"
                        f"{_el('Size', len(p.data))}</Part>" for n, p in sorted(up.parts.items()))
        head = (_el("Bucket", bucket) + _el("Key", key) + _el("UploadId", up.upload_id)
                + _el("MaxParts", 10000) + _el("IsTruncated", "false"))
        return _xml("ListPartsResult", head + items)

    async def op_AbortMultipartUpload(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        b = self._bucket(bucket)
        self._upload(b, key, request.query["uploadId"])
        del b.uploads[request.query["uploadId"]]
        return web.Response(status=204)

    async def op_CompleteMultipartUpload(self, request: web.Request, bucket: str, key: str, body: Buffer) -> web.Response:
        b = self._bucket(bucket)
        up = self._upload(b, key, request.query["uploadId"])
        listed: List[Tuple[int, str]] = []
        for p in _parse_xml(body).findall("Part"):
            try:
                listed.append((int(p.findtext("PartNumber") or ""), (p.findtext("ETag") or "").strip().strip('"')))
            except ValueError:
                raise S3Error(400, "MalformedXML", "bad PartNumber") from None
        if not listed:
            raise S3Error(400, "MalformedXML", "CompleteMultipartUpload lists no parts")
        if any(a[0] >= c[0] for a, c in zip(listed, listed[1:])):
            raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order.")
        chosen: List[_Obj] = []
        for i, (n, etag) in enumerate(listed):
            part = up.parts.get(n)
            if part is None or (etag and etag != part.etag.strip('"')):
                raise S3Error(400, "InvalidPart", f"part {n} was not uploaded or its ETag does not match")
            if i < len(listed) - 1 and len(part.data) < self.min_part_size:
                raise S3Error(400, "EntityTooSmall", "Your proposed upload is smaller than the minimum allowed size")
            chosen.append(part)
        self._check_conditions(request, b.objects.get(key), key)  # the upload survives a 412
        data = b"".join(p.data for p in chosen)  # the one copy: parts -> object
        o = _Obj(data, f'"{next(self._etags):032x}-{len(chosen)}"', time.time(), up.content_type, up.meta)
        b.objects[key] = o
        del b.uploads[up.upload_id]
        return _xml("CompleteMultipartUploadResult", _el("Location", f"{request.url.origin()}/{bucket}/{quote(key)}")
                    + _el("Bucket", bucket) + _el("Key", key) + _el("ETag", o.etag))


def make_app(state: Optional[_S3App] = None) -> web.Application:
    """An aiohttp application with one catch-all route (keys may hold any character)."""
    state = state or _S3App()
    app = web.Application(client_max_size=1 << 40)
    app.router.add_route("*", "/{tail:.*}", state.handle)
    app["s3"] = state
    return app


async def _serve(state: _S3App, sock: socket.socket) -> web.AppRunner:
    runner = web.AppRunner(make_app(state), access_log=None, read_bufsize=1 << 20, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=1024).start()
    return runner


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class S3Server:
    """The server on a background thread with its own event loop (for tests).

    For benchmarks prefer ``python -m objckpt.testing.s3server`` in another
    process, so the server's CPU time is not counted as the client's.
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
        ready = threading.Event()
        failure: List[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._runner = loop.run_until_complete(_serve(self.state, sock))
            except BaseException as e:  # surface bind/setup errors in start()
                failure.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="objckpt-s3server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
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

    def fail(self, op: str, count: int = 1, status: int = 500, code: str = "") -> None:
        self._call(self.state.add_fault, op, count, status, code)

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop = self._thread = self._runner = None

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: Optional[List[str]] = None) -> None:
    """Foreground server; prints the endpoint URL as the first stdout line."""
    p = argparse.ArgumentParser(description="In-memory S3-compatible server for objckpt benchmarks/tests (not a store).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--min-part-size", type=int, default=_DEFAULT_MIN_PART)
    p.add_argument("--latency-ms", type=float, default=0.0, help="added delay per S3 request (emulate a remote store)")
    args = p.parse_args(argv)
    sock = _bind(args.host, args.port)
    state = _S3App(args.min_part_size, args.latency_ms / 1000.0)

    async def run() -> None:
        runner = await _serve(state, sock)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # clean exit on terminate() (SIGINT may be ignored in bg jobs)
            try:
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # e.g. Windows
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
    sys.exit(main())
