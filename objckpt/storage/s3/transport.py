"""How an S3 store's bytes move: objckpt's own sockets, or botocore's client.

Which transport serves a store is chosen once, in its :class:`~.config.S3Config`
(``transport``: direct unless a proxy, ``direct_http=False`` or an endpoint
that needs another signing says otherwise), never per call.  Both offer the
same operations, each **one attempt** with the first-answer bound it is given;
everything around an attempt (limiter, retry budgets, continuation of a broken
ranged GET from the first missing byte, region redirects, error wording) is
:func:`.send.Pipeline.send`, the one loop both go through.  They raise the
same kinds of errors: an S3 refusal carries a botocore-shaped ``response``
(:class:`~.direct.S3HttpError` or botocore's ``ClientError``), an answer
that is not S3's is :class:`~objckpt.errors.NotS3EndpointError`.

* :class:`DirectTransport`: :class:`~.direct.DirectClient`'s blocking
  exchanges on pool threads (bodies land in and leave from tensor memory).
  A refusal that says the bucket is in another region is raised as
  :class:`~.answers.WrongRegion`; the pipeline follows it by
  :meth:`DirectTransport.retarget`.
* :class:`BotocoreTransport`: one aiobotocore client (one attempt per call:
  botocore's retries are off), for proxies and ``direct_http=False``.  botocore
  follows region redirects itself.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, TypeVar, cast

from ...runtime import loop as _runtime
from ...logs import get_logger
from . import direct, refusals
from .retry import is_missing, is_no_bucket
from .answers import botocore_answer, botocore_not_s3, not_s3_error
from .config import S3Config, Target, Transport
from .http_answer import Head, check_range
from .request import DeleteError, Listed, ListPage, Stored, Upload, UploadsPage
from .credentials import CredentialSource
from .wire import Sink

if TYPE_CHECKING:
    from .direct import DirectClient

log = get_logger("objckpt.storage")
T = TypeVar("T")


class S3Transport(Protocol):
    """One attempt of each S3 operation a store makes (``first``: the bound on the
    first byte of the answer, see :meth:`.send.Pipeline.send`)."""

    names_type: bool  #: errors' type names go before their text (the own path's do not say where they come from)

    async def get(self, key: str, first: float) -> bytes: ...
    async def read_range(self, key: str, start: int, sink: Sink, first: float) -> None: ...
    async def head(self, key: str, first: float) -> Optional[tuple[int, Optional[str]]]: ...
    async def stored(self, key: str, first: float, checksum: bool = True) -> Optional[Stored]: ...
    async def bucket_exists(self, first: float) -> bool: ...
    async def server_header(self, first: float) -> Optional[str]: ...
    async def put(self, key: str, views: Sequence[memoryview], headers: dict[str, str],
                  query: Optional[dict[str, str]], first: float) -> dict[str, str]: ...
    async def create_upload(self, key: str, headers: dict[str, str], first: float) -> str: ...
    async def complete_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                              first: float) -> dict[str, str]: ...
    async def list_page(self, prefix: str, token: Optional[str], max_keys: int, first: float) -> ListPage: ...
    async def list_uploads_page(self, prefix: str, key_marker: Optional[str], upload_id_marker: Optional[str],
                                max_uploads: int, first: float) -> UploadsPage: ...
    async def delete_objects(self, keys: Sequence[str], first: float) -> list[DeleteError]: ...
    async def abort_upload(self, key: str, upload_id: str, first: float) -> None: ...
    def forget(self) -> None: ...
    async def close(self) -> None: ...


async def open_transport(config: S3Config, endpoint: str) -> S3Transport:
    """The transport ``config`` chose for its bucket (``endpoint``: the store's, for
    the region a redirect taught this process)."""
    if config.transport is Transport.DIRECT:
        return await DirectTransport.open(config, endpoint)
    return await BotocoreTransport.open(config)


# -- the own path --------------------------------------------------------------------

#: (endpoint, bucket) -> the region S3 said the bucket is in, for stores made later in this process
_regions: dict[tuple[str, str], str] = {}
_regions_lock = threading.Lock()
_AWS_HOST = re.compile(r"(^|\.)s3([.-][a-z0-9-]+)?\.amazonaws\.com$")


def known_region(endpoint: str, bucket: str) -> Optional[str]:
    """The region a redirect taught this process for ``bucket`` at ``endpoint`` (None: none did)."""
    with _regions_lock:
        return _regions.get((endpoint, bucket))


def _after_fork() -> None:
    """A forked child keeps what was learned, with a lock no parent thread can be holding."""
    global _regions_lock
    _regions_lock = threading.Lock()


_runtime.on_reset(_after_fork)


def retargeted(target: Target, region: str) -> Target:
    """``target`` for a bucket in ``region``: signed for it, and on AWS sent to its
    regional host (``s3.<region>.amazonaws.com``, the bucket's virtual host under
    it), as botocore's endpoint rules resolve it; a custom endpoint keeps its host."""
    m = _AWS_HOST.search(target.host)
    if m is None:
        return dataclasses.replace(target, region=region)
    host = target.host[: m.start()] + f"{m.group(1)}s3.{region}.amazonaws.com"
    header = host if target.port == (443 if target.scheme == "https" else 80) else f"{host}:{target.port}"
    return dataclasses.replace(target, host=host, host_header=header, region=region)


