"""The S3 REST protocol of the test server, over aiohttp: name each request's operation
as botocore does, run it against the in-memory state (``s3memstore``), answer in S3's
XML, and serve the ``/_objckpt/`` control endpoints described in ``s3server``.

Path-style addressing only; SigV4 headers are ignored; errors are the XML ``<Code>``
values botocore maps to exceptions, so clients see the same failures as on S3.
"""
from __future__ import annotations

import asyncio
import base64
import email.utils
import time
import uuid
import xml.etree.ElementTree as ET
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import quote, unquote
from xml.sax.saxutils import escape

import crc32c as _crc32c
from aiohttp import web

if __package__:
    from .s3memstore import _EMPTY, S3Error, _Bucket, _Data, _Obj, _State, _Upload
else:  # loaded by ``python testkit/s3server.py`` as a top-level sibling: importing the package would import torch
    from s3memstore import _EMPTY, S3Error, _Bucket, _Data, _Obj, _State, _Upload  # type: ignore[no-redef]

_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_UNSUPPORTED_BUCKET_SUBRESOURCES = frozenset(
    "acl policy versions tagging lifecycle cors website logging notification replication "
    "encryption object-lock accelerate analytics inventory metrics requestPayment ownershipControls "
    "publicAccessBlock intelligent-tiering".split())
_PRECONDITION = "At least one of the pre-conditions you specified did not hold"


class _Ctx:
    """One parsed request: what every operation handler needs."""

    def __init__(self, request: web.Request, bucket: str, key: str, body: _Data) -> None:
        self.request, self.bucket, self.key, self.body = request, bucket, key, body
        self.q, self.headers = request.query, request.headers


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".%03dZ" % int((ts % 1) * 1000)


def _el(tag: str, value: Any) -> str:
    return f"<{tag}>{escape(str(value))}</{tag}>"


def _xml(root: str, body: str) -> web.Response:
    text = f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} xmlns="{_NS}">{body}</{root}>'
    return web.Response(body=text.encode(), content_type="application/xml")


def _parse_xml(body: _Data) -> ET.Element:
    """Parse a request body, dropping namespaces so ``find('Part')`` works with or without xmlns."""
    try:
        root = ET.fromstring(body.tobytes())
    except ET.ParseError as e:
        raise S3Error(400, "MalformedXML", str(e)) from None
    for el in root.iter():
        el.tag = el.tag.rsplit("}", 1)[-1]
    return root


