"""S3 (and S3-compatible) store on aiobotocore.

One long-lived client per endpoint/credentials, bound to objckpt's background
event loop, with a connection pool sized for many requests in flight.  Choices
that matter for speed and safety:

* payload signing off (``UNSIGNED-PAYLOAD``): botocore otherwise SHA-256s every
  byte over plain HTTP (~0.7 CPU-s/GB); integrity is ours, via crc32c per chunk
  in the manifest, checked on every read.
* no botocore flexible checksums unless the operation requires one: same reason.
* retries: ours, not botocore's (see retry.py): a budget per kind of failure,
  so a refused connection or a silent endpoint is reported in seconds while
  throttling is waited out; body-streaming failures of a ranged GET are
  retried for the rest of the range.
* commit: ``PutObject`` with ``If-None-Match: *``; a 412 means someone else
  committed first.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Optional, Sequence

from .. import _runtime
from ..checksum import CellCrcs, crc32c, crc_header
from ..logs import get_logger
from ..errors import BucketNotFoundError, NotS3EndpointError, PreconditionFailed, StorageError
from .base import BlobWriter, ObjectInfo, ObjectStore, UploadInfo
from .limiter import AimdLimiter
from .s3_writer import S3Writer
from .s3_routes import NOT_DIRECT, DirectRoutes
from .s3_answers import botocore_not_s3, not_s3_error, botocore_answer
from .s3_config import S3Config, Transport
from .s3_direct import DirectClient, Sink
from .s3_request import DeleteError
from .retry import (RetryPolicy, callers_map, classify, error_code, is_missing, is_no_bucket, is_precondition,
                    no_answer, retrying)

log = get_logger("objckpt.storage")


def _botocore_passes(e: BaseException) -> bool:
    """Errors of botocore's side that go up unretried: what callers map, and an
    endpoint that is not S3 (retrying cannot make it one)."""
    return callers_map(e) or isinstance(e, NotS3EndpointError)


class S3Store(DirectRoutes, ObjectStore):
    """``s3://bucket/...``; options: endpoint_url, region_name, credentials,
    profile, addressing_style, ca_bundle, verify, unsigned, request_payer,
    sse_kms_key_id, concurrency, the budgets of :class:`RetryPolicy`
    (connect_timeout, read_timeout, throttle_attempts, error_attempts, ...), and
    endpoint_kind (``auto``, ``s3``, ``moto``: the upload and read shape, see
    :mod:`objckpt.storage.shape`).  All of them, and the environment and AWS
    config files, are resolved once here into :attr:`config` (see :mod:`.s3_config`)."""

    page_size = 1000  #: keys per listing page (S3's most; smaller in tests of the pagination)
    delete_batch = 1000  #: keys per DeleteObjects (S3's most)

    def __init__(self, bucket: str, **options: Any) -> None:
        self.bucket = bucket
        self.config = S3Config.resolve(bucket, options)
        cfg = self.config
        self.concurrency = cfg.concurrency
        self.policy = cfg.policy
        # adaptive=False keeps a fixed number of requests in flight (no AIMD)
        self.limiter = AimdLimiter(self.concurrency, name=f"s3://{bucket}") if cfg.adaptive else None
        # checksums=False: send no x-amz-checksum-crc32c (some S3-compatible stores refuse it)
        self.checksums = cfg.checksums
        self.endpoint_kind = cfg.endpoint_kind
        # the own HTTP path serves this store (else every request through botocore; see s3_config)
        self._direct_wanted = cfg.transport is Transport.DIRECT
        self._client: Any = None
        self._body_client: Any = None
        self._client_cms: list[Any] = []
        self._lock: Optional[asyncio.Lock] = None
        self._bucket_seen = False  # a HeadBucket succeeded: 404s are about keys
        self._answered = False  # the endpoint has sent an HTTP answer (see _send)
        self._direct_client: Optional[DirectClient] = None
        self._direct_decided = False
        self._direct_lock: Optional[asyncio.Lock] = None
        _runtime.on_reset(self._forget)

    def _no_bucket(self) -> BucketNotFoundError:
        return BucketNotFoundError(self.bucket, f"bucket {self.bucket!r} does not exist at {self.describe()}")

    async def _check_bucket(self) -> None:
        """Tell a missing key from a missing bucket.

        A 404 on HEAD carries no body, so it cannot say which is missing; one
        HeadBucket (once per store, while it succeeds) decides, so that callers
        get :class:`BucketNotFoundError` naming the bucket rather than "no
        checkpoint at ..." (and a save does not go on to fail in the middle).
        """
        if self._bucket_seen:
            return
        try:
            exists = await self._try_direct(
                lambda d: self._direct_call(d.bucket_exists, where=f"HeadBucket s3://{self.bucket}"))
        except Exception:
            return  # 403 etc.: let the original outcome stand
        if exists is not NOT_DIRECT:
            if not exists:
                raise self._no_bucket()
            self._bucket_seen = True
            return
        client = await self.client()
        try:
            await client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            if is_missing(e) or is_no_bucket(e):
                raise self._no_bucket() from None
            return  # 403 etc.: let the original outcome stand
        self._bucket_seen = True

    def _forget(self) -> None:
        if self._direct_client is not None:
            self._direct_client.forget()
        self._direct_lock = None
        self._client = self._body_client = self._lock = None
        self._client_cms = []
        self._answered = False
        if self.limiter is not None:
            self.limiter._cond = None  # bound to the loop that is gone

    async def client(self) -> Any:
        """The client for calls without a body: botocore retries them itself."""
        if self._client is None:
            await self._ensure_clients()
        return self._client

    async def body_client(self) -> Any:
        """The client for calls that send a body (PutObject, UploadPart).

        botocore can only retry a body it can rewind, and our bodies are
        zero-copy memoryviews, so this client makes one attempt and
        :meth:`call_with_body` does the retrying (same policy: exponential
        backoff with full jitter on throttling, 5xx and connection errors).
        """
        if self._body_client is None:
            await self._ensure_clients()
        return self._body_client

    async def _ensure_clients(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is None:
                # both make one attempt: call() / call_with_body() retry
                self._client, cm1 = await self._make_client(1)
                self._body_client, cm2 = await self._make_client(1)
                self._client_cms = [cm1, cm2]

    async def _make_client(self, max_attempts: int) -> tuple[Any, Any]:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        kwargs, extra = self.config.client_args()  # the same resolution the own path uses
        cfg: dict[str, Any] = dict(
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            max_pool_connections=max(self.concurrency * 2, 16),
            connect_timeout=self.policy.connect_timeout,
            read_timeout=self.policy.read_timeout,
            parameter_validation=False,
            **extra,
        )
        try:
            config = AioConfig(
                **cfg, request_checksum_calculation="when_required", response_checksum_validation="when_required"
            )
        except TypeError:  # older botocore without flexible checksums
            config = AioConfig(**cfg)
        session = get_session()
        if self.config.profile:  # the credential chain of the same profile (region, endpoint... are explicit)
            session.set_config_variable("profile", self.config.profile)
        cm = session.create_client("s3", config=config, **kwargs)
        client = await cm.__aenter__()
        if self.config.request_payer or self.config.sse_kms_key_id:
            headers_for = self.config.extra_headers

            def add_headers(request: Any, operation_name: str = "", **_: Any) -> None:
                for k, v in headers_for(operation_name).items():  # before signing: they are signed too
                    request.headers[k] = v

            client.meta.events.register("before-sign.s3", add_headers)
        return client, cm

    async def call_with_body(self, op: str, views: Sequence[memoryview], **kw: Any) -> Any:
        """One PutObject / UploadPart that sends ``views``; a fresh body per attempt."""
        headers: dict[str, str] = {}
        if "ChecksumCRC32C" in kw:
            headers["x-amz-checksum-crc32c"] = kw["ChecksumCRC32C"]
        if "IfNoneMatch" in kw:
            headers["if-none-match"] = kw["IfNoneMatch"]
        query = {"partNumber": str(kw["PartNumber"]), "uploadId": kw["UploadId"]} if op == "upload_part" else None
        where = f"{op} s3://{self.bucket}/{kw['Key']}"
        r = await self._try_direct(lambda d: self._direct_call(functools.partial(d.put, query=query), kw["Key"], views,
                                                               headers, where=where, has_body=True))
        if r is not NOT_DIRECT:
            return r
        client = await self.body_client()
        fn = getattr(client, op)
        from . import http_body  # aiohttp: imported only by a process that writes

        return await self._retrying(fn, kw, lambda: {"Body": http_body.body(views)}, has_body=True)

    async def call(self, fn: Any, **kw: Any) -> Any:
        """One API call, retried per :attr:`policy`; errors other than the ones
        callers map (missing key, failed precondition) become StorageError."""
        return await self._retrying(fn, kw, dict)

    async def _send(self, fn: Any, kw: dict[str, Any], has_body: bool) -> Any:
        """One attempt.  Until the endpoint has answered once, a body-less request
        is bounded by ``first_answer_timeout`` (connect + first byte): a silent
        endpoint is then reported in seconds; uploads keep the transfer budget.
        An answer that is not S3's raises :class:`NotS3EndpointError` (s3_answers)."""
        try:
            if self._answered or has_body:
                r = await fn(**kw)
            else:
                r = await asyncio.wait_for(fn(**kw), self.policy.first_answer_timeout)
        except asyncio.TimeoutError as e:
            if type(e) not in (asyncio.TimeoutError, TimeoutError):
                raise  # a client timeout (botocore's own), not wait_for's
            raise no_answer(self.endpoint(), self.policy.first_answer_timeout) from None
        except Exception as e:
            self._raise_if_not_s3(fn, kw, e)
            raise
        self._raise_if_not_s3(fn, kw, r)
        return r

    def _raise_if_not_s3(self, fn: Any, kw: dict[str, Any], answer: Any) -> None:
        """NotS3EndpointError when botocore's response (or ClientError) is not S3's."""
        op = str(getattr(fn, "__name__", ""))
        reason = botocore_not_s3(answer, head=op.startswith("head_"),
                                 object_answer=op in ("head_object", "get_object") and "Range" not in kw)
        if reason is not None:
            status, headers = botocore_answer(answer)
            where = f"{op} s3://{self.bucket}/{kw.get('Key', '')}"
            raise not_s3_error(self.endpoint(), where, status, headers, reason) from None

    async def _retrying(self, fn: Any, kw: dict[str, Any], extra: Any, has_body: bool = False) -> Any:
        """``fn(**kw, **extra())`` under the store's retry policy (:func:`.retry.retrying`).
        botocore's client bounds the first byte itself (``read_timeout``; ``_send``
        adds the first-answer bound), so the bound ``retrying`` offers goes unused."""
        what = f"{getattr(fn, '__name__', fn)} on s3://{self.bucket}/{kw.get('Key', kw.get('Prefix', ''))}"
        return await retrying(self, what, lambda _first_byte: self._send(fn, {**kw, **extra()}, has_body),
                              has_body=has_body, passes=_botocore_passes, name_type=False)

    async def get(self, key: str) -> bytes:
        """A whole object.  A body that breaks mid-stream (cut, reset, stalled past
        ``read_timeout``) is fetched again within the policy's budget for that
        kind of failure, like a ranged GET; what is left is a StorageError naming the key."""
        try:
            whole = await self._try_direct(lambda d: self._direct_call(d.get, key, where=f"GET s3://{self.bucket}/{key}"))
        except Exception as e:
            await self._raise_if_missing(key, e)
            raise
        if whole is not NOT_DIRECT:
            return bytes(whole)
        client = await self.client()
        attempt = 0
        while True:
            try:
                r = await self.call(client.get_object, Bucket=self.bucket, Key=key)
            except Exception as e:
                await self._raise_if_missing(key, e)
                raise
            try:
                async with r["Body"] as body:
                    return bytes(await body.read())
            except Exception as e:
                attempt += 1
                if attempt >= self.policy.attempts(classify(e)):
                    raise StorageError(
                        f"reading the body of s3://{self.bucket}/{key} from {self.endpoint()} failed "
                        f"({attempt} attempt{'s' if attempt > 1 else ''}): {type(e).__name__}: {e}"
                    ) from e
                log.warning("reading the body of s3://%s/%s broke (attempt %d); retrying: %s: %s", self.bucket, key,
                            attempt, type(e).__name__, e)
                await self.policy.backoff(attempt)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        n = await self._read_into(key, offset, [memoryview(buf)], allow_short=True)
        return bytes(buf[:n])

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        await self._read_into(key, offset, [out], allow_short=False)

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self._read_into(key, offset, list(outs), allow_short=False)

    async def get_range_tallied(self, key: str, offset: int, outs: Sequence[memoryview], tally: CellCrcs) -> None:
        """:meth:`get_range_scatter`, hashing the bytes into ``tally`` as they land (direct
        path only: ``tally`` stays incomplete when botocore read them, and the caller hashes)."""
        await self._read_into(key, offset, list(outs), allow_short=False, tally=tally)

    async def _read_into(self, key: str, offset: int, outs: list[memoryview], *, allow_short: bool,
                         tally: Optional[CellCrcs] = None) -> int:
        """One ranged GET streamed piecewise into ``outs`` (consecutive buffers):
        each received chunk is copied once, straight to where it belongs."""
        sink = Sink(outs, tally=tally)
        if sink.total == 0:
            return 0
        n = await self._try_direct(lambda d: self._read_direct(d, key, offset, sink, allow_short=allow_short))
        if n is not NOT_DIRECT:
            return int(n)
        sink = Sink(outs)  # botocore reads the whole range (again, if the direct path was refused midway)
        client = await self.client()
        attempt = 0
        while True:
            try:
                rng = f"bytes={offset + sink.got}-{offset + sink.total - 1}"
                r = await self.call(client.get_object, Bucket=self.bucket, Key=key, Range=rng)
                async with r["Body"] as body:
                    stream = body._raw_stream.content if hasattr(body, "_raw_stream") else None
                    while sink.got < sink.total:
                        chunk = await (stream.readany() if stream is not None else body.read(1 << 20))
                        if not chunk:
                            break
                        sink.write(memoryview(chunk))
                break
            except Exception as e:
                if await self._read_ends_short(key, e):
                    break  # object shorter than offset
                attempt += 1
                if isinstance(e, StorageError) or attempt >= self.policy.attempts(classify(e)):
                    raise StorageError(f"reading s3://{self.bucket}/{key} at {offset + sink.got}: {e}") from e
                log.warning("ranged GET of s3://%s/%s broke at byte %d (attempt %d); retrying the rest: %s: %s",
                            self.bucket, key, offset + sink.got, attempt, type(e).__name__, e)
                await self.policy.backoff(attempt)
        return self._delivered(key, offset, sink, allow_short)

    async def create_upload(self, key: str) -> str:
        """CreateMultipartUpload; the upload id."""
        headers = {"x-amz-checksum-algorithm": "CRC32C"} if self.checksums else {}
        upload_id = await self._try_direct(lambda d: self._direct_call(
            d.create_upload, key, headers, where=f"CreateMultipartUpload s3://{self.bucket}/{key}"))
        if upload_id is not NOT_DIRECT:
            return str(upload_id)
        client = await self.client()
        extra = {"ChecksumAlgorithm": "CRC32C"} if self.checksums else {}
        r = await self.call(client.create_multipart_upload, Bucket=self.bucket, Key=key, **extra)
        return str(r["UploadId"])

    async def complete_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> Any:
        """CompleteMultipartUpload of ``parts`` (PartNumber, ETag[, ChecksumCRC32C])."""
        r = await self._try_direct(lambda d: self._direct_call(
            d.complete_upload, key, upload_id, parts, where=f"CompleteMultipartUpload s3://{self.bucket}/{key}"))
        if r is not NOT_DIRECT:
            return r
        client = await self.client()
        return await self.call(client.complete_multipart_upload, Bucket=self.bucket, Key=key, UploadId=upload_id,
                               MultipartUpload={"Parts": parts})

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if if_absent:
            kw["IfNoneMatch"] = "*"
        if self.checksums:
            kw["ChecksumCRC32C"] = crc_header(crc32c(data))
        try:
            await self.call_with_body("put_object", [memoryview(data)], **kw)
        except Exception as e:
            if if_absent and is_precondition(e):
                raise PreconditionFailed(f"object s3://{self.bucket}/{key} already exists") from None
            raise

    async def head(self, key: str) -> Optional[ObjectInfo]:
        found = await self._try_direct(lambda d: self._direct_call(d.head, key, where=f"HEAD s3://{self.bucket}/{key}"))
        if found is not NOT_DIRECT:
            if found is None:
                await self._check_bucket()
                return None
            return ObjectInfo(key, found[0], found[1])
        client = await self.client()
        try:
            r = await self.call(client.head_object, Bucket=self.bucket, Key=key)
        except Exception as e:
            if is_missing(e):
                await self._check_bucket()
                return None
            raise
        return ObjectInfo(key, int(r["ContentLength"]), r.get("ETag"))

    async def list(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        token: Optional[str] = None
        while True:
            page = await self._try_direct(lambda d: self._direct_call(
                d.list_page, prefix, token, self.page_size, where=f"ListObjectsV2 s3://{self.bucket}/{prefix}"))
            if page is NOT_DIRECT:
                return await self._list_botocore(prefix)
            out.extend(ObjectInfo(o.key, o.size, o.etag, o.mtime) for o in page.objects)
            if page.next_token is None:
                return out
            token = page.next_token

    async def _list_botocore(self, prefix: str) -> list[ObjectInfo]:
        client = await self.client()
        out: list[ObjectInfo] = []
        token: Optional[str] = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self.page_size}
            if token:
                kw["ContinuationToken"] = token
            r = await self.call(client.list_objects_v2, **kw)
            out.extend(ObjectInfo(o["Key"], int(o["Size"]), o.get("ETag"),
                                  o["LastModified"].timestamp() if o.get("LastModified") else None)
                       for o in r.get("Contents", []))
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    async def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), self.delete_batch):
            batch = keys[i : i + self.delete_batch]
            where = f"DeleteObjects s3://{self.bucket} ({len(batch)} keys from {batch[0]!r})"
            errs = await self._try_direct(lambda d: self._direct_call(d.delete_objects, batch, where=where))
            if errs is NOT_DIRECT:
                client = await self.client()
                r = await self.call(client.delete_objects, Bucket=self.bucket,
                                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
                errs = [DeleteError(e.get("Key", ""), e.get("Code", ""), e.get("Message", ""))
                        for e in r.get("Errors", [])]
            self._raise_delete_errors(errs)

    def _raise_delete_errors(self, errs: list[DeleteError]) -> None:
        """The keys DeleteObjects refused (an already missing key is deleted), named."""
        errs = [e for e in errs if e.code != "NoSuchKey"]
        if errs:
            shown = "; ".join(f"{e.key!r}: {e.code} {e.message}".strip() for e in errs[:3])
            more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
            raise StorageError(f"deleting from s3://{self.bucket} at {self.endpoint()}: S3 did not delete "
                               f"{len(errs)} key{'s' if len(errs) > 1 else ''}: {shown}{more}")

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        return S3Writer(self, key, size, num_parts)

    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        out: list[UploadInfo] = []
        markers: tuple[Optional[str], Optional[str]] = (None, None)
        while True:
            page = await self._try_direct(lambda d: self._direct_call(
                d.list_uploads_page, prefix, *markers, self.page_size, where=f"ListMultipartUploads s3://{self.bucket}/{prefix}"))
            if page is NOT_DIRECT:
                return await self._list_uploads_botocore(prefix)
            out.extend(UploadInfo(u.key, u.upload_id, u.initiated) for u in page.uploads)
            if page.next_key_marker is None:
                return out
            markers = (page.next_key_marker, page.next_upload_id_marker)

    async def _list_uploads_botocore(self, prefix: str) -> list[UploadInfo]:
        client = await self.client()
        out: list[UploadInfo] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxUploads": self.page_size}
        while True:
            r = await self.call(client.list_multipart_uploads, **kw)
            for u in r.get("Uploads", []):
                init = u.get("Initiated")
                out.append(UploadInfo(u["Key"], u["UploadId"], init.timestamp() if init is not None else None))
            if not r.get("IsTruncated"):
                return out
            kw["KeyMarker"] = r.get("NextKeyMarker")
            kw["UploadIdMarker"] = r.get("NextUploadIdMarker")

    async def abort_upload(self, upload: UploadInfo) -> None:
        try:
            r = await self._try_direct(lambda d: self._direct_call(
                d.abort_upload, upload.key, upload.upload_id,
                where=f"AbortMultipartUpload s3://{self.bucket}/{upload.key}"))
            if r is NOT_DIRECT:
                client = await self.client()
                await self.call(client.abort_multipart_upload, Bucket=self.bucket, Key=upload.key,
                                UploadId=upload.upload_id)
        except Exception as e:
            if error_code(e) != "NoSuchUpload" and not is_missing(e):
                raise

    async def close(self) -> None:
        if self._direct_client is not None:
            self._direct_client.close()
        cms, self._client_cms = self._client_cms, []
        self._client = self._body_client = None
        for cm in cms:
            await cm.__aexit__(None, None, None)

    @property
    def endpoint_url(self) -> Optional[str]:
        """The custom endpoint (option, environment or AWS config file); None: AWS."""
        return self.config.endpoint_url.value  # type: ignore[no-any-return]

    def endpoint(self) -> str:
        """The endpoint requests go to, with the settings (and their sources) a failure
        there may come from: the proxy, the region (on AWS), the CA bundle."""
        return self.config.endpoint()

    def describe(self) -> str:
        return f"s3://{self.bucket} at {self.endpoint()}"