class DirectTransport:
    """objckpt's own HTTP path (see the module docstring)."""

    names_type = True

    def __init__(self, client: "DirectClient", endpoint: str) -> None:
        self.client = client
        self._endpoint = endpoint  # the store's, the key of the region memory

    @classmethod
    async def open(cls, config: S3Config, endpoint: str) -> "DirectTransport":
        target = config.target
        # botocore's provider chain may do network calls (roles, IMDS): off the loop
        creds = cast(CredentialSource, await _runtime.in_thread(config.credentials))  # raises when there are none
        region = known_region(endpoint, config.bucket)
        if region is not None and region != target.region:  # learned from a redirect earlier in this process
            target = retargeted(target, region)
        p = config.policy
        sends = config.request_settings
        client = direct.DirectClient(config.bucket, target, creds, connect_timeout=p.connect_timeout,
                                        read_timeout=p.read_timeout, deadline_floor=p.deadline_floor,
                                        min_rate=p.min_rate, extra_headers=config.extra_headers,
                                        user_agent=sends.user_agent(), keepalive=bool(sends.tcp_keepalive.value),
                                        splice=bool(sends.splice_bodies.value))
        return cls(client, endpoint)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(direct.pool(), fn, *args)

    # -- where requests go ---------------------------------------------------------
    @property
    def region(self) -> str:
        """The region requests are signed for now."""
        return self.client.target.region

    def retarget(self, region: str) -> None:
        """Sign for ``region`` (and on AWS send to its host) from now on; remembered for
        later stores of the bucket in this process."""
        self.client.retarget(retargeted(self.client.target, region))
        with _regions_lock:
            _regions[(self._endpoint, self.client.bucket)] = region

    async def bucket_region(self, first: float) -> Optional[str]:
        return await self._run(self.client.bucket_region, first)

    # -- the operations ------------------------------------------------------------
    async def get(self, key: str, first: float) -> bytes:
        return await self._run(self.client.get, key, first)

    async def read_range(self, key: str, start: int, sink: Sink, first: float) -> None:
        await self._run(self.client.read_range, key, start, sink, first)

    async def head(self, key: str, first: float) -> Optional[tuple[int, Optional[str]]]:
        return await self._run(self.client.head, key, first)

    async def stored(self, key: str, first: float, checksum: bool = True) -> Optional[Stored]:
        return await self._run(self.client.stored, key, first, checksum)

    async def bucket_exists(self, first: float) -> bool:
        return await self._run(self.client.bucket_exists, first)

    async def server_header(self, first: float) -> Optional[str]:
        return await self._run(self.client.server_header, first)

    async def put(self, key: str, views: Sequence[memoryview], headers: dict[str, str],
                  query: Optional[dict[str, str]], first: float) -> dict[str, str]:
        return await self._run(self.client.put, key, views, headers, first, query)

    async def create_upload(self, key: str, headers: dict[str, str], first: float) -> str:
        return await self._run(self.client.create_upload, key, headers, first)

    async def complete_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                              first: float) -> dict[str, str]:
        return await self._run(self.client.complete_upload, key, upload_id, parts, first)

    async def list_page(self, prefix: str, token: Optional[str], max_keys: int, first: float) -> ListPage:
        return await self._run(self.client.list_page, prefix, token, max_keys, first)

    async def list_uploads_page(self, prefix: str, key_marker: Optional[str], upload_id_marker: Optional[str],
                                max_uploads: int, first: float) -> UploadsPage:
        return await self._run(self.client.list_uploads_page, prefix, key_marker, upload_id_marker, max_uploads,
                               first)

    async def delete_objects(self, keys: Sequence[str], first: float) -> list[DeleteError]:
        return await self._run(self.client.delete_objects, keys, first)

    async def abort_upload(self, key: str, upload_id: str, first: float) -> None:
        await self._run(self.client.abort_upload, key, upload_id, first)

    def forget(self) -> None:
        self.client.forget()

    async def close(self) -> None:
        self.client.close()


