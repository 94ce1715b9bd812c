"""Checkpoint save/load methods compared by the benchmark harness.

Every method has the same shape:

* ``setup(target)``: imports and client creation, done outside the timed region
  (a training job keeps its clients across saves); no I/O against the target.
* ``save(state, target)``: write the whole state dict.
* ``load(template, target)``: fill ``template``'s tensors in place (methods
  that can only return new tensors copy them in, as ``load_state_dict`` would)
  and return it.
* ``read_one(key, target, like)``: fetch one tensor, as little data as the
  method allows; ``like`` is an empty tensor of the right shape and dtype for
  methods that need a template (DCP).

``info`` collects whatever a method reports about its own I/O (requests,
bytes); :mod:`benchmarks.run_one` adds it to its JSON line.
"""
from __future__ import annotations

import io
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

MiB = 1 << 20
REGION = "us-east-1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"


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

    def storage_options(self) -> dict[str, Any]:
        """objckpt-style storage options for the S3 target."""
        return {
            "endpoint_url": self.endpoint_url,
            "region_name": REGION,
            "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY,
        }

    def boto3_client(self, max_pool_connections: int = 16) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            config=Config(max_pool_connections=max_pool_connections),
            **self.storage_options(),
        )


class Method:
    """Base class: one way to save and load a state dict."""

    name: str = "?"
    remote: bool = True  # writes to S3 (else to target.local_dir)

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def setup(self, target: Target) -> None:
        """Imports and clients; no I/O against the target."""

    def warmup(self, target: Target) -> None:
        """One cheap request with the method's client (connection pool, lazily
        loaded service models), so the timed op measures a warm client as in a
        training job's second and later checkpoints.  Default: nothing."""

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        raise NotImplementedError

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _copy_into(template: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``template[k].copy_(loaded[k])`` for every key (what ``load_state_dict`` does)."""
    missing = set(template) - set(loaded)
    if missing:
        raise KeyError(f"loaded state lacks {sorted(missing)[:5]} ({len(missing)} keys)")
    with torch.no_grad():
        for k, t in template.items():
            t.copy_(loaded[k])
    return template


# --------------------------------------------------------------------------- torch.save


class TorchSaveBoto3(Method):
    """torch.save into a BytesIO, boto3 multipart upload (16 MiB parts, 8 threads)."""

    name = "torchsave_boto3"

    def setup(self, target: Target) -> None:
        from boto3.s3.transfer import TransferConfig

        self.client = target.boto3_client()
        self.config = TransferConfig(
            multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, max_concurrency=8
        )

    def warmup(self, target: Target) -> None:
        self.client.head_bucket(Bucket=target.bucket)

    def _key(self, target: Target) -> str:
        return f"{target.prefix}/model.pt"

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        self.info["object_bytes"] = buf.tell()
        buf.seek(0)
        self.client.upload_fileobj(buf, target.bucket, self._key(target), Config=self.config)

    def _fetch(self, target: Target) -> dict[str, torch.Tensor]:
        buf = io.BytesIO()
        self.client.download_fileobj(target.bucket, self._key(target), buf, Config=self.config)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        return _copy_into(template, self._fetch(target))

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self._fetch(target)[key]  # the whole object: torch.save has no index to range-read


class TorchSaveLocal(Method):
    """torch.save to a local file (fsync'd, like DCP's default); read_one via mmap."""

    name = "torchsave_local"
    remote = False

    def _path(self, target: Target) -> str:
        return os.path.join(target.local_dir, "model.pt")

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        os.makedirs(target.local_dir, exist_ok=True)
        with open(self._path(target), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        return _copy_into(template, torch.load(self._path(target), weights_only=True))

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        # mmap=True touches only the pages of the one tensor (plus the zip index).
        sd = torch.load(self._path(target), weights_only=True, mmap=True)
        return sd[key].clone()


# --------------------------------------------------------------------------- DCP


def _dcp() -> Any:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    import torch.distributed.checkpoint as dcp

    return dcp


class DcpS3fs(Method):
    """torch.distributed.checkpoint with FsspecWriter/FsspecReader over s3fs.

    Single process, ``no_dist=True``.  ``sync_files=False``: with fsspec
    streams DCP's fsync falls back to a machine-wide ``os.sync()``.
    """

    name = "dcp_s3fs"
    thread_count = 1

    def setup(self, target: Target) -> None:
        self.dcp = _dcp()
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        self.writer_cls, self.reader_cls = FsspecWriter, FsspecReader
        # Passed through url_to_fs to s3fs.S3FileSystem.
        self.fs_options = {
            "endpoint_url": target.endpoint_url,
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"region_name": REGION},
        }

    def warmup(self, target: Target) -> None:
        from fsspec.core import url_to_fs

        # Same options -> the same cached S3FileSystem instance the writer/reader will get.
        fs, _ = url_to_fs(target.s3_uri, **self.fs_options)
        fs.exists(f"{target.bucket}/__warmup__/x")
        fs.invalidate_cache()

    def _reader(self, target: Target) -> Any:
        # Never pass checkpoint_id to dcp.load as well: reset(checkpoint_id)
        # re-creates the filesystem *without* these options.
        return self.reader_cls(target.s3_uri, **self.fs_options)

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        writer = self.writer_cls(
            target.s3_uri, sync_files=False, thread_count=self.thread_count, **self.fs_options
        )
        self.dcp.save(state, storage_writer=writer, no_dist=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        self.dcp.load(template, storage_reader=self._reader(target), no_dist=True)
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        sd = {key: like}
        self.dcp.load(sd, storage_reader=self._reader(target), no_dist=True)
        return sd[key]


class DcpS3fsT4(DcpS3fs):
    """As ``dcp_s3fs`` with ``thread_count=4`` for the writer."""

    name = "dcp_s3fs_t4"
    thread_count = 4


class DcpLocal(Method):
    """torch.distributed.checkpoint FileSystemWriter/Reader to a local directory (defaults)."""

    name = "dcp_local"
    remote = False

    def setup(self, target: Target) -> None:
        self.dcp = _dcp()

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        writer = self.dcp.FileSystemWriter(target.local_dir)
        self.dcp.save(state, storage_writer=writer, no_dist=True)

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        self.dcp.load(template, storage_reader=self.dcp.FileSystemReader(target.local_dir), no_dist=True)
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        sd = {key: like}
        self.dcp.load(sd, storage_reader=self.dcp.FileSystemReader(target.local_dir), no_dist=True)
        return sd[key]


# --------------------------------------------------------------------------- TensorStore


class TensorStoreOcdbt(Method):
    """TensorStore zarr3 arrays (one per tensor, one chunk each, raw bytes codec)
    in one OCDBT database on TensorStore's s3 kvstore driver.

    The save is one transaction, so OCDBT writes one data file and one
    manifest commit (orbax-style).  Credentials come from the environment.
    """

    name = "tensorstore_ocdbt"
    concurrency = 32

    def setup(self, target: Target) -> None:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        os.environ.setdefault("AWS_REGION", REGION)
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        import numpy as np
        import tensorstore as ts

        self.ts, self.np = ts, np
        # Bounded retries: against an endpoint it cannot reach, the default retry loop
        # backs off for minutes before an op fails.
        self.context = ts.Context({
            "s3_request_concurrency": {"limit": self.concurrency},
            "s3_request_retries": {"max_retries": 4, "initial_delay": "0.1s", "max_delay": "2s"},
        })

    def _kvstore(self, target: Target) -> dict[str, Any]:
        return {
            "driver": "ocdbt",
            "base": {
                "driver": "s3",
                "bucket": target.bucket,
                "path": target.prefix.rstrip("/") + "/",
                "endpoint": target.endpoint_url,  # path-style requests against this host
                "aws_region": REGION,
                "aws_credentials": {"type": "environment"},
            },
        }

    def warmup(self, target: Target) -> None:
        base = dict(self._kvstore(target)["base"], path="__warmup__/")
        kv = self.ts.KvStore.open(base, context=self.context).result()
        kv.read("x").result()

    def _spec(self, key: str, target: Target) -> dict[str, Any]:
        return {"driver": "zarr3", "kvstore": {**self._kvstore(target), "path": key + "/"}}

    def _open_all(self, keys: list[str], target: Target, opts: Optional[dict[str, dict[str, Any]]] = None) -> list[Any]:
        opts = opts or {}
        futs = [self.ts.open(self._spec(k, target), context=self.context, **opts.get(k, {})) for k in keys]
        return [f.result() for f in futs]

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        ts = self.ts
        txn = ts.Transaction()
        keys = list(state)
        opts: dict[str, Any] = {}
        for k in keys:
            shape = list(state[k].shape)
            opts[k] = dict(
                create=True,
                transaction=txn,
                dtype=ts.dtype(str(state[k].detach().cpu().numpy().dtype)),
                shape=shape,
                chunk_layout=ts.ChunkLayout(chunk_shape=shape),
                codec=ts.CodecSpec({"driver": "zarr3", "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}),
            )
        arrays = self._open_all(keys, target, opts)
        writes = [a.write(state[k].detach().cpu().contiguous().numpy()) for k, a in zip(keys, arrays)]
        for w in writes:
            w.result()
        txn.commit_async().result()

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        keys = list(template)
        arrays = self._open_all(keys, target)
        reads = [a.read() for a in arrays]
        with torch.no_grad():
            for k, r in zip(keys, reads):
                template[k].copy_(torch.from_numpy(r.result()))
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        (arr,) = self._open_all([key], target)
        return torch.from_numpy(arr.read().result())


# --------------------------------------------------------------------------- objckpt


class Objckpt(Method):
    """objckpt.save / load / read (S3 via storage_options)."""

    name = "objckpt_s3"

    def _uri(self, target: Target) -> str:
        return target.s3_uri

    def _options(self, target: Target) -> Optional[dict[str, Any]]:
        return target.storage_options()

    def setup(self, target: Target) -> None:
        import objckpt

        self.objckpt = objckpt
        try:  # warm objckpt's store cache (client creation) outside the timed region
            from objckpt.storage import open_store

            open_store(self._uri(target), self._options(target))
        except Exception:  # noqa: BLE001 - an internal API; the benchmark works without it
            pass

    def warmup(self, target: Target) -> None:
        if self.remote:
            try:  # a manifest GET on a checkpoint that does not exist
                self.objckpt.inspect(self._uri(target) + "-warmup", storage_options=self._options(target))
            except Exception:  # noqa: BLE001 - NotFound expected
                pass

    def _record(self, result: Any) -> None:
        for f in ("bytes", "seconds", "requests", "tensors", "blobs"):
            v = getattr(result, f, None)
            if v is not None:
                self.info[f"objckpt_{f}"] = v

    def save(self, state: dict[str, torch.Tensor], target: Target) -> None:
        self._record(self.objckpt.save(state, self._uri(target), storage_options=self._options(target)))

    def load(self, template: dict[str, torch.Tensor], target: Target) -> dict[str, torch.Tensor]:
        self._record(self.objckpt.load(template, self._uri(target), storage_options=self._options(target)))
        return template

    def read_one(self, key: str, target: Target, like: torch.Tensor) -> torch.Tensor:
        return self.objckpt.read(self._uri(target), keys=[key], storage_options=self._options(target))[key]


class ObjckptLocal(Objckpt):
    """objckpt to a plain local directory."""

    name = "objckpt_local"
    remote = False

    def _uri(self, target: Target) -> str:
        return target.local_dir

    def _options(self, target: Target) -> Optional[dict[str, Any]]:
        return None


# --------------------------------------------------------------------------- registry

METHODS: dict[str, Callable[[], Method]] = {
    m.name: m
    for m in (
        TorchSaveBoto3,
        DcpS3fs,
        TensorStoreOcdbt,
        Objckpt,
        DcpLocal,
        TorchSaveLocal,
        ObjckptLocal,
        DcpS3fsT4,
    )
}

#: Methods run when ``--methods`` is not given (``dcp_s3fs_t4`` is opt-in).
DEFAULT_METHODS = [
    "torchsave_boto3",
    "dcp_s3fs",
    "tensorstore_ocdbt",
    "objckpt_s3",
    "dcp_local",
    "torchsave_local",
    "objckpt_local",
]


def make_method(name: str) -> Method:
    """A fresh instance of the named method."""
    try:
        return METHODS[name]()
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}") from None


def remove_local(target: Target) -> None:
    """Delete a local method's directory."""
    shutil.rmtree(target.local_dir, ignore_errors=True)