def _meta_of(r: _Ctx) -> Dict[str, str]:
    return {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-amz-meta-")}


def _parse_range(header: str, size: int) -> Optional[Tuple[int, int]]:
    """(start, end_exclusive) of one ``bytes=`` range; None = whole object (no, malformed or
    multi-range header: S3 ignores those); S3Error 416 when unsatisfiable."""
    first, sep, last = header[6:].strip().partition("-")
    if not header.startswith("bytes=") or "," in header or not sep:
        return None
    try:
        if first == "":  # suffix: the last N bytes
            n = int(last)
            if n <= 0 or size == 0:
                raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
            return max(0, size - n), size
        start, end = int(first), (int(last) + 1 if last else size)
    except ValueError:
        return None
    if end <= start:
        return None
    if start >= size:
        raise S3Error(416, "InvalidRange", "The requested range is not satisfiable")
    return start, min(end, size)


def _op_name(method: str, r: _Ctx) -> str:
    """Name the S3 operation as botocore does (also the fault-injection key)."""
    q, copy = r.q, "x-amz-copy-source" in r.headers
    if not r.bucket:
        if method == "GET":
            return "ListBuckets"
    elif not r.key:
        if method == "GET":
            if any(s in q for s in _UNSUPPORTED_BUCKET_SUBRESOURCES):
                raise S3Error(501, "NotImplemented", "bucket subresource not supported by this test server")
            return ("ListMultipartUploads" if "uploads" in q else "GetBucketLocation" if "location" in q
                    else "GetBucketVersioning" if "versioning" in q
                    else "ListObjectsV2" if q.get("list-type") == "2" else "ListObjects")
        if method == "POST" and "delete" in q:
            return "DeleteObjects"
        if method in ("HEAD", "DELETE") or (method == "PUT" and not q):
            return {"PUT": "CreateBucket", "HEAD": "HeadBucket", "DELETE": "DeleteBucket"}[method]
    elif method == "PUT":
        if "partNumber" in q and "uploadId" in q:
            if copy:
                raise S3Error(501, "NotImplemented", "UploadPartCopy is not supported by this test server")
            return "UploadPart"
        return "CopyObject" if copy else "PutObject"
    elif method in ("GET", "HEAD", "DELETE"):
        return {"GET": ("ListParts", "GetObject"), "HEAD": ("HeadObject", "HeadObject"),
                "DELETE": ("AbortMultipartUpload", "DeleteObject")}[method]["uploadId" not in q]
    elif method == "POST" and ("uploads" in q or "uploadId" in q):
        return "CreateMultipartUpload" if "uploads" in q else "CompleteMultipartUpload"
    raise S3Error(405, "MethodNotAllowed", "The specified method is not allowed against this resource.")


class _S3App(_State):
    """Request handling over the state of :class:`_State`: one catch-all route, then one
    ``op_<Name>`` method per S3 operation.  Everything runs on one event loop, so no locks."""

    async def _control(self, request: web.Request, name: str) -> web.Response:
        if name == "stats":
            return web.json_response(self.stats())
        q = request.query
        if request.method != "POST":
            raise S3Error(405, "MethodNotAllowed")
        if name == "reset_stats":
            self.reset_stats()
        elif name == "reset":
            self.reset()
        elif name == "fail":
            self.add_fault(q.get("op", "*"), int(q.get("count", "1")), int(q.get("status", "500")), q.get("code", ""))
        elif name == "corrupt":
            self.set_corrupt(int(q.get("count", "1")))
        elif name == "clock":
            self.set_clock(float(q.get("offset", "0")))
        elif name == "refuse_credentials":
            self.refuse_credentials(q.get("code", ""))
        elif name == "checksums":
            self.set_checksums_checked(q.get("checked", "true").lower() != "false")
        elif name == "lose_reply":
            self.add_lost_reply(q.get("op", "*"), int(q.get("count", "1")))
        elif name == "widen_ranges":
            self.set_widen_ranges(int(q.get("align", "0")))
        else:
            raise S3Error(404, "NoSuchControl", name)
        return web.json_response({"ok": True})

    # ---- plumbing ---------------------------------------------------------------------------
    def _bucket(self, r: _Ctx) -> _Bucket:
        b = self.buckets.get(r.bucket)
        if b is None:
            raise S3Error(404, "NoSuchBucket", "The specified bucket does not exist", r.bucket)
        return b

    def _upload(self, r: _Ctx) -> Tuple[_Bucket, _Upload]:
        b = self._bucket(r)
        up = b.uploads.get(r.q["uploadId"])
        if up is None or up.key != r.key:
            raise S3Error(404, "NoSuchUpload", "The specified upload does not exist", r.q["uploadId"])
        return b, up

    def _object(self, r: _Ctx) -> _Obj:
        o = self._bucket(r).objects.get(r.key)
        if o is None:
            raise S3Error(404, "NoSuchKey", "The specified key does not exist.", r.key)
        return o

    @staticmethod
    def _check_conditions(r: _Ctx, existing: Optional[_Obj]) -> None:
        """Conditional writes: objckpt's commit relies on ``If-None-Match: *``."""
        if r.headers.get("If-None-Match", "").strip() == "*" and existing is not None:
            raise S3Error(412, "PreconditionFailed", _PRECONDITION, r.key)
        im = r.headers.get("If-Match")
        if im is not None:
            if existing is None:
                raise S3Error(404, "NoSuchKey", "The specified key does not exist.", r.key)
            if im.strip() not in ("*", existing.etag):
                raise S3Error(412, "PreconditionFailed", _PRECONDITION, r.key)

    @staticmethod
    async def _read_body(request: web.Request) -> _Data:
        """The body as the chunks aiohttp's parser produced, kept as they are."""
        h = request.headers
        if "aws-chunked" in h.get("Content-Encoding", "") or "x-amz-decoded-content-length" in h:
            raise S3Error(501, "NotImplemented", "aws-chunked bodies are not supported by this test server")
        chunks: List[bytes] = []
        while request.body_exists:
            c = await request.content.readany()
            if not c:
                break
            chunks.append(c)
        data = _Data(chunks)
        if request.content_length is not None and data.size != request.content_length:
            raise S3Error(400, "IncompleteBody", "body shorter than Content-Length")
        return data

    @staticmethod
    def _error(request: web.Request, e: S3Error) -> web.Response:
        rid = uuid.uuid4().hex[:16]
        if request.method == "HEAD":  # S3 sends HEAD errors without a body; botocore maps the status
            return web.Response(status=e.status, headers={"x-amz-request-id": rid})
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error>{_el("Code", e.code)}{_el("Message", e.message)}'
                f'{_el("Resource", e.resource)}{_el("RequestId", rid)}</Error>')
        return web.Response(status=e.status, body=body.encode(), content_type="application/xml",
                            headers={"x-amz-request-id": rid})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The one route.  Decodes the raw path itself, so keys with ``..``, ``//`` or ``%`` survive."""
        path = request.raw_path.split("?", 1)[0]
        try:
            if path.startswith("/_objckpt/"):
                return await self._control(request, path[len("/_objckpt/"):])
            method = request.method
            self.requests[method] = self.requests.get(method, 0) + 1
            bucket, _, key = path[1:].partition("/")
            body = await self._read_body(request) if method in ("PUT", "POST") else _EMPTY
            r = _Ctx(request, unquote(bucket), unquote(key), body)
            op = _op_name(method, r)
            self.ops[op] = self.ops.get(op, 0) + 1
            if self.seen_headers is not None:
                self.seen_headers.append((op, {k.lower(): v for k, v in request.headers.items()}))
            if op in ("PutObject", "UploadPart"):
                self.bytes_in += body.size
            self.in_flight += 1
            try:
                if self.latency_s:
                    await asyncio.sleep(self.latency_s)
                self.check_credentials(request.headers.get("x-amz-date", ""))
                self.check_checksum_headers(op, request.headers)
                self._check_fault(op)
                resp = await getattr(self, "op_" + op)(r)
                if self.take_lost_reply(op):  # done, and the client never hears of it
                    if request.transport is not None:
                        request.transport.abort()
                return resp
            finally:
                self.in_flight -= 1
        except S3Error as e:
            resp = self._error(request, e)
            if self.clock_offset:  # S3's answers carry its clock: how a client tells a skew
                resp.headers["Date"] = email.utils.formatdate(self.now(), usegmt=True)
            return resp

    # ---- buckets ----------------------------------------------------------------------------
    async def op_ListBuckets(self, r: _Ctx) -> web.Response:
        items = "".join(f"<Bucket>{_el('Name', n)}{_el('CreationDate', _iso(b.created))}</Bucket>"
                        for n, b in sorted(self.buckets.items()))
        return _xml("ListAllMyBucketsResult", "<Owner><ID>objckpt</ID><DisplayName>objckpt</DisplayName></Owner>"
                    f"<Buckets>{items}</Buckets>")

    async def op_CreateBucket(self, r: _Ctx) -> web.Response:
        if r.bucket in self.buckets:  # what S3 says outside us-east-1 (us-east-1 itself answers 200)
            raise S3Error(409, "BucketAlreadyOwnedByYou", "Your previous request to create the named bucket succeeded")
        self.buckets[r.bucket] = _Bucket(created=time.time())
        return web.Response(headers={"Location": "/" + r.bucket})

    async def op_HeadBucket(self, r: _Ctx) -> web.Response:
        self._bucket(r)
        return web.Response(headers={"x-amz-bucket-region": "us-east-1"})

    async def op_DeleteBucket(self, r: _Ctx) -> web.Response:
        if self._bucket(r).objects:
            raise S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty", r.bucket)
        del self.buckets[r.bucket]
        return web.Response(status=204)

    async def op_GetBucketLocation(self, r: _Ctx) -> web.Response:
        self._bucket(r)
        return _xml("LocationConstraint", "")

    async def op_GetBucketVersioning(self, r: _Ctx) -> web.Response:
        self._bucket(r)
        return _xml("VersioningConfiguration", "")  # never versioned (s3fs asks before removing a bucket)

    async def op_ListObjects(self, r: _Ctx) -> web.Response:
        return self._list(r, v2=False)

    async def op_ListObjectsV2(self, r: _Ctx) -> web.Response:
        return self._list(r, v2=True)

    def _list(self, r: _Ctx, v2: bool) -> web.Response:
        """V1 (marker) and V2 (opaque continuation token, start-after) listing.  Common
        prefixes count toward max-keys and are never repeated across pages, as on S3."""
        b, q = self._bucket(r), r.q
        prefix, delim = q.get("prefix", ""), q.get("delimiter", "")
        max_keys = min(int(q.get("max-keys", "1000")), 1000)
        url = q.get("encoding-type") == "url"  # botocore always asks for it and unquotes the answer
        enc = (lambda s: quote(s, safe="/")) if url else (lambda s: s)
        token = q.get("continuation-token") if v2 else None
        marker = (base64.urlsafe_b64decode(token.encode()).decode() if token
                  else q.get("start-after" if v2 else "marker", ""))

        def rollup(k: str) -> Optional[str]:
            i = k.find(delim, len(prefix)) if delim else -1
            return k[: i + len(delim)] if i >= 0 else None

        skip = rollup(marker) if marker.startswith(prefix) else None  # resuming after a common prefix
        contents: List[str] = []
        prefixes: List[str] = []
        last, truncated = "", False
        for k in sorted(k for k in b.objects if k > marker and k.startswith(prefix)):
            cp = rollup(k)
            if (skip is not None and k.startswith(skip)) or (cp is not None and prefixes and prefixes[-1] == cp):
                continue
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            if cp is not None:
                prefixes.append(cp)
            else:
                o = b.objects[k]
                contents.append(f"<Contents>{_el('Key', enc(k))}{_el('LastModified', _iso(o.mtime))}"
                                f"{_el('ETag', o.etag)}{_el('Size', o.data.size)}"
                                "<StorageClass>STANDARD</StorageClass></Contents>")
            last = cp if cp is not None else k
        out = [_el("Name", r.bucket), _el("Prefix", enc(prefix)), _el("MaxKeys", max_keys),
               _el("IsTruncated", str(truncated).lower())]
        out += [_el("Delimiter", enc(delim))] if delim else []
        out += [_el("EncodingType", "url")] if url else []
        if v2:
            out.append(_el("KeyCount", len(contents) + len(prefixes)))
            out += [_el("ContinuationToken", token)] if token else []
            out += [_el("StartAfter", enc(q["start-after"]))] if q.get("start-after") else []
            out += [_el("NextContinuationToken", base64.urlsafe_b64encode(last.encode()).decode())] if truncated else []
        else:
            out.append(_el("Marker", enc(marker)))
            out += [_el("NextMarker", enc(last))] if truncated else []
        cps = "".join(f"<CommonPrefixes>{_el('Prefix', enc(p))}</CommonPrefixes>" for p in prefixes)
        return _xml("ListBucketResult", "".join(out) + "".join(contents) + cps)

    async def op_DeleteObjects(self, r: _Ctx) -> web.Response:
        b, root = self._bucket(r), _parse_xml(r.body)
        quiet = (root.findtext("Quiet") or "").strip().lower() == "true"
        done = []
        for obj in root.findall("Object"):
            k = obj.findtext("Key") or ""
            b.objects.pop(k, None)  # a missing key counts as deleted, as on S3
            done.append(f"<Deleted>{_el('Key', k)}</Deleted>")
        return _xml("DeleteResult", "" if quiet else "".join(done))

    async def op_ListMultipartUploads(self, r: _Ctx) -> web.Response:
        prefix = r.q.get("prefix", "")
        ups = sorted((u for u in self._bucket(r).uploads.values() if u.key.startswith(prefix)),
                     key=lambda u: (u.key, u.initiated))
        items = "".join(f"<Upload>{_el('Key', u.key)}{_el('UploadId', u.upload_id)}"
                        f"{_el('Initiated', _iso(u.initiated))}<StorageClass>STANDARD</StorageClass></Upload>"
                        for u in ups)
        head = (_el("Bucket", r.bucket) + "<KeyMarker></KeyMarker><UploadIdMarker></UploadIdMarker>"
                + _el("Prefix", prefix) + "<MaxUploads>10000</MaxUploads><IsTruncated>false</IsTruncated>")
        return _xml("ListMultipartUploadsResult", head + items)

    # ---- objects ----------------------------------------------------------------------------
    def _store(self, r: _Ctx, b: _Bucket, data: _Data, etag: str, content_type: str, meta: Dict[str, str]) -> _Obj:
        self._check_conditions(r, b.objects.get(r.key))
        o = b.objects[r.key] = _Obj(data, etag, time.time(), content_type, meta)
        return o

    def _checked_body(self, r: _Ctx) -> Tuple[_Data, str]:
        """The body (damaged first when a corruption is pending) and its verified
        ``x-amz-checksum-crc32c``: a body that does not match it is refused (BadDigest)."""
        body = self.take_corruption(r.body)
        if not self.checks_checksums:  # accepted as it came, whatever the header says; nothing kept
            return body, ""
        want = r.headers.get("x-amz-checksum-crc32c", "")
        if want:
            crc = 0
            for c in body.chunks:
                crc = _crc32c.crc32c(c, crc)
            got = base64.b64encode(crc.to_bytes(4, "big")).decode()
            if got != want:
                raise S3Error(400, "BadDigest", f"The CRC32C you specified did not match the calculated checksum "
                                                f"({want} sent, {got} computed).")
        return body, want

    @staticmethod
    def _crc_headers(crc: str) -> Dict[str, str]:
        return {"x-amz-checksum-crc32c": crc} if crc else {}

    async def op_PutObject(self, r: _Ctx) -> web.Response:
        body, crc = self._checked_body(r)
        o = self._store(r, self._bucket(r), body, self._etag(), r.headers.get("Content-Type", "binary/octet-stream"),
                        _meta_of(r))
        o.crc32c = crc
        return web.Response(headers={"ETag": o.etag, **self._crc_headers(crc)})

    async def op_CopyObject(self, r: _Ctx) -> web.Response:
        src_b, _, src_k = unquote(r.headers["x-amz-copy-source"].split("?", 1)[0]).lstrip("/").partition("/")
        src = self._object(_Ctx(r.request, src_b, src_k, _EMPTY))
        o = self._store(r, self._bucket(r), src.data, self._etag(), src.content_type, dict(src.meta))  # shares bytes
        return _xml("CopyObjectResult", _el("ETag", o.etag) + _el("LastModified", _iso(o.mtime)))

    async def op_HeadObject(self, r: _Ctx) -> web.StreamResponse:
        return await self.op_GetObject(r)  # aiohttp sends headers only for HEAD

    async def op_GetObject(self, r: _Ctx) -> web.StreamResponse:
        o = self._object(r)
        size = o.data.size
        headers = {"ETag": o.etag, "Last-Modified": email.utils.formatdate(o.mtime, usegmt=True),
                   "Accept-Ranges": "bytes", "Content-Type": o.content_type, **o.meta}
        try:
            rng = _parse_range(r.headers.get("Range", ""), size) if r.request.method == "GET" else None
        except S3Error as e:
            resp = self._error(r.request, e)
            resp.headers["Content-Range"] = f"bytes */{size}"
            return resp
        start, end = rng or (0, size)
        if rng is not None:
            start, end = self.widened(start, end, size)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        elif o.crc32c and r.headers.get("x-amz-checksum-mode", "").upper() == "ENABLED":
            # the checksum the object was stored with (a multipart one's composite ends "-<parts>")
            headers["x-amz-checksum-crc32c"] = o.crc32c
            headers["x-amz-checksum-type"] = "COMPOSITE" if "-" in o.crc32c else "FULL_OBJECT"
        resp = web.StreamResponse(status=206 if rng else 200, headers=headers)
        resp.content_length = end - start
        await resp.prepare(r.request)
        if r.request.method == "GET":
            for view in o.data.views(start, end):  # slices of the stored chunks: no copy
                await resp.write(view)
                self.bytes_out += len(view)
        await resp.write_eof()
        return resp

    async def op_DeleteObject(self, r: _Ctx) -> web.Response:
        self._bucket(r).objects.pop(r.key, None)
        return web.Response(status=204)

    # ---- multipart --------------------------------------------------------------------------
    async def op_CreateMultipartUpload(self, r: _Ctx) -> web.Response:
        up = _Upload(r.key, uuid.uuid4().hex, time.time(), r.headers.get("Content-Type", "binary/octet-stream"),
                     _meta_of(r))
        up.checksum_algorithm = r.headers.get("x-amz-checksum-algorithm", "").upper() if self.checks_checksums else ""
        self._bucket(r).uploads[up.upload_id] = up
        return _xml("InitiateMultipartUploadResult",
                    _el("Bucket", r.bucket) + _el("Key", r.key) + _el("UploadId", up.upload_id))

    async def op_UploadPart(self, r: _Ctx) -> web.Response:
        _, up = self._upload(r)
        n = int(r.q["partNumber"]) if r.q["partNumber"].isdigit() else 0
        if not 1 <= n <= 10000:
            raise S3Error(400, "InvalidArgument", "Part number must be an integer between 1 and 10000, inclusive")
        body, crc = self._checked_body(r)
        if up.checksum_algorithm == "CRC32C" and not crc:
            raise S3Error(400, "InvalidRequest", "the upload was created with CRC32C: every part must carry it")
        part = up.parts[n] = _Obj(body, self._etag(), time.time(), crc32c=crc)
        return web.Response(headers={"ETag": part.etag, **self._crc_headers(crc)})

    async def op_ListParts(self, r: _Ctx) -> web.Response:
        _, up = self._upload(r)
        items = "".join(f"<Part>{_el('PartNumber', n)}{_el('LastModified', _iso(p.mtime))}{_el('ETag', p.etag)}"
                        f"{_el('Size', p.data.size)}</Part>" for n, p in sorted(up.parts.items()))
        head = (_el("Bucket", r.bucket) + _el("Key", r.key) + _el("UploadId", up.upload_id)
                + "<MaxParts>10000</MaxParts><IsTruncated>false</IsTruncated>")
        return _xml("ListPartsResult", head + items)

    async def op_AbortMultipartUpload(self, r: _Ctx) -> web.Response:
        b, up = self._upload(r)
        del b.uploads[up.upload_id]
        return web.Response(status=204)

    async def op_CompleteMultipartUpload(self, r: _Ctx) -> web.Response:
        b, up = self._upload(r)
        try:
            listed = [(int(p.findtext("PartNumber") or ""), (p.findtext("ETag") or "").strip().strip('"'))
                      for p in _parse_xml(r.body).findall("Part")]
        except ValueError:
            raise S3Error(400, "MalformedXML", "bad PartNumber") from None
        if not listed:
            raise S3Error(400, "MalformedXML", "CompleteMultipartUpload lists no parts")
        if any(a[0] >= c[0] for a, c in zip(listed, listed[1:])):
            raise S3Error(400, "InvalidPartOrder", "The list of parts was not in ascending order.")
        chosen: List[_Data] = []
        for i, (n, etag) in enumerate(listed):
            part = up.parts.get(n)
            if part is None or (etag and etag != part.etag.strip('"')):
                raise S3Error(400, "InvalidPart", f"part {n} was not uploaded or its ETag does not match")
            if i < len(listed) - 1 and part.data.size < self.min_part_size:
                raise S3Error(400, "EntityTooSmall", "Your proposed upload is smaller than the minimum allowed size")
            chosen.append(part.data)
        # a 412 here leaves the upload in place, so the client can still abort it
        o = self._store(r, b, _Data.concat(chosen), self._etag(len(chosen)), up.content_type, up.meta)
        del b.uploads[up.upload_id]
        location = f"{r.request.url.origin()}/{r.bucket}/{quote(r.key)}"
        checksum = ""
        if up.checksum_algorithm == "CRC32C":  # the composite: crc32c of the parts' crcs, "-<parts>"
            raw = b"".join(base64.b64decode(up.parts[n].crc32c) for n, _ in listed)
            o.crc32c = base64.b64encode(_crc32c.crc32c(raw).to_bytes(4, "big")).decode() + f"-{len(listed)}"
            checksum = _el("ChecksumCRC32C", o.crc32c)
        return _xml("CompleteMultipartUploadResult", _el("Location", location)
                    + _el("Bucket", r.bucket) + _el("Key", r.key) + _el("ETag", o.etag) + checksum)
