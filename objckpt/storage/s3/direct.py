"""S3 requests on plain sockets: reads land in destination memory, writes leave from it.

A restore is dominated by receiving bytes.  Through aiobotocore each byte was
copied three times (socket buffer, aiohttp's parser, our copy into the tensor)
on the one event-loop thread, and a new process first paid 0.5-0.7 s of
imports and client set-up.  Here a GET or HEAD is a small blocking HTTP/1.1
exchange on a kept-alive connection, run on a pool of threads: the head is
parsed from a few hundred bytes, the body lands with ``recv_into`` directly in
the caller's buffers (one copy, kernel to tensor, with the GIL released), and
as many responses are received in parallel as threads run.

Writes go the same way: PutObject, UploadPart and the multipart calls send the
caller's buffers with ``sendall`` (no copy, no aiohttp writer), so a first save
in a new process does not wait for aiobotocore either.  Listings (ListObjectsV2,
ListMultipartUploads), DeleteObjects and AbortMultipartUpload go the same way,
their XML answers read by :mod:`.request`: on this transport no request goes
through botocore.

Where requests go (host, addressing, signing region, CA bundle, proxy) is
resolved once per store by :mod:`.config` from botocore's own resolution,
which also decides whether this path serves the store at all (not through a
proxy, for one); once chosen, it serves every request of the store, there is
no turning to botocore mid-flight.  A refusal saying the bucket is in another
region is a :class:`~.answers.WrongRegion`, which the pipeline follows on
this path (:mod:`.send`); an answer that is not S3's is a
:class:`~objckpt.errors.NotS3EndpointError`; any other refusal is an
:class:`S3HttpError` saying what S3 answered (with a hint for a redirect that
is not about the region and for a signature complaint).  A HEAD's refusal has
no body: a bare 400 or 403 to an object's HEAD is followed by a one-byte GET of
the key, whose refusal names the reason (:mod:`.refusals`).  Integrity does not
depend on this layer: every chunk's crc32c is checked above.
"""
from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import socket
import ssl
import threading
from typing import Any, Callable, Mapping, Optional, Sequence
from xml.sax.saxutils import escape

from ...runtime import loop as _runtime
from .answers import WrongRegion, not_s3_error, not_s3_reason, region_of, says_wrong_region
from . import config, refusals, request, tls
from .request import DeleteError, ListPage, MalformedAnswer, S3HttpError, UploadsPage, xml_field
from .credentials import CredentialSource
from .sigv4 import Signer, canonical_query, quote_path
from .http_answer import BadAnswer, Head, Reader, check_range, content_length
from .wire import Conn, Deadline, GrowingSink, ShortBody, Sink, send_views
from .wire import AnswerTimeout as AnswerTimeout  # re-exported: the store tells it from a silent endpoint
from .wire import SlowAnswer as SlowAnswer

_ERROR_BODY = 64 << 10
#: the largest answer body to a PUT or POST (S3's are a few hundred bytes)
_SMALL_BODY = 1 << 20
#: the most a whole-object GET answered in chunks (no Content-Length) may hold
_CHUNKED_WHOLE = 1 << 34
#: the largest answer body to a listing or DeleteObjects (1000 keys of up to 1 KiB, URL-encoded: ~4 MiB)
_XML_BODY = 16 << 20
#: the most of a widened 206's tail past the asked range that is read and dropped (Reader.body), so the deadline covers it
_WIDE_TAIL = 4 << 20
#: refusals of how a request was signed or authorized, and what to check (see :func:`_hint`); refusals of the
#: credentials themselves (SignatureDoesNotMatch, InvalidAccessKeyId, ...) are named by .refusals
_SIGNING_CODES = {"AuthorizationHeaderMalformed", "InvalidRequest", "IllegalLocationConstraintException"}


# where a bucket's requests go: resolved once per store by .config (botocore's endpoint rules)
Target = config.Target