# -- botocore ---------------------------------------------------------------------------

def _keepalive_connector() -> dict[str, Any]:
    """``AioConfig`` arguments that put ``SO_KEEPALIVE`` on the client's sockets (botocore's
    ``tcp_keepalive``, which aiobotocore does not apply): aiohttp's ``socket_factory``, where
    this aiohttp has one (3.12+); else none, said once per store at INFO."""
    import inspect

    import aiohttp
    from aiobotocore.config import AioConfig

    from .request_settings import keepalive_socket

    args = {"connector_args": {"socket_factory": keepalive_socket}}
    if "socket_factory" in inspect.signature(aiohttp.TCPConnector.__init__).parameters:
        try:
            AioConfig(**args)  # an aiobotocore that does not know the argument refuses it
            return args
        except Exception:  # noqa: BLE001 - botocore's ParamValidationError
            pass
    log.info("tcp_keepalive is on, but this aiohttp %s / aiobotocore cannot set socket options (socket_factory): "
             "the botocore transport's connections go without SO_KEEPALIVE", aiohttp.__version__)
    return {}


class BotocoreTransport:
    """Every request through one aiobotocore client (see the module docstring)."""

    names_type = False

    def __init__(self, client: Any, cm: Any, config: S3Config) -> None:
        self.client = client
        self._cm = cm
        self.config = config
        self.read_timeout = config.policy.read_timeout

    @classmethod
    async def open(cls, config: S3Config) -> "BotocoreTransport":
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        kwargs, extra = config.client_args()  # the same resolution the own path uses
        cfg: dict[str, Any] = dict(
            retries={"total_max_attempts": 1, "mode": "standard"},  # the pipeline retries
            max_pool_connections=max(config.concurrency * 2, 16),
            connect_timeout=config.policy.connect_timeout,
            read_timeout=config.policy.read_timeout,
            parameter_validation=False,
            **extra,
        )
        if config.request_settings.tcp_keepalive.value:  # aiobotocore drops botocore's socket options: ours
            cfg.update(_keepalive_connector())
        try:
            aio = AioConfig(**cfg, request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
        except TypeError:  # older botocore without flexible checksums
            aio = AioConfig(**cfg)
        session = get_session()
        if config.profile:  # the credential chain of the same profile (region, endpoint... are explicit)
            session.set_config_variable("profile", config.profile)
        cm = session.create_client("s3", config=aio, **kwargs)
        client = await cm.__aenter__()
        if config.request_payer or config.sse_kms_key_id:
            headers_for = config.extra_headers

            def add_headers(request: Any, operation_name: str = "", **_: Any) -> None:
                for k, v in headers_for(operation_name).items():  # before signing: they are signed too
                    request.headers[k] = v

            client.meta.events.register("before-sign.s3", add_headers)
        return cls(client, cm, config)

    async def _call(self, op: str, first: float, **kw: Any) -> Any:
        """One botocore call; until the endpoint has answered, bounded by ``first``
        (botocore's own ``read_timeout`` bounds it after).  An answer that is not
        S3's raises :class:`NotS3EndpointError`."""
        fn = getattr(self.client, op)
        kw = {"Bucket": self.config.bucket, **kw}
        try:
            call = fn(**kw)
            r = await (asyncio.wait_for(call, first) if first < self.read_timeout else call)
        except Exception as e:
            self._raise_if_not_s3(op, kw, e)
            raise
        self._raise_if_not_s3(op, kw, r)
        return r

    def _raise_if_not_s3(self, op: str, kw: dict[str, Any], answer: Any) -> None:
        reason = botocore_not_s3(answer, head=op.startswith("head_"),
                                 object_answer=op in ("head_object", "get_object") and "Range" not in kw)
        if reason is not None:
            status, headers = botocore_answer(answer)
            where = f"{op} s3://{self.config.bucket}/{kw.get('Key', '')}"
            raise not_s3_error(self.config.endpoint(), where, status, headers, reason) from None

    async def get(self, key: str, first: float) -> bytes:
        r = await self._call("get_object", first, Key=key)
        async with r["Body"] as body:
            return bytes(await body.read())

    async def read_range(self, key: str, start: int, sink: Sink, first: float) -> None:
        lo, hi = start + sink.got, start + sink.total - 1
        r = await self._call("get_object", first, Key=key, Range=f"bytes={lo}-{hi}")
        skip = 0
        status, headers = botocore_answer(r)
        if status == 206:  # judged as the own path judges it; a widened range gives the asked bytes out of it
            what = f"GET s3://{self.config.bucket}/{key} bytes {lo}-{hi} from {self.config.target.host_header}"
            skip = check_range(Head(status, headers), lo, hi, what).before
        async with r["Body"] as body:
            stream = body._raw_stream.content if hasattr(body, "_raw_stream") else None
            while sink.got < sink.total:
                chunk = await (stream.readany() if stream is not None else body.read(1 << 20))
                if not chunk:
                    break
                view = memoryview(chunk)[skip:]
                skip -= len(chunk) - len(view)
                sink.write(view)

    async def head(self, key: str, first: float) -> Optional[tuple[int, Optional[str]]]:
        try:
            r = await self._call("head_object", first, Key=key)
        except Exception as e:
            if is_missing(e):
                return None
            await self._why_refused(key, e, first)
            raise
        return int(r["ContentLength"]), r.get("ETag")

    async def _why_refused(self, key: str, e: BaseException, first: float) -> None:
        """After a bare 400/403 to a HEAD of ``key`` (botocore's redirector found no other
        region): a one-byte GET of it, whose refusal carries S3's reason; raised in the
        HEAD's place when it names one (see :mod:`.refusals`), else the HEAD's stands."""
        if not refusals.is_bare(e):
            return
        try:
            r = await self._call("get_object", first, Key=key, Range="bytes=0-0")
        except Exception as why:
            if refusals.says_why(why):
                raise refusals.mark_explains_head(why) from None
            return
        async with r["Body"]:
            pass

    async def stored(self, key: str, first: float, checksum: bool = True) -> Optional[Stored]:
        try:
            r = await self._call("head_object", first, Key=key, **({"ChecksumMode": "ENABLED"} if checksum else {}))
        except Exception as e:
            if is_missing(e):
                return None
            await self._why_refused(key, e, first)
            raise
        return Stored(int(r["ContentLength"]), r.get("ETag"), r.get("ChecksumCRC32C"))

    async def bucket_exists(self, first: float) -> bool:
        try:
            await self._call("head_bucket", first)
        except Exception as e:
            if is_missing(e) or is_no_bucket(e):
                return False
            raise
        return True

    async def server_header(self, first: float) -> Optional[str]:
        try:
            r = await asyncio.wait_for(self.client.head_bucket(Bucket=self.config.bucket), first)
        except Exception as e:  # an HTTP error still names its server
            r = getattr(e, "response", None)
            if not isinstance(r, dict):
                raise
        headers = r.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        return headers.get("server") if isinstance(headers, dict) else None

    async def put(self, key: str, views: Sequence[memoryview], headers: dict[str, str],
                  query: Optional[dict[str, str]], first: float) -> dict[str, str]:
        from . import http_body  # aiohttp: imported only by a process that writes

        kw: dict[str, Any] = {"Key": key, "Body": http_body.body(views)}  # a fresh body per attempt
        if "x-amz-checksum-crc32c" in headers:
            kw["ChecksumCRC32C"] = headers["x-amz-checksum-crc32c"]
        if "if-none-match" in headers:
            kw["IfNoneMatch"] = headers["if-none-match"]
        if query is not None:
            kw.update(PartNumber=int(query["partNumber"]), UploadId=query["uploadId"])
        r = await self._call("put_object" if query is None else "upload_part", first, **kw)
        out = {"ETag": str(r.get("ETag", ""))}
        if r.get("ChecksumCRC32C"):
            out["ChecksumCRC32C"] = str(r["ChecksumCRC32C"])
        return out

    async def create_upload(self, key: str, headers: dict[str, str], first: float) -> str:
        extra = {"ChecksumAlgorithm": "CRC32C"} if "x-amz-checksum-algorithm" in headers else {}
        r = await self._call("create_multipart_upload", first, Key=key, **extra)
        return str(r["UploadId"])

    async def complete_upload(self, key: str, upload_id: str, parts: list[dict[str, Any]],
                              first: float) -> dict[str, str]:
        r = await self._call("complete_multipart_upload", first, Key=key, UploadId=upload_id,
                             MultipartUpload={"Parts": parts})
        return {"ChecksumCRC32C": str(r["ChecksumCRC32C"])} if r.get("ChecksumCRC32C") else {}

    async def list_page(self, prefix: str, token: Optional[str], max_keys: int, first: float) -> ListPage:
        kw: dict[str, Any] = {"Prefix": prefix, "MaxKeys": max_keys}
        if token:
            kw["ContinuationToken"] = token
        r = await self._call("list_objects_v2", first, **kw)
        out = [Listed(o["Key"], int(o["Size"]), o.get("ETag"),
                      o["LastModified"].timestamp() if o.get("LastModified") else None)
               for o in r.get("Contents", [])]
        return ListPage(out, r.get("NextContinuationToken") if r.get("IsTruncated") else None)

    async def list_uploads_page(self, prefix: str, key_marker: Optional[str], upload_id_marker: Optional[str],
                                max_uploads: int, first: float) -> UploadsPage:
        kw: dict[str, Any] = {"Prefix": prefix, "MaxUploads": max_uploads}
        if key_marker:
            kw.update(KeyMarker=key_marker, UploadIdMarker=upload_id_marker or "")
        r = await self._call("list_multipart_uploads", first, **kw)
        ups = [Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp() if u.get("Initiated") else None)
               for u in r.get("Uploads", [])]
        if not r.get("IsTruncated"):
            return UploadsPage(ups)
        return UploadsPage(ups, r.get("NextKeyMarker"), r.get("NextUploadIdMarker"))

    async def delete_objects(self, keys: Sequence[str], first: float) -> list[DeleteError]:
        r = await self._call("delete_objects", first, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        return [DeleteError(e.get("Key", ""), e.get("Code", ""), e.get("Message", "")) for e in r.get("Errors", [])]

    async def abort_upload(self, key: str, upload_id: str, first: float) -> None:
        await self._call("abort_multipart_upload", first, Key=key, UploadId=upload_id)

    def forget(self) -> None:
        """After fork: the client belongs to the parent's event loop; drop it unclosed."""
        self.client = self._cm = None

    async def close(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            await cm.__aexit__(None, None, None)
