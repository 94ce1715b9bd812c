"""The ways to save and load a state dict that the save/load benchmark compares.

Every method has the same shape, so the driver treats them alike:

* ``setup(target)``: imports and clients, outside the timed region (a training job
  keeps its clients across saves); no I/O against the target;
* ``warmup(target)``: one cheap request with the method's own client, so the timed op
  sees a warm client, as a job's second and later checkpoints do;
* ``save(state, target)``; ``load(template, target)`` fills ``template`` in place
  (methods that return new tensors copy them in, as ``load_state_dict`` would);
  ``read_one(key, target, like)`` fetches one tensor, as little data as it can.

``info`` collects what a method reports about its own I/O. DCP's and s3fs's options
live here too (:func:`dcp`, :func:`s3fs_options`): the multi-rank, collective and async
benchmarks use the same ones.
"""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .harness import ACCESS_KEY, CRED_ENV, MiB, REGION, SECRET_KEY, boto3_client, s3_options


@dataclass
class Target:
    """Where a method writes: an S3 bucket/prefix, or a local directory."""

    endpoint_url: Optional[str]
    bucket: str
    prefix: str
    local_root: str = "/tmp/objckpt-bench"

    @property
    def s3_uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def local_dir(self) -> str:
        return os.path.join(self.local_root, self.prefix)


def dcp() -> Any:
    """``torch.distributed.checkpoint``, without its single-process warnings."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch.distributed.checkpoint as dcp_module

    return dcp_module


def s3fs_options(endpoint: Optional[str]) -> dict[str, Any]:
    """s3fs options as ``FsspecWriter``/``FsspecReader`` keyword arguments (passed to url_to_fs)."""
    return {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY,
            "client_kwargs": {"region_name": REGION}}


def fsspec_writer(uri: str, endpoint: Optional[str], thread_count: int = 1) -> Any:
    """``sync_files=False``: with fsspec streams DCP's fsync falls back to a machine-wide ``os.sync()``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(uri, sync_files=False, thread_count=thread_count, **s3fs_options(endpoint))


def fsspec_reader(uri: str, endpoint: Optional[str]) -> Any:
    """Pass it as ``storage_reader=`` only: with ``checkpoint_id=`` too, ``reset()`` re-creates the
    filesystem without these options."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(uri, **s3fs_options(endpoint))


def warm_s3fs(uri: str, endpoint: Optional[str], bucket: str) -> None:
    """Same options -> the same cached S3FileSystem the writer/reader will get, now connected."""
    from fsspec.core import url_to_fs

    fs, _ = url_to_fs(uri, **s3fs_options(endpoint))
    fs.exists(f"{bucket}/__warmup__/x")
    fs.invalidate_cache()


def copy_into(template: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``template[k].copy_(loaded[k])`` for every key (what ``load_state_dict`` does)."""
    missing = set(template) - set(loaded)
    if missing:
        raise KeyError(f"loaded state lacks {sorted(missing)[:5]} ({len(missing)} keys)")
    with torch.no_grad():
        for k, t in template.items():
            t.copy_(loaded[k])
    return template


class Method:
    """Base class: one way to save and load a state dict."""

    name = "?"
    remote = True  # writes to S3 (else to target.local_dir)

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def setup(self, target: Target) -> None:
        pass

    def warmup(self, target: Target) -> None:
        pass

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        raise NotImplementedError

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchSaveBoto3(Method):
    """torch.save into a BytesIO, boto3 multipart upload (16 MiB parts, 8 threads)."""

    name = "torchsave_boto3"

    def setup(self, target: Target) -> None:
        from boto3.s3.transfer import TransferConfig

        self.client = boto3_client(target.endpoint_url)  # type: ignore[arg-type]
        self.config = TransferConfig(multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, max_concurrency=8)

    def warmup(self, target: Target) -> None:
        self.client.head_bucket(Bucket=target.bucket)

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        self.info["object_bytes"] = buf.tell()
        buf.seek(0)
        self.client.upload_fileobj(buf, target.bucket, f"{target.prefix}/model.pt", Config=self.config)

    def _fetch(self, target: Target) -> dict[str, torch.Tensor]:
        buf = io.BytesIO()
        self.client.download_fileobj(target.bucket, f"{target.prefix}/model.pt", buf, Config=self.config)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        return copy_into(template, self._fetch(target))

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self._fetch(target)[key]  # the whole object: torch.save has no index to range-read