def _op(method: str, path: str, query: str, bucket_path: str) -> str:
    """botocore's name of the operation a request is (for :meth:`S3Config.extra_headers`)."""
    names = {p.partition("=")[0] for p in query.split("&")} if query else set()
    if method == "GET":
        if path == bucket_path:
            return "ListMultipartUploads" if "uploads" in names else "ListObjectsV2"
        return "GetObject"
    if method == "HEAD":
        return "HeadBucket" if path == bucket_path else "HeadObject"
    if method == "PUT":
        return "UploadPart" if "partNumber" in names else "PutObject"
    if method == "DELETE":
        return "AbortMultipartUpload"
    if "delete" in names:
        return "DeleteObjects"
    return "CreateMultipartUpload" if "uploads" in names else "CompleteMultipartUpload"


_Head = Head  # the answer head (see http_answer.Head)


class DirectClient:
    """GET/HEAD and object writes for one bucket, blocking; call from :func:`pool` threads."""

    def __init__(self, bucket: str, target: Target, creds: CredentialSource, *, connect_timeout: float,
                 read_timeout: float, deadline_floor: float = 60.0, min_rate: float = float(1 << 20),
                 extra_headers: Optional[Callable[[str], Mapping[str, str]]] = None, user_agent: str = "objckpt",
                 keepalive: bool = False, splice: bool = False) -> None:
        self.bucket = bucket
        self.user_agent = user_agent  # "objckpt", then botocore's "app/<id>" (sdk_ua_app_id)
        self.keepalive = keepalive  # SO_KEEPALIVE on every connection (botocore's tcp_keepalive)
        self.splice = splice  # request bodies spliced on plain TCP (OBJCKPT_SPLICE_BODIES, read when the store opened)
        self.extra_headers = extra_headers  # per operation: requester-pays, SSE-KMS (S3Config.extra_headers)
        self.target = target
        self.creds = creds
        self.signer = Signer(target.region)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        # each exchange must be done within max(deadline_floor, bytes / min_rate) s (see wire.Deadline)
        self.deadline_floor = deadline_floor
        self.min_rate = min_rate
        self._idle: list[Conn] = []
        self._lock = threading.Lock()
        self._ssl: Optional[ssl.SSLContext] = None
        if target.scheme == "https":  # one per CA bundle version in the process (loaded ahead by the store's opening)
            self._ssl = tls.context(target.cafile, target.verify)

    # -- connections ------------------------------------------------------
    def _connect(self) -> Conn:
        t = self.target
        try:
            sock = socket.create_connection((t.host, t.port), timeout=self.connect_timeout)
        except OSError as e:
            raise _naming_host(e, t) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.keepalive:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if self._ssl is not None:
            try:
                sock = self._ssl.wrap_socket(sock, server_hostname=t.host)
            except ssl.SSLCertVerificationError as e:
                sock.close()
                raise config.CertificateError(
                    f"{t.scheme}://{t.host_header}: TLS certificate not trusted by CA bundle {t.cafile} "
                    f"({t.trust or 'the default'}): {e.verify_message or e}") from None
        return Conn(sock)

    def _take(self) -> Conn:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _give_back(self, conn: Conn) -> None:
        if conn.lent:  # an answer other than 2xx to a spliced body: its bytes may still be queued
            conn.close()
            return
        conn.used = True
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def forget(self) -> None:
        """After fork: the inherited sockets belong to the parent; drop them unclosed."""
        self._idle = []

    def retarget(self, target: Target) -> None:
        """Send to ``target`` from now on: the bucket's region (and, on AWS, its host),
        learned from a redirect.  Idle connections to another host are closed."""
        moved = (target.host, target.port) != (self.target.host, self.target.port)
        self.target, self.signer = target, Signer(target.region)
        if moved:
            self.close()

    def endpoint(self) -> str:
        """The URL requests go to, for messages."""
        return f"{self.target.scheme}://{self.target.host_header}"

    def _check_s3(self, head: _Head, what: str) -> None:
        """A 2xx answer to a HEAD or whole GET of an object must be S3's (see .answers)."""
        reason = not_s3_reason(head.status, head.headers, object_answer=True)
        if reason is not None:
            raise not_s3_error(self.endpoint(), what, head.status, head.headers, reason)

    # -- one exchange -----------------------------------------------------
    def _request(self, conn: Conn, method: str, path: str, extra: dict[str, str], rd: Reader,
                 query: str = "", body: Sequence[memoryview] = ()) -> Head:
        """Send one request and read its answer's head (interim 1xx answers skipped).

        The peer must take some of the body every ``first_byte`` seconds (the
        bound :meth:`.send.Pipeline.send` gives an attempt: ``read_timeout`` for a
        request with a body) and begin its answer within ``first_byte`` of the
        last byte sent; all of it within the request's deadline (``rd.dl``)."""
        if self.extra_headers is not None:
            bucket_path = quote_path(self.target.prefix or "/")
            extra = {**extra, **self.extra_headers(_op(method, path, query, bucket_path))}
        creds = self.creds.get()
        hdrs = {} if creds is None else self.signer.headers(method, path, query, self.target.host_header, creds,
                                                            extra=extra)
        target = f"{path}?{query}" if query else path
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self.target.host_header}", "Accept-Encoding: identity",
                 f"User-Agent: {self.user_agent}"]
        if method in ("PUT", "POST"):
            lines.append(f"Content-Length: {sum(len(v) for v in body)}")
        lines += [f"{k}: {v}" for k, v in {**hdrs, **extra}.items()]
        conn.sock.settimeout(rd.dl.bound(rd.first_byte))
        conn.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        # straight from the caller's memory (tensors, staging buffers)
        send_views(conn, body, rd.dl, rd.first_byte, splice=self.splice)
        head = rd.head()
        if 200 <= head.status < 300:
            conn.lent = False  # the server read the whole body: the socket holds none of it
        return head

    def _error(self, conn: Conn, rd: Reader, head: Head, what: str, has_body: bool) -> Exception:
        """The exception for a non-2xx answer (its body read, the connection reused)."""
        keep = not has_body and head.reusable
        sink = Sink([memoryview(bytearray(_ERROR_BODY))])
        try:
            if has_body:
                keep = rd.body(head, sink, 0, strict=False)
        except OSError:  # incl. BadAnswer: the status says what matters; the body was only its detail
            keep = False
        finally:
            if keep:
                self._give_back(conn)
            else:
                conn.close()
        text = sink.data().decode("utf-8", "replace")
        code = xml_field(text, "Code")
        message = xml_field(text, "Message")
        reason = not_s3_reason(head.status, head.headers, text)
        if reason is not None:
            return not_s3_error(self.endpoint(), what, head.status, head.headers, reason)
        region = region_of(head.headers, text)
        if says_wrong_region(head.status, code, region, bare_head=not has_body):
            return WrongRegion(f"{what}: HTTP {head.status} {code} {message}".strip(), status=head.status, code=code,
                               region=region, signed_region=self.signer.region)
        err = S3HttpError(head.status, code, message, what, head.headers.get("server"), region, _hint(head, code))
        meta = err.response["ResponseMetadata"]
        if isinstance(meta, dict):
            meta["HTTPHeaders"] = dict(head.headers)  # as botocore's: its Date tells a clock skew
        return err

    def _deadline(self, sink: "Optional[Sink | Callable[[Head], Sink]]", body: Sequence[memoryview]) -> Deadline:
        """The deadline of one exchange: its body and the answer asked for into ``sink``
        (a sink made from the head, a whole object, is covered once its size is known)."""
        asked = sink.total - sink.got if isinstance(sink, Sink) else 0
        return Deadline(self.deadline_floor, self.min_rate, sum(len(v) for v in body) + asked)

    def _exchange(self, method: str, path: str, extra: dict[str, str], first_byte: float,
                  sink: "Optional[Sink | Callable[[Head], Sink]]", what: str, query: str = "",
                  body: Sequence[memoryview] = ()) -> Head:
        """One request and its answer, on a kept-alive connection when one is idle.

        ``sink``: where the body goes, or a function that makes it from the
        answer's head (a whole object, sized by its Content-Length).  A reused
        connection the server has closed meanwhile fails before any answer:
        that is retried once on a fresh connection, unseen by callers.  An
        exchange that outlives its deadline raises :class:`~.wire.SlowAnswer`
        saying what moved and how fast."""
        for fresh in (False, True):
            conn = self._connect() if fresh else self._take()
            reused = conn.used
            rd = Reader(conn, self.target.host_header, self._deadline(sink, body), first_byte, self.read_timeout)
            try:
                head = self._request(conn, method, path, extra, rd, query, body)
            except (ConnectionError, OSError) as e:
                conn.close()
                if isinstance(e, TimeoutError) and rd.dl.passed():
                    raise rd.dl.error(f"{what} from {self.target.host_header}") from None
                if reused and not fresh and not isinstance(e, (TimeoutError, BadAnswer)):
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            if not 200 <= head.status < 300:
                raise self._error(conn, rd, head, what, has_body=method != "HEAD" and head.status not in (204, 304))
            keep = head.reusable
            try:
                if method != "HEAD" and head.status not in (204, 304):  # answers that have no body
                    keep = self._answer_body(rd, head, extra, sink, what)
            except TimeoutError as e:
                conn.close()
                if rd.dl.passed():
                    raise rd.dl.error(f"{what} from {self.target.host_header}") from None
                if isinstance(e, AnswerTimeout):
                    raise
                raise AnswerTimeout(f"{what}: {self.target.host_header} answered HTTP {head.status}, then sent "
                                    f"nothing for {self.read_timeout:g} s mid-body (read_timeout)") from None
            except BaseException:
                conn.close()
                raise
            if keep:
                self._give_back(conn)
            else:
                conn.close()
            return head
        raise AssertionError("unreachable")  # pragma: no cover

    def _answer_body(self, rd: Reader, head: Head, extra: dict[str, str],
                     sink: "Optional[Sink | Callable[[Head], Sink]]", what: str) -> bool:
        """Receive a 2xx answer's body where it belongs; True when the connection can be reused.

        A ranged GET's 206 must cover the range asked for, and one the server widened
        gives the asked bytes out of it (:func:`~.http_answer.check_range`); a 200 to it
        (a server that ignores Range) is read from the range's start.  Bodies are bounded by what
        was asked for: a ranged sink's size, a whole object's Content-Length, a
        write's answer :data:`_SMALL_BODY`."""
        out = sink(head) if callable(sink) else sink
        if callable(sink):
            head.body = out
            # the deadline covers what was announced (a chunked answer: the floor and what a listing may hold)
            n = content_length(head, self.target.host_header)
            rd.dl.cover(rd.dl.size + (out.total if n is not None else min(out.total, _XML_BODY)))
        skip = 0
        strict = True
        rng = extra.get("range")
        if rng is not None:
            lo, hi = (int(x) for x in rng[6:].split("-"))
            if head.status == 206:  # the asked bytes out of it, should the server have widened the range
                span = check_range(head, lo, hi, f"{what} from {self.target.host_header}")
                skip, strict = span.before, span.before == span.after == 0
                rd.dl.cover(rd.dl.size + span.before + min(span.after, _WIDE_TAIL))
            elif head.status == 200:  # the server ignored Range: skip to its start
                skip, strict = lo, lo == 0
                rd.dl.cover(rd.dl.size + skip)
        return rd.body(head, out, skip, strict=strict)

    # -- the calls --------------------------------------------------------
    def _path(self, key: str) -> str:
        return quote_path(f"{self.target.prefix}/{key}")

    def read_range(self, key: str, start: int, sink: Sink, first_byte: float) -> None:
        """Bytes ``start + sink.got ..`` of ``key`` into ``sink``, until it is full or
        the object ends (a shorter 206 answer); 416 when ``start`` is past the end."""
        if sink.got >= sink.total:
            return
        lo, hi = start + sink.got, start + sink.total - 1
        self._exchange("GET", self._path(key), {"range": f"bytes={lo}-{hi}"}, first_byte, sink,
                       f"GET s3://{self.bucket}/{key} bytes {lo}-{hi}")

    def get(self, key: str, first_byte: float) -> bytes:
        """A whole object (small ones: manifests, indexes), in one request."""
        what = f"GET s3://{self.bucket}/{key}"

        sizes: list[Optional[int]] = []

        def sized(head: Head) -> Sink:
            n = content_length(head, f"{what} from {self.target.host_header}")
            sizes.append(n)  # None: a chunked answer, as long as its chunks say
            return GrowingSink(_CHUNKED_WHOLE if n is None else n)  # memory follows the bytes that arrive

        head = self._exchange("GET", self._path(key), {}, first_byte, sized, what)
        self._check_s3(head, what)
        body = head.body
        if body is None or (sizes[-1] is not None and body.got != body.total):
            got, total = (0, 0) if body is None else (body.got, body.total)
            raise ShortBody(f"{what}: {got} of {total} bytes")
        return body.data()

    def _head(self, key: Optional[str], first_byte: float, extra: Optional[dict[str, str]] = None) -> _Head:
        """HEAD of ``key`` (``None``: of the bucket, i.e. HeadBucket); a refusal raises."""
        if key is None:
            return self._exchange("HEAD", quote_path(self.target.prefix or "/"), {}, first_byte, None,
                                  f"HEAD s3://{self.bucket}")
        return self._exchange("HEAD", self._path(key), extra or {}, first_byte, None,
                              f"HEAD s3://{self.bucket}/{key}")

    def _head_if_present(self, key: Optional[str], first_byte: float,
                         extra: Optional[dict[str, str]] = None) -> Optional[_Head]:
        """:meth:`_head`, ``None`` on 404: an answer to HEAD has no body, so its 404
        says only "absent" (which of key and bucket, the store asks separately)."""
        try:
            return self._head(key, first_byte, extra)
        except S3HttpError as e:
            if e.status == 404:
                return None
            if key is not None and refusals.is_bare(e):
                self._why_refused(key, first_byte)
            raise
        except WrongRegion as e:  # a bare 400: the wrong region, or another refusal a HEAD cannot say
            if key is not None and refusals.is_bare(e):
                self._why_refused(key, first_byte)
            raise

    def _why_refused(self, key: str, first_byte: float) -> None:
        """After a bare 400/403 to a HEAD of ``key``: a one-byte GET of it, whose refusal
        carries S3's reason; raised in the HEAD's place when it names one (see
        :mod:`.refusals`), else this returns and the HEAD's own refusal stands."""
        what = f"HEAD s3://{self.bucket}/{key} refused without a body; GET of it"
        try:
            self._exchange("GET", self._path(key), {"range": "bytes=0-0"}, first_byte,
                           Sink([memoryview(bytearray(1))]), what)
        except Exception as why:
            if refusals.says_why(why):
                raise refusals.mark_explains_head(why) from None

    def stored(self, key: str, first_byte: float, checksum: bool = True) -> Optional[request.Stored]:
        """Size, ETag and stored crc32c of ``key`` (HEAD with ``x-amz-checksum-mode:
        ENABLED``; ``checksum=False``: without it, and no crc32c); ``None`` if absent."""
        h = self._head_if_present(key, first_byte, {"x-amz-checksum-mode": "ENABLED"} if checksum else {})
        if h is None:
            return None
        what = f"HEAD s3://{self.bucket}/{key}"
        self._check_s3(h, what)
        return request.Stored(content_length(h, what) or 0, h.headers.get("etag"),
                              h.headers.get("x-amz-checksum-crc32c"))

    def head(self, key: str, first_byte: float) -> Optional[tuple[int, Optional[str]]]:
        """(size, ETag) of ``key``; ``None`` if absent."""
        h = self._head_if_present(key, first_byte)
        if h is not None:
            self._check_s3(h, f"HEAD s3://{self.bucket}/{key}")
        return None if h is None else (int(h.headers.get("content-length", "0")), h.headers.get("etag"))

    # -- writes -------------------------------------------------------------
    def _small_body(self, head: Head) -> Sink:
        """Where the answer to a PUT or POST goes: its Content-Length (or, chunked, up
        to :data:`_SMALL_BODY`), allocated as it arrives; a larger one is refused."""
        n = content_length(head, self.target.host_header)
        if n is not None and n > _SMALL_BODY:
            raise BadAnswer(f"{self.target.host_header}: an answer body of {n} bytes to a write "
                            f"(over {_SMALL_BODY}; refused unread)")
        return GrowingSink(_SMALL_BODY if n is None else n)

    def put(self, key: str, views: Sequence[memoryview], headers: dict[str, str], first_byte: float,
            query: Optional[dict[str, str]] = None) -> dict[str, str]:
        """PutObject (or UploadPart, with ``query``) of ``views``, sent as they are.

        Returns what botocore would: ``ETag`` and the checksum the server stored."""
        what = f"PUT s3://{self.bucket}/{key}" + (f" part {query['partNumber']}" if query else "")
        h = self._exchange("PUT", self._path(key), headers, first_byte, self._small_body, what,
                           canonical_query(query or {}), [v if v.format == "B" else v.cast("B") for v in views])
        reason = not_s3_reason(h.status, h.headers)
        if reason is not None:
            raise not_s3_error(self.endpoint(), what, h.status, h.headers, reason)
        out = {"ETag": h.headers.get("etag", "")}
        if "x-amz-checksum-crc32c" in h.headers:
            out["ChecksumCRC32C"] = h.headers["x-amz-checksum-crc32c"]
        return out

    def _post(self, key: str, query: dict[str, str], headers: dict[str, str], body: bytes, first_byte: float,
              what: str) -> str:
        h = self._exchange("POST", self._path(key), headers, first_byte, self._small_body, what,
                           canonical_query(query), [memoryview(body)] if body else [])
        text = h.body.data().decode("utf-8", "replace") if h.body is not None else ""
        if "<Error>" in text:  # CompleteMultipartUpload can fail inside a 200
            raise S3HttpError(500, xml_field(text, "Code"), xml_field(text, "Message"), what)
        return text

    def create_upload(self, key: str, headers: dict[str, str], first_byte: float) -> str:
        text = self._post(key, {"uploads": ""}, headers, b"", first_byte,
                          f"CreateMultipartUpload s3://{self.bucket}/{key}")
        upload_id = xml_field(text, "UploadId")
        if not upload_id:
            raise MalformedAnswer(f"CreateMultipartUpload s3://{self.bucket}/{key} at {self.endpoint()}: "
                                  f"no UploadId in the answer ({text[:80]!r})")
        return upload_id

    def complete_upload(self, key: str, upload_id: str, parts: Sequence[dict[str, Any]], first_byte: float) -> dict[str, str]:
        xml = "".join("<Part>" + "".join(f"<{k}>{escape(str(v))}</{k}>" for k, v in p.items()) + "</Part>"
                      for p in parts)
        body = ('<CompleteMultipartUpload xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"{xml}</CompleteMultipartUpload>").encode()
        text = self._post(key, {"uploadId": upload_id}, {"content-type": "application/xml"}, body, first_byte,
                          f"CompleteMultipartUpload s3://{self.bucket}/{key}")
        crc = xml_field(text, "ChecksumCRC32C")
        return {"ChecksumCRC32C": crc} if crc else {}

    # -- listings, deletes, aborts -------------------------------------------
    def _xml_answer(self, head: Head) -> Sink:
        """Where a listing's or DeleteObjects' answer goes: up to :data:`_XML_BODY`."""
        n = content_length(head, self.target.host_header)
        if n is not None and n > _XML_BODY:
            raise BadAnswer(f"{self.target.host_header}: an answer body of {n} bytes to a listing "
                            f"(over {_XML_BODY}; refused unread)")
        return GrowingSink(_XML_BODY if n is None else n)

    def _bucket_get(self, query: dict[str, str], first_byte: float, what: str) -> str:
        h = self._exchange("GET", quote_path(self.target.prefix or "/"), {}, first_byte, self._xml_answer, what,
                           canonical_query(query))
        return h.body.data().decode("utf-8", "replace") if h.body is not None else ""

    def list_page(self, prefix: str, token: Optional[str], max_keys: int, first_byte: float) -> ListPage:
        """One ListObjectsV2 page of keys under ``prefix`` (``token``: where the last one ended)."""
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url", "max-keys": str(max_keys)}
        if token:
            query["continuation-token"] = token
        what = f"ListObjectsV2 s3://{self.bucket}/{prefix}"
        return request.list_page(self._bucket_get(query, first_byte, what), what)

    def list_uploads_page(self, prefix: str, key_marker: Optional[str], upload_id_marker: Optional[str],
                          max_uploads: int, first_byte: float) -> UploadsPage:
        """One ListMultipartUploads page under ``prefix`` (the markers: where the last one ended)."""
        query = {"uploads": "", "prefix": prefix, "encoding-type": "url", "max-uploads": str(max_uploads)}
        if key_marker:
            query["key-marker"] = key_marker
            query["upload-id-marker"] = upload_id_marker or ""
        what = f"ListMultipartUploads s3://{self.bucket}/{prefix}"
        return request.uploads_page(self._bucket_get(query, first_byte, what), what)

    def delete_objects(self, keys: Sequence[str], first_byte: float) -> list[DeleteError]:
        """DeleteObjects of up to 1000 ``keys`` in quiet mode; the keys S3 did not delete.
        The body carries its Content-MD5, which S3 requires of this call."""
        body = request.delete_body(list(keys))
        md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        what = f"DeleteObjects s3://{self.bucket} ({len(keys)} keys)"
        h = self._exchange("POST", quote_path(self.target.prefix or "/"), {"content-md5": md5,
                           "content-type": "application/xml"}, first_byte, self._xml_answer, what,
                           canonical_query({"delete": ""}), [memoryview(body)])
        return request.delete_errors(h.body.data().decode("utf-8", "replace") if h.body is not None else "", what)

    def abort_upload(self, key: str, upload_id: str, first_byte: float) -> None:
        """AbortMultipartUpload; a 404 (NoSuchUpload) raises for the caller to map."""
        self._exchange("DELETE", self._path(key), {}, first_byte, self._small_body,
                       f"AbortMultipartUpload s3://{self.bucket}/{key}", canonical_query({"uploadId": upload_id}))

    def server_header(self, first_byte: float) -> Optional[str]:
        """The ``Server`` header of a HeadBucket answer, refused or not (see shape.py)."""
        try:
            return self._head(None, first_byte).headers.get("server")
        except S3HttpError as e:
            return e.server

    def bucket_exists(self, first_byte: float) -> bool:
        """HeadBucket: tells a missing bucket from a missing key after a bodiless 404."""
        return self._head_if_present(None, first_byte) is not None

    def bucket_region(self, first_byte: float) -> Optional[str]:
        """The bucket's region from a HeadBucket's ``x-amz-bucket-region``, which S3 sends
        whether it answers 200, 301, 400 or 403 (botocore's redirector asks the same);
        None when the answer does not say.  A missing bucket raises (404)."""
        try:
            return self._head(None, first_byte).headers.get("x-amz-bucket-region") or None
        except WrongRegion as e:
            return e.region
        except S3HttpError as e:
            if e.status == 404:
                raise
            return e.region


def _naming_host(e: OSError, t: Target) -> OSError:
    """``e``, a failure to connect, saying the host and port it was for: with virtual-host
    addressing that is the bucket's host (``bucket.endpoint``), not the endpoint's, and
    the resolver's text (``Name or service not known``) names neither.  Same type, so
    the retry budgets classify it as before."""
    where = f"connecting to {t.host}:{t.port}" + (" (the bucket's virtual host)" if not t.prefix else "")
    text = f"{e.strerror or e}: {where}"
    try:
        named = type(e)(e.errno, text) if e.errno is not None else type(e)(text)
    except Exception:  # an OSError subclass with another signature: keep it as it was
        return e
    return named


def _hint(head: Head, code: str) -> str:
    """What to check, for refusals whose S3 code alone does not say it."""
    if head.status in (301, 302, 303, 307, 308):
        where = head.headers.get("location")
        return (f" (the endpoint redirects{' to ' + where if where else ''}; objckpt follows only S3's "
                "region redirects: set endpoint_url to the address the requests belong to)")
    if code in _SIGNING_CODES:
        return (" (the request's signature or credentials were refused: check the keys, the region and the "
                "clock; an endpoint that wants another signing than SigV4 is served through botocore with "
                "storage option direct_http=False)")
    return ""


# -- the threads that run the exchanges -----------------------------------------
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that block in socket calls (the GIL is released while they wait
    or copy), shared by all stores; sized so each store's concurrency fits."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="objckpt-recv")
        return _pool


def _after_fork() -> None:
    global _pool
    _pool = None


_runtime.on_reset(_after_fork)

