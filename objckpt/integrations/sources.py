"""Checkpoints of other formats, read one tensor at a time: DCP directories, torch.save
files, safetensors files and directories.

Each source tells up front which tensors it holds (key, dtype, shape) and the
encoded tree around them, then produces one tensor per ``load(key)`` and forgets
it on ``release(key)``; :func:`objckpt.integrations.stream_write.write_checkpoint`
asks for them in order.  How each keeps memory at about one tensor:

* **DCP** (local directory, or any fsspec URL): DCP's ``FileSystemReader`` /
  ``FsspecReader`` reads the ``.metadata`` (unpickling it, as DCP itself does) and
  the non-tensor values; each tensor's saved chunks are then read one range of a
  file at a time, loaded with ``weights_only=True`` and copied into one buffer
  (going through DCP's ``read_data`` for every tensor grew resident memory by
  about a tensor per tensor, measured on torch 2.13).
* **torch.save** (zip format): ``torch.load(mmap=True, weights_only=True)`` maps the
  file instead of reading it; once a tensor is copied out, its pages are dropped
  from the process (``madvise(MADV_DONTNEED)`` on the file-backed mapping; they
  are re-read from the file if touched again), so resident memory does not grow
  to the file's size.
* **safetensors**: one seek + ``readinto`` per tensor (:mod:`.safetensors_io`).
"""
from __future__ import annotations

import ctypes
import io
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import NotFoundError, UnsupportedFormatError, UnsupportedValueError
from ..format.tree import encode_tree
from .dcp_tree import META_KEY, TensorRef, plain_value, tree_from_flat
from .safetensors_io import SafetensorsFile
from .stream_write import SourceTensor


@dataclass
class Source:
    """What a converter writes: tensors in order, the tree around them, manifest metadata."""

    tensors: list[SourceTensor]
    tree: Any
    metadata: dict[str, Any] = field(default_factory=dict)

    def load(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def release(self, key: str) -> None:
        """Forget tensor ``key`` (default: nothing held)."""


def fsspec_options(url: str, opts: Optional[dict[str, Any]]) -> dict[str, Any]:
    """objckpt's S3 ``storage_options`` as s3fs keyword arguments (other schemes: as given)."""
    opts = dict(opts or {})
    if not url.startswith(("s3://", "s3a://")):
        return opts
    out: dict[str, Any] = {}
    client: dict[str, Any] = {}
    for ours, theirs in (("aws_access_key_id", "key"), ("aws_secret_access_key", "secret"),
                         ("aws_session_token", "token"), ("profile", "profile")):
        if ours in opts:
            out[theirs] = opts[ours]
    for k in ("endpoint_url", "region_name"):
        if k in opts:
            client[k] = opts[k]
    if client:
        out["client_kwargs"] = client
    return out


# -- DCP ---------------------------------------------------------------------------------
def _dcp_planner(out: Optional[torch.Tensor], raw: dict[str, bytes]) -> Any:
    from torch.distributed.checkpoint.planner import LoadPlanner

    class _Into(LoadPlanner):
        """Just enough of a LoadPlanner for ``StorageReader.read_data``: narrow views of
        ``out`` for tensor items, captured bytes for the others."""

        def set_up_planner(self, *a: Any, **k: Any) -> None: ...
        def create_local_plan(self) -> Any: ...
        def create_global_plan(self, plans: Any) -> Any: ...
        def finish_plan(self, plan: Any) -> Any: ...

        def load_bytes(self, item: Any, value: io.BytesIO) -> None:
            raw[item.storage_index.fqn] = value.read()

        def resolve_tensor(self, item: Any) -> torch.Tensor:
            assert out is not None
            t = out
            for d, (o, n) in enumerate(zip(item.dest_offsets, item.lengths)):
                t = t.narrow(d, o, n)
            return t

        def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None: ...

    return _Into()


class DcpSource(Source):
    """A DCP checkpoint directory (local path or fsspec URL)."""

    def __init__(self, path: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
        from torch.distributed.checkpoint.metadata import MetadataIndex

        self.path = path
        self._fs_opts = fsspec_options(path, storage_options)
        if "://" in path:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            self.reader: Any = FsspecReader(path, **self._fs_opts)
        else:
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise NotFoundError(f"{path!r} is not a DCP checkpoint directory (no .metadata in it)")
            self.reader = FileSystemReader(path)
        self.md = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.md, True)
        self._ReadItem, self._LoadPlan, self._Index, self._TENSOR = ReadItem, LoadPlan, MetadataIndex, LoadItemType.TENSOR
        tensors: list[SourceTensor] = []
        byte_items = []
        for fqn, smd in self.md.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                tensors.append(SourceTensor(fqn, smd.properties.dtype, tuple(smd.size)))
            else:
                byte_items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn),
                                           dest_offsets=torch.Size([0]), storage_index=MetadataIndex(fqn),
                                           storage_offsets=torch.Size([0]), lengths=torch.Size([0])))
        raw: dict[str, bytes] = {}
        if byte_items:
            self.reader.read_data(LoadPlan(byte_items), _dcp_planner(None, raw)).wait()
        flat: dict[str, Any] = {t.key: TensorRef(t.key) for t in tensors}
        torch_save = []
        for fqn, data in raw.items():
            flat[fqn], plain = plain_value(data)
            if not plain:
                torch_save.append(fqn)
        order = list(self.md.state_dict_metadata)
        flat = {k: flat[k] for k in order if k in flat}
        super().__init__(tensors, tree_from_flat(flat, self.md.planner_data), {META_KEY: {"torch_save": torch_save}})

    def load(self, key: str) -> torch.Tensor:
        """One tensor, chunk by chunk: each saved chunk is read (one range of its file),
        unpickled with ``weights_only`` and copied into place.  Chunks DCP stored through
        stream transforms (compression extensions) go through DCP's own reader."""
        smd = self.md.state_dict_metadata[key]
        out = torch.empty(tuple(smd.size), dtype=smd.properties.dtype)
        if not out.numel():
            return out
        via_dcp = []
        for c in smd.chunks:
            sdata = self.md.storage_data
            info = sdata.get(self._Index(key, c.offsets)) if isinstance(sdata, dict) else None
            if info is None or getattr(info, "transform_descriptors", None):
                via_dcp.append(c)
                continue
            with self._open_rel(info.relative_path) as f:
                f.seek(info.offset)
                data = f.read(info.length)
            part = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            del data
            dest = out
            for d, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                dest = dest.narrow(d, o, n)
            dest.copy_(part)
            del part
        if via_dcp:
            items = [self._ReadItem(type=self._TENSOR, dest_index=self._Index(key, c.offsets), dest_offsets=c.offsets,
                                    storage_index=self._Index(key, c.offsets),
                                    storage_offsets=torch.Size([0] * len(c.offsets)), lengths=c.sizes)
                     for c in via_dcp]
            self.reader.read_data(self._LoadPlan(items), _dcp_planner(out, {})).wait()
        return out

    def _open_rel(self, rel: str) -> Any:
        if "://" in self.path:
            import fsspec

            return fsspec.open(f"{self.path.rstrip('/')}/{rel}", "rb", **self._fs_opts).open()
        return open(os.path.join(self.path, rel), "rb")