class TorchSaveS3tc(Method):
    """torch.save / torch.load through s3torchconnector's ``S3Checkpoint`` (AWS CRT client)."""

    name = "torchsave_s3tc"

    def setup(self, target: Target) -> None:
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        os.environ.update(CRED_ENV)
        self.ckpt = S3Checkpoint(REGION, endpoint=target.endpoint_url,
                                 s3client_config=S3ClientConfig(force_path_style=True, part_size=16 * MiB))

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        with self.ckpt.writer(f"{target.s3_uri}/model.pt") as w:
            torch.save(state, w)

    def _fetch(self, target: Target) -> dict[str, torch.Tensor]:
        with self.ckpt.reader(f"{target.s3_uri}/model.pt") as r:
            return torch.load(r, weights_only=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        return copy_into(template, self._fetch(target))

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self._fetch(target)[key]


class TorchSaveLocal(Method):
    """torch.save to a local file (fsync'd, like DCP's default); read_one via mmap."""

    name = "torchsave_local"
    remote = False

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        os.makedirs(target.local_dir, exist_ok=True)
        with open(os.path.join(target.local_dir, "model.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        return copy_into(template, torch.load(os.path.join(target.local_dir, "model.pt"), weights_only=True))

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        # mmap=True touches only the pages of the one tensor (plus the zip index).
        return torch.load(os.path.join(target.local_dir, "model.pt"), weights_only=True, mmap=True)[key].clone()


class DcpS3fs(Method):
    """torch.distributed.checkpoint with FsspecWriter/FsspecReader over s3fs, ``no_dist=True``."""

    name = "dcp_s3fs"
    thread_count = 1

    def setup(self, target: Target) -> None:
        self.dcp = dcp()

    def warmup(self, target: Target) -> None:
        warm_s3fs(target.s3_uri, target.endpoint_url, target.bucket)

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        writer = fsspec_writer(target.s3_uri, target.endpoint_url, self.thread_count)
        self.dcp.save(state, storage_writer=writer, no_dist=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        self.dcp.load(template, storage_reader=fsspec_reader(target.s3_uri, target.endpoint_url), no_dist=True)
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self.load({key: like}, target)[key]


class DcpS3fsT4(DcpS3fs):
    """As ``dcp_s3fs`` with ``thread_count=4`` for the writer."""

    name = "dcp_s3fs_t4"
    thread_count = 4


class DcpLocal(Method):
    """torch.distributed.checkpoint FileSystemWriter/Reader to a local directory (defaults)."""

    name = "dcp_local"
    remote = False

    def setup(self, target: Target) -> None:
        self.dcp = dcp()

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        self.dcp.save(state, storage_writer=self.dcp.FileSystemWriter(target.local_dir), no_dist=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        self.dcp.load(template, storage_reader=self.dcp.FileSystemReader(target.local_dir), no_dist=True)
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self.load({key: like}, target)[key]


class TensorStoreOcdbt(Method):
    """TensorStore zarr3 arrays (one per tensor, one chunk each, raw bytes codec) in one OCDBT
    database on TensorStore's s3 kvstore driver. The save is one transaction: one data file,
    one manifest commit (orbax-style). Credentials come from the environment."""

    name = "tensorstore_ocdbt"

    def setup(self, target: Target) -> None:
        for k, v in CRED_ENV.items():
            os.environ.setdefault(k, v)
        import tensorstore as ts

        self.ts = ts
        # Bounded retries: against an endpoint it cannot reach the default loop backs off for minutes.
        self.context = ts.Context({"s3_request_concurrency": {"limit": 32},
                                   "s3_request_retries": {"max_retries": 4, "initial_delay": "0.1s",
                                                          "max_delay": "2s"}})

    def _base(self, target: Target, path: str) -> dict[str, Any]:
        return {"driver": "s3", "bucket": target.bucket, "path": path, "aws_region": REGION,
                "endpoint": target.endpoint_url,  # path-style requests against this host
                "aws_credentials": {"type": "environment"}}

    def warmup(self, target: Target) -> None:
        self.ts.KvStore.open(self._base(target, "__warmup__/"), context=self.context).result().read("x").result()

    def _open_all(self, keys: list[str], target: Target, opts: Optional[dict[str, dict[str, Any]]] = None) -> list:
        kv = {"driver": "ocdbt", "base": self._base(target, target.prefix.rstrip("/") + "/")}
        futs = [self.ts.open({"driver": "zarr3", "kvstore": {**kv, "path": k + "/"}}, context=self.context,
                             **(opts or {}).get(k, {})) for k in keys]
        return [f.result() for f in futs]

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        ts, txn = self.ts, self.ts.Transaction()
        codec = ts.CodecSpec({"driver": "zarr3", "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]})
        arrays = {k: v.detach().cpu().contiguous().numpy() for k, v in state.items()}
        opts = {k: dict(create=True, transaction=txn, dtype=ts.dtype(str(a.dtype)), shape=list(a.shape),
                        chunk_layout=ts.ChunkLayout(chunk_shape=list(a.shape)), codec=codec)
                for k, a in arrays.items()}
        opened = self._open_all(list(arrays), target, opts)
        for w in [o.write(a) for o, a in zip(opened, arrays.values())]:
            w.result()
        txn.commit_async().result()

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        reads = [a.read() for a in self._open_all(list(template), target)]
        with torch.no_grad():
            for t, r in zip(template.values(), reads):
                t.copy_(torch.from_numpy(r.result()))
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._open_all([key], target)[0].read().result())


class Objckpt(Method):
    """objckpt.save / load / read (S3 via storage_options)."""

    name = "objckpt_s3"

    def uri(self, target: Target) -> str:
        return target.s3_uri

    def options(self, target: Target) -> Optional[dict[str, Any]]:
        return s3_options(target.endpoint_url)

    def setup(self, target: Target) -> None:
        import objckpt
        from objckpt.storage import open_store

        self.objckpt = objckpt
        open_store(self.uri(target), self.options(target))  # client creation, outside the timed region

    def warmup(self, target: Target) -> None:
        if self.remote:
            try:  # a manifest GET on a checkpoint that does not exist
                self.objckpt.inspect(self.uri(target) + "-warmup", storage_options=self.options(target))
            except Exception:  # noqa: BLE001 - NotFound expected
                pass

    def _record(self, result: Any) -> None:
        self.info.update({f"objckpt_{f}": getattr(result, f) for f in ("bytes", "seconds", "requests", "tensors",
                                                                       "blobs") if getattr(result, f, None) is not None})

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        self._record(self.objckpt.save(state, self.uri(target), storage_options=self.options(target)))

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        self._record(self.objckpt.load(template, self.uri(target), storage_options=self.options(target)))
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self.objckpt.read(self.uri(target), keys=[key], storage_options=self.options(target))[key]


class ObjckptNoPrefault(Objckpt):
    """objckpt_s3 with destination pre-faulting off (``objckpt.load.prefault.ENABLED``): what it buys."""

    name = "objckpt_s3_nopf"

    def setup(self, target: Target) -> None:
        super().setup(target)
        from objckpt.load import prefault

        prefault.ENABLED = False


class ObjckptPopulate(Objckpt):
    """objckpt_s3 with fresh destinations populated from other threads (``prefault.POPULATE``, off
    by default): the CPU and wall it costs or saves."""

    name = "objckpt_s3_populate"

    def setup(self, target: Target) -> None:
        super().setup(target)
        from objckpt.load import prefault

        prefault.POPULATE = True


class ObjckptSplice(Objckpt):
    """objckpt_s3 with request bodies spliced on plain TCP (``OBJCKPT_SPLICE_BODIES=1``, off by
    default): what splicing buys or costs."""

    name = "objckpt_s3_splice"

    def setup(self, target: Target) -> None:
        os.environ["OBJCKPT_SPLICE_BODIES"] = "1"  # this process only (each op runs in its own)
        super().setup(target)


class ObjckptHugePages(Objckpt):
    """objckpt_s3 with huge-page advice for fresh destinations forced on
    (``OBJCKPT_HUGE_PAGES=on``): on a guest that reports free pages to its host the
    default leaves it off; this shows what that choice costs or saves."""

    name = "objckpt_s3_huge"

    def setup(self, target: Target) -> None:
        os.environ["OBJCKPT_HUGE_PAGES"] = "on"  # this process only (each op runs in its own)
        super().setup(target)


class ObjckptBaseline(Objckpt):
    """objckpt_s3 with the objckpt of another commit: ``OBJCKPT_BASELINE`` names a directory
    holding its source (``bench_cold_warm --baseline REF`` exports one), put first on
    ``sys.path`` before objckpt is imported, so before/after run in the same benchmark run."""

    name = "objckpt_s3_base"

    def setup(self, target: Target) -> None:
        import sys

        root = os.environ.get("OBJCKPT_BASELINE")
        if not root:
            raise RuntimeError("OBJCKPT_BASELINE is not set (bench_cold_warm --baseline REF)")
        if "objckpt" in sys.modules:
            raise RuntimeError("objckpt was imported before the baseline could be put first on sys.path")
        sys.path.insert(0, root)
        super().setup(target)
        if not os.path.abspath(self.objckpt.__file__).startswith(os.path.abspath(root)):
            raise RuntimeError("the baseline objckpt was not the one imported")
        self.info["objckpt_ref"] = os.environ.get("OBJCKPT_BASELINE_REF")


class ObjckptLocal(Objckpt):
    """objckpt to a plain local directory."""

    name = "objckpt_local"
    remote = False

    def uri(self, target: Target) -> str:
        return target.local_dir

    def options(self, target: Target) -> Optional[dict[str, Any]]:
        return None


METHODS: dict[str, type[Method]] = {m.name: m for m in (
    TorchSaveBoto3, DcpS3fs, TensorStoreOcdbt, Objckpt, DcpLocal, TorchSaveLocal, ObjckptLocal, DcpS3fsT4,
    TorchSaveS3tc, ObjckptBaseline, ObjckptNoPrefault, ObjckptPopulate, ObjckptSplice, ObjckptHugePages)}
#: run when ``--methods`` is not given (``dcp_s3fs_t4`` and ``torchsave_s3tc`` are opt-in)
DEFAULT_METHODS = ["torchsave_boto3", "dcp_s3fs", "tensorstore_ocdbt", "objckpt_s3", "dcp_local", "torchsave_local",
                   "objckpt_local"]
