"""S3 (and S3-compatible) store: what each ObjectStore call asks of S3.

Every request goes through the store's one :class:`~.send.Pipeline`: one
transport chosen by the store's :class:`~.config.S3Config` (objckpt's own
HTTP path, or botocore's client behind a proxy or with ``direct_http=False``),
one loop of retries, limiter and error mapping.  This module only says which
requests an operation makes and what their answers mean.  Choices that matter
for speed and safety:

* payload signing off (``UNSIGNED-PAYLOAD``): hashing every byte costs ~0.7
  CPU-s/GB; integrity is ours, via crc32c per chunk in the manifest, checked
  on every read, and per part by the server (``x-amz-checksum-crc32c``) where
  it checks them (a store that does not is named once, at WARNING).
* retries: ours (see :mod:`.send`): a budget per kind of failure, so a
  refused connection or a silent endpoint is reported in seconds while
  throttling is waited out; a ranged GET that breaks is asked again for the
  rest of its range only.
* commit: ``PutObject`` with ``If-None-Match: *``; a 412 means someone else
  committed first.
* writes: what the pipeline passes up for readers to map (a 404, 416, an
  unasked-for 412/409) is never a bare S3 or botocore error on a write (a
  missing bucket: BucketNotFoundError; else a StorageError naming the request,
  the upload and the cause); a ``CompleteMultipartUpload`` answered
  ``NoSuchUpload`` after an answer was lost is a success when the object at
  the key is the upload's (see :mod:`.write_outcome`).
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

from ...runtime import loop as _runtime
from ...checksum import CellCrcs, crc32c, crc_header
from ...errors import BucketNotFoundError, CorruptCheckpointError, NotS3EndpointError, PreconditionFailed, StorageError
from ...logs import get_logger
from ..base import BlobWriter, ObjectInfo, ObjectStore, UploadInfo, not_found
from .retry import Failure, callers_map, classify, error_code, is_missing, is_past_end, is_precondition
from .answers import WrongRegion
from .config import S3Config
from .request import DeleteError, S3HttpError
from .send import Pipeline
from .transport import S3Transport
from .writer import S3Writer
from .wire import Sink
from .write_outcome import Expected, refusal, s3_answer, upload_gone

log = get_logger("objckpt.storage")
T = TypeVar("T")


async def _delete_once(t: S3Transport, keys: list[str], first: float, what: str) -> list[DeleteError]:
    """One DeleteObjects of ``keys``; the keys it did not delete.  Keys S3 refused for a
    passing reason (``SlowDown``, ``InternalError``: S3 answers them per key inside a 200)
    raise, so that the pipeline sends the batch again under the budget of that kind of
    failure (deleting is idempotent; throttling also slows the limiter)."""
    errs = await t.delete_objects(keys, first)
    passing = [e for e in errs if classify(S3HttpError(200, e.code, e.message, what)) in (Failure.THROTTLE,
                                                                                          Failure.SERVER)]
    if passing:
        e = passing[0]
        raise S3HttpError(200, e.code, e.message, f"{what}: S3 did not delete {len(passing)} of them for now "
                                                  f"(first {e.key!r})")
    return errs


class S3Store(ObjectStore):
    """``s3://bucket/...``; options: endpoint_url, region_name, credentials,
    profile, addressing_style, ca_bundle, verify, unsigned, request_payer,
    sse_kms_key_id, concurrency, the budgets of :class:`RetryPolicy`
    (connect_timeout, read_timeout, throttle_attempts, error_attempts, ...), and
    endpoint_kind (``auto``, ``s3``, ``moto``: the upload and read shape, see
    :mod:`objckpt.storage.shape`).  All of them, and the environment and AWS
    config files, are resolved once here into :attr:`config` (see :mod:`.config`)."""

    page_size = 1000  #: keys per listing page (S3's most; smaller in tests of the pagination)
    delete_batch = 1000  #: keys per DeleteObjects (S3's most)

    def __init__(self, bucket: str, **options: Any) -> None:
        self.bucket = bucket
        self.config = S3Config.resolve(bucket, options)
        cfg = self.config
        self.concurrency = cfg.concurrency
        self.policy = cfg.policy
        # checksums=False (or request_checksum_calculation=when_required): send no x-amz-checksum-crc32c
        # (some S3-compatible stores refuse it)
        self.checksums = cfg.checksums
        # response_checksum_validation=when_required: no x-amz-checksum-mode on the HEAD that asks for it
        self.asks_stored_checksum = cfg.request_settings.asks_stored_checksum
        self.endpoint_kind = cfg.endpoint_kind
        self.pipeline = Pipeline(cfg)
        self.limiter = self.pipeline.limiter
        self._bucket_seen = False  # a HeadBucket succeeded: 404s are about keys
        self._unchecked_said = False  # the store answered a checksummed upload without its checksum (warned once)
        _runtime.on_reset(self.pipeline.forget)

    async def transport(self) -> S3Transport:
        """The transport that serves this store (chosen by :attr:`config`)."""
        return await self.pipeline.transport()

    def _no_bucket(self) -> BucketNotFoundError:
        return self.pipeline.no_bucket()

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
            exists = await self.pipeline.send(f"HeadBucket s3://{self.bucket}", lambda t, f: t.bucket_exists(f))
        except Exception:
            return  # 403 etc.: let the original outcome stand
        if not exists:
            raise self._no_bucket()
        self._bucket_seen = True

    # -- reads ---------------------------------------------------------------------
    async def get(self, key: str) -> bytes:
        """A whole object.  A body that breaks mid-stream (cut, reset, stalled past
        ``read_timeout``) is fetched again within the policy's budget for that
        kind of failure; what is left is a StorageError naming the key."""
        try:
            return bytes(await self.pipeline.send(f"GET s3://{self.bucket}/{key}", lambda t, f: t.get(key, f)))
        except Exception as e:
            await self._raise_if_missing(key, e)
            raise

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        n = await self._read_into(key, offset, [memoryview(buf)], allow_short=True)
        return bytes(buf[:n])

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        await self._read_into(key, offset, [out], allow_short=False)

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self._read_into(key, offset, list(outs), allow_short=False)

    async def get_range_tallied(self, key: str, offset: int, outs: Sequence[memoryview], tally: CellCrcs) -> None:
        """:meth:`get_range_scatter`, hashing the bytes into ``tally`` as they land."""
        await self._read_into(key, offset, list(outs), allow_short=False, tally=tally)

    async def _read_into(self, key: str, offset: int, outs: list[memoryview], *, allow_short: bool,
                         tally: Optional[CellCrcs] = None) -> int:
        """One ranged GET streamed piecewise into ``outs`` (consecutive buffers): each
        received chunk is copied once, straight to where it belongs; a retry asks for
        the rest only, and a shorter answer (the object ends) ends it."""
        sink = Sink(outs, tally=tally)
        if sink.total == 0:
            return 0
        where = f"GET s3://{self.bucket}/{key} at {offset}"
        try:
            while sink.got < sink.total:
                before = sink.got
                await self.pipeline.send(where, lambda t, f: t.read_range(key, offset, sink, f))
                if sink.got == before:
                    break  # the object ends before the range does
        except asyncio.CancelledError:
            sink.cancelled = True  # the receiving thread stops at its next buffer
            raise
        except Exception as e:
            if not await self._read_ends_short(key, e):
                raise
        if sink.got != sink.total and not allow_short:
            raise CorruptCheckpointError(
                f"object s3://{self.bucket}/{key} is truncated: wanted bytes {offset}..{offset + sink.total}, "
                f"got {sink.got}")
        return sink.got

    async def _raise_if_missing(self, key: str, e: BaseException) -> None:
        """A 404 for ``key`` as :class:`NotFoundError` naming the object, or as
        :class:`BucketNotFoundError` when it is the bucket that is missing; else nothing."""
        if is_missing(e):
            await self._check_bucket()
            raise not_found(f"s3://{self.bucket}/{key}") from None

    async def _read_ends_short(self, key: str, e: Exception) -> bool:
        """Whether a ranged GET of ``key`` that raised ``e`` has merely ended: True when
        the range starts past the object's end (the length check decides); a missing
        key or bucket is raised as such; False: a failure to raise."""
        if isinstance(e, BucketNotFoundError):
            raise e
        await self._raise_if_missing(key, e)
        return is_past_end(e)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        found = await self.pipeline.send(f"HEAD s3://{self.bucket}/{key}", lambda t, f: t.head(key, f))
        if found is None:
            await self._check_bucket()
            return None
        return ObjectInfo(key, found[0], found[1])

    async def server_header(self, timeout: float) -> tuple[bool, Optional[str]]:
        """(answered, Server header) of one HeadBucket, answered or refused alike; (False,
        None) when nothing answered (see shape.py).  Not retried: a probe."""
        t = await self.transport()
        for _ in range(2):
            try:
                return True, await t.server_header(timeout)
            except NotS3EndpointError:
                raise  # a definite answer: no save or read can go on
            except WrongRegion as e:  # the probe learns the region for the requests that follow
                try:
                    if await self.pipeline.follow_region(t, e) is None:
                        return False, None
                except Exception:
                    return False, None
            except Exception:
                return False, None
        return False, None

    # -- writes --------------------------------------------------------------------
    def checksum_not_reported(self, op: str) -> None:
        """The store answered ``op`` (PutObject, UploadPart), which carried
        ``x-amz-checksum-crc32c``, without reporting it back: it neither refuses a body
        damaged in flight nor lets objckpt compare (Ceph RGW accepts a wrong one).  Said
        once per store, from answers the upload gets anyway; such damage is then caught
        by the chunks' crc32c when the checkpoint is read, loaded or verified."""
        if self._unchecked_said:
            return
        self._unchecked_said = True
        log.warning("%s does not check part checksums: it answered %s, which carried x-amz-checksum-crc32c, "
                    "without it (S3 reports the checksum it verified). A part damaged in flight is not refused "
                    "there; objckpt's crc32c per chunk catches it when the checkpoint is read, loaded or verified "
                    "(`objckpt verify`), not while saving", self.describe(), op)

    async def put_views(self, key: str, views: Sequence[memoryview], headers: dict[str, str],
                        part: Optional[tuple[str, int]] = None) -> dict[str, str]:
        """One PutObject (or, with ``part`` = (upload id, part number), UploadPart) of
        ``views``, sent from them as they are, whole again on each attempt; the
        ETag and the checksum the server stored."""
        query = None if part is None else {"partNumber": str(part[1]), "uploadId": part[0]}
        what = f"PUT s3://{self.bucket}/{key}" + ("" if part is None else f" part {part[1]}")
        return await self._write(what, lambda t, f: t.put(key, views, headers, query, f), has_body=True,
                                 conditional="if-none-match" in headers, upload_id=None if part is None else part[0])

    async def _write(self, what: str, op: Callable[[S3Transport, float], Awaitable[T]], *, has_body: bool = False,
                     conditional: bool = False, upload_id: Optional[str] = None) -> T:
        """A write through the pipeline, whose unretried answers that readers map (404,
        416, and 412 unless the write is ``conditional``: its caller maps those)
        never go up bare: see :meth:`_refused_write`."""
        try:
            return await self.pipeline.send(what, op, has_body=has_body)
        except Exception as e:
            if not callers_map(e) or (conditional and is_precondition(e)):
                raise
            raise await self._refused_write(what, e, upload_id) from None

    async def _refused_write(self, what: str, e: BaseException, upload_id: Optional[str] = None) -> StorageError:
        """The error for a write S3 refused with an answer readers map: a missing bucket
        raises :class:`BucketNotFoundError` (one HeadBucket, asked afresh); anything else
        is a StorageError naming the request, the upload, S3's answer and the cause."""
        if is_missing(e) and error_code(e) != "NoSuchUpload":
            self._bucket_seen = False  # it may have gone since it was seen
            await self._check_bucket()
        upload = f" (upload {upload_id})" if upload_id else ""
        return StorageError(f"S3 {what}{upload} at {self.endpoint()}: S3 answered {s3_answer(e)}: "
                            f"{refusal(e, upload_id)}")

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        headers: dict[str, str] = {}
        if if_absent:
            headers["if-none-match"] = "*"
        if self.checksums:
            headers["x-amz-checksum-crc32c"] = crc_header(crc32c(data))
        try:
            await self.put_views(key, [memoryview(data)], headers)
        except Exception as e:
            if if_absent and is_precondition(e):
                raise PreconditionFailed(f"object s3://{self.bucket}/{key} already exists") from None
            raise

    async def create_upload(self, key: str) -> str:
        """CreateMultipartUpload; the upload id."""
        headers = {"x-amz-checksum-algorithm": "CRC32C"} if self.checksums else {}
        return await self._write(f"CreateMultipartUpload s3://{self.bucket}/{key}",
                                 lambda t, f: t.create_upload(key, headers, f))

    async def complete_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                              expect: Optional[Expected] = None) -> dict[str, str]:
        """CompleteMultipartUpload of ``parts`` (PartNumber, ETag[, ChecksumCRC32C]).

        An answer lost on the way (a reset, a timeout) is sent again; if the first one
        completed, the upload is gone and S3 answers ``404 NoSuchUpload``.  Then the
        object at ``key`` decides: the one ``expect`` describes is this upload, completed
        (a success; nothing reported back); anything else is a StorageError naming the
        key, the upload, what is there and the cause (see :mod:`.write_outcome`)."""
        what = f"CompleteMultipartUpload s3://{self.bucket}/{key}"
        try:
            return await self.pipeline.send(what, lambda t, f: t.complete_upload(key, upload_id, parts, f))
        except Exception as e:
            if not callers_map(e):
                raise
            if not is_missing(e) or expect is None:
                raise await self._refused_write(what, e, upload_id) from None
            gone = e
        found = await self.pipeline.send(f"HEAD s3://{self.bucket}/{key} (after {what} answered NoSuchUpload)",
                                         lambda t, f: t.stored(key, f, self.asks_stored_checksum))
        differs = expect.differs(found)
        if differs is None:
            log.info("S3 %s (upload %s) answered %s: an earlier attempt completed it (its answer was lost); the "
                     "object at the key is the upload's (%d bytes, %d parts)", what, upload_id, s3_answer(gone),
                     expect.size, expect.parts)
            return {}
        if found is None and error_code(gone) != "NoSuchUpload":  # a bare 404: the bucket may be what is gone
            self._bucket_seen = False
            await self._check_bucket()
        raise StorageError(f"S3 {what} (upload {upload_id}) at {self.endpoint()}: S3 answered {s3_answer(gone)}, and "
                           f"no attempt's completion is at the key ({differs}): {upload_gone(upload_id)}")

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        return S3Writer(self, key, size, num_parts)

    # -- listings, deletes, aborts -------------------------------------------------
    async def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), self.delete_batch):
            batch = keys[i : i + self.delete_batch]
            what = f"DeleteObjects s3://{self.bucket} ({len(batch)} keys from {batch[0]!r})"
            self._raise_delete_errors(await self._write(what, lambda t, f: _delete_once(t, batch, f, what)))

    def _raise_delete_errors(self, errs: list[DeleteError]) -> None:
        """The keys DeleteObjects refused (an already missing key is deleted), named."""
        errs = [e for e in errs if e.code != "NoSuchKey"]
        if errs:
            shown = "; ".join(f"{e.key!r}: {e.code} {e.message}".strip() for e in errs[:3])
            more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
            raise StorageError(f"deleting from s3://{self.bucket} at {self.endpoint()}: S3 did not delete "
                               f"{len(errs)} key{'s' if len(errs) > 1 else ''}: {shown}{more}")

    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        out: list[UploadInfo] = []
        markers: tuple[Optional[str], Optional[str]] = (None, None)
        while True:
            page = await self.pipeline.send(f"ListMultipartUploads s3://{self.bucket}/{prefix}",
                                            lambda t, f: t.list_uploads_page(prefix, *markers, self.page_size, f))
            out.extend(UploadInfo(u.key, u.upload_id, u.initiated) for u in page.uploads)
            if page.next_key_marker is None:
                return out
            markers = (page.next_key_marker, page.next_upload_id_marker)

    async def abort_upload(self, upload: UploadInfo) -> None:
        what = f"AbortMultipartUpload s3://{self.bucket}/{upload.key}"
        try:
            await self.pipeline.send(what, lambda t, f: t.abort_upload(upload.key, upload.upload_id, f))
        except Exception as e:
            if error_code(e) == "NoSuchUpload" or is_missing(e):
                return  # gone already: what an abort is for
            if callers_map(e):
                raise await self._refused_write(what, e, upload.upload_id) from None
            raise

    async def list(self, prefix: str) -> list[ObjectInfo]:  # last: "list" names this method below
        out: list[ObjectInfo] = []
        token: Optional[str] = None
        while True:
            page = await self.pipeline.send(f"ListObjectsV2 s3://{self.bucket}/{prefix}",
                                            lambda t, f: t.list_page(prefix, token, self.page_size, f))
            out.extend(ObjectInfo(o.key, o.size, o.etag, o.mtime) for o in page.objects)
            if page.next_token is None:
                return out
            token = page.next_token

    async def close(self) -> None:
        await self.pipeline.close()

    # -- descriptions --------------------------------------------------------------
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