# -- torch.save ----------------------------------------------------------------------------
def _file_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (from /proc/self/maps)."""
    real = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() == real:
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return out


class TorchSaveSource(Source):
    """A ``torch.save`` file (zip format), memory-mapped, tensors copied out one at a time."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise NotFoundError(f"torch.save file {path!r} does not exist")
        try:
            obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except RuntimeError as e:
            raise UnsupportedFormatError(f"{path!r} cannot be memory-mapped as a torch.save file (only the zip "
                                         f"format written since torch 1.6 can): {e}") from None
        except Exception as e:  # weights_only refuses pickled objects: they would run code
            raise UnsupportedFormatError(f"torch.save file {path!r} holds objects that weights_only loading "
                                         f"refuses: {e}") from None
        self._tensors: dict[str, torch.Tensor] = {}

        def on_tensor(key: str, t: torch.Tensor) -> None:
            if not key:
                raise UnsupportedValueError(f"torch.save file {path!r} holds a bare tensor; save a dict of tensors")
            self._tensors[key] = t

        tree = encode_tree(obj, on_tensor)
        self._ranges = _file_ranges(path)
        self._libc: Any = None
        if self._ranges:
            try:
                self._libc = ctypes.CDLL(None, use_errno=True)
            except OSError:
                self._ranges = []
        super().__init__([SourceTensor(k, t.dtype, tuple(t.shape)) for k, t in self._tensors.items()], tree)

    def load(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def release(self, key: str) -> None:
        """Drop the tensor's pages from resident memory when they belong to the file mapping."""
        t = self._tensors[key]
        n = t.numel() * t.element_size()
        if not n or self._libc is None:
            return
        page = mmap.PAGESIZE
        lo = t.data_ptr() // page * page
        hi = -(-(t.data_ptr() + n) // page) * page
        if any(a <= lo and hi <= b for a, b in self._ranges):  # file-backed, never written: safe to drop
            self._libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


# -- safetensors ---------------------------------------------------------------------------
def _list_safetensors(path: str, storage_options: Optional[dict[str, Any]]) -> list[str]:
    if "://" in path:
        import fsspec

        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
        if fs.isdir(root):
            proto = path.split("://", 1)[0]
            return [f"{proto}://{p}" for p in sorted(fs.glob(root.rstrip("/") + "/*.safetensors"))]
        return [path]
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    return [path]


class SafetensorsSource(Source):
    """A safetensors file, or a directory of them (e.g. a Hugging Face sharded model)."""

    def __init__(self, path: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        paths = _list_safetensors(path, storage_options)
        files = [SafetensorsFile(p, fsspec_options(p, storage_options)) for p in paths]
        if not files:
            raise NotFoundError(f"{path!r} holds no .safetensors file")
        self._where: dict[str, SafetensorsFile] = {}
        tensors = []
        for f in files:
            for e in f.entries:
                if e.name in self._where:
                    raise UnsupportedFormatError(f"tensor {e.name!r} is in both {self._where[e.name].path!r} and "
                                                 f"{f.path!r}")
                self._where[e.name] = f
                tensors.append(SourceTensor(e.name, e.dtype, e.shape))
        meta = {"safetensors": files[0].metadata} if files[0].metadata else {}
        super().__init__(tensors, tree_from_flat({t.key: TensorRef(t.key) for t in tensors}, None), meta)

    def load(self, key: str) -> torch.Tensor:
        return self._where[key].read(key)
