"""``objckpt convert``: DCP / torch.save / safetensors -> objckpt, and objckpt -> DCP / safetensors.

Every direction streams: one tensor is read from the source, staged into
upload parts (or written to the destination file) and dropped before the next
is read, so peak memory is about one tensor plus a few upload parts, whatever
the checkpoint's size.

* into objckpt: :mod:`.sources` reads the source one tensor at a time and
  :func:`.stream_write.write_checkpoint` packs the parts as they come and commits
  the manifest last (an existing checkpoint is refused unless ``overwrite``);
* objckpt -> DCP: DCP's ``FileSystemWriter`` (or ``FsspecWriter`` for URLs) is
  driven with a state dict of meta tensors (shapes only) and a planner whose
  ``resolve_data`` reads each tensor from the checkpoint when DCP is about to
  write it.  One file per tensor (``single_file_per_rank=False``): DCP's writer keeps
  every tensor of a file alive until the file is closed (torch 2.13), so one file
  for everything would hold the whole checkpoint;
* objckpt -> safetensors: :func:`objckpt.integrations.hf.export_safetensors`.
"""
from __future__ import annotations

import enum
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..runtime import loop as _runtime
from ..errors import CheckpointExistsError, NotFoundError, UnsupportedFormatError
from ..format import keys
from .dcp_tree import materialize
from ..load.session import ReadSession, open_location
from .sources import DcpSource, SafetensorsSource, Source, TorchSaveSource, fsspec_options
from .stream_write import WriteOptions, write_checkpoint


class Format(str, enum.Enum):
    """Checkpoint formats ``convert`` reads or writes."""

    AUTO = "auto"
    OBJCKPT = "objckpt"
    DCP = "dcp"
    TORCH = "torch"
    SAFETENSORS = "safetensors"


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did."""

    src: str
    dst: str
    src_format: Format
    dst_format: Format
    tensors: int
    nbytes: int


def _parse_format(value: "str | Format", what: str) -> Format:
    try:
        return Format(value)
    except ValueError:
        raise UnsupportedFormatError(f"unknown {what} format {value!r}; choose one of "
                                     f"{[f.value for f in Format]}") from None


def _is_objckpt(uri: str, storage_options: Optional[dict[str, Any]]) -> bool:
    try:
        st, prefix = open_location(uri, storage_options)
        return _runtime.run(st.head(keys.manifest_key(prefix))) is not None
    except (NotFoundError, ValueError, OSError):
        return False


def _sniff_file(head: bytes, name: str) -> Optional[Format]:
    if head.startswith(b"PK\x03\x04"):
        return Format.TORCH
    if name.endswith(".safetensors") or (len(head) >= 9 and head[8:9] == b"{"):
        return Format.SAFETENSORS
    return None


def detect_format(src: str, storage_options: Optional[dict[str, Any]] = None) -> Format:
    """What ``src`` holds: an objckpt checkpoint (a committed manifest), a DCP directory
    (``.metadata``), a torch.save zip file, or safetensors (a file, or a directory of them)."""
    if _is_objckpt(src, storage_options):
        return Format.OBJCKPT
    if "://" in src:
        import fsspec

        fs, root = fsspec.core.url_to_fs(src, **fsspec_options(src, storage_options))
        if fs.exists(root.rstrip("/") + "/.metadata"):
            return Format.DCP
        if fs.isdir(root):
            if fs.glob(root.rstrip("/") + "/*.safetensors"):
                return Format.SAFETENSORS
            raise UnsupportedFormatError(f"cannot tell the format of {src!r}: a directory with neither .metadata "
                                         "(DCP), manifest.json (objckpt) nor *.safetensors")
        if not fs.exists(root):
            raise NotFoundError(f"convert: source {src!r} does not exist")
        with fs.open(root, "rb") as f:
            head = f.read(16)
    else:
        if not os.path.exists(src):
            raise NotFoundError(f"convert: source {src!r} does not exist")
        if os.path.isdir(src):
            if os.path.isfile(os.path.join(src, ".metadata")):
                return Format.DCP
            if any(n.endswith(".safetensors") for n in os.listdir(src)):
                return Format.SAFETENSORS
            raise UnsupportedFormatError(f"cannot tell the format of {src!r}: a directory with neither .metadata "
                                         "(DCP), manifest.json (objckpt) nor *.safetensors")
        with open(src, "rb") as f:
            head = f.read(16)
    found = _sniff_file(head, src)
    if found is None:
        hint = " (a legacy, non-zip torch.save file? re-save it with a current torch)" if head[:1] == b"\x80" else ""
        raise UnsupportedFormatError(f"cannot tell the format of {src!r}: not a torch.save zip file nor a "
                                     f"safetensors file{hint}; pass --from to say which")
    return found


def open_source(src: str, fmt: Format, storage_options: Optional[dict[str, Any]] = None) -> Source:
    """The streaming source for ``src`` in format ``fmt``."""
    if fmt == Format.DCP:
        return DcpSource(src, storage_options)
    if fmt == Format.TORCH:
        if "://" in src:
            raise UnsupportedFormatError(f"{src!r}: torch.save files convert from local paths only "
                                         "(they are memory-mapped); copy it here first")
        return TorchSaveSource(src)
    if fmt == Format.SAFETENSORS:
        return SafetensorsSource(src, storage_options)
    raise UnsupportedFormatError(f"cannot read {src!r} as {fmt.value}")


def convert(src: str, dst: str, *, src_format: "str | Format" = "auto", dst_format: "str | Format" = "auto",
            storage_options: Optional[dict[str, Any]] = None,
            dst_storage_options: Optional[dict[str, Any]] = None, overwrite: bool = False,
            opts: Optional[WriteOptions] = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` into ``dst``, streaming (about one tensor in memory).

    ``src_format``: ``auto`` (detected: see :func:`detect_format`), ``dcp``, ``torch``,
    ``safetensors`` or ``objckpt``.  ``dst_format``: ``auto`` is ``objckpt`` for
    any other source and ``dcp`` for an objckpt source; ``safetensors`` writes the
    Hugging Face layout into the directory ``dst``.  ``storage_options`` apply to
    ``src`` (for fsspec URLs, objckpt's S3 keys are translated for s3fs), and
    ``dst_storage_options`` (default: the same) to ``dst``.  An existing destination
    is an error unless ``overwrite``."""
    sfmt = _parse_format(src_format, "source")
    dfmt = _parse_format(dst_format, "destination")
    dst_opts = storage_options if dst_storage_options is None else dst_storage_options
    if sfmt == Format.AUTO:
        sfmt = detect_format(src, storage_options)
    if dfmt == Format.AUTO:
        dfmt = Format.DCP if sfmt == Format.OBJCKPT else Format.OBJCKPT
    if sfmt == Format.OBJCKPT:
        if dfmt == Format.DCP:
            n, size = objckpt_to_dcp(src, dst, storage_options, dst_opts, overwrite)
            return ConvertResult(src, dst, sfmt, dfmt, n, size)
        if dfmt == Format.SAFETENSORS:
            from .hf import ExportOptions, export_safetensors

            ex = export_safetensors(src, dst, ExportOptions(), storage_options=storage_options)
            return ConvertResult(src, dst, sfmt, dfmt, ex.tensors, ex.nbytes)
        raise UnsupportedFormatError(f"convert from objckpt writes dcp or safetensors, not {dfmt.value}")
    if dfmt != Format.OBJCKPT:
        raise UnsupportedFormatError(f"convert from {sfmt.value} writes objckpt, not {dfmt.value} "
                                     "(convert to objckpt first)")
    source = open_source(src, sfmt, storage_options)
    wopts = opts or WriteOptions()
    wopts = WriteOptions(overwrite or wopts.overwrite, {**wopts.metadata, **source.metadata,
                                                        "converted_from": {"format": sfmt.value}},
                         wopts.blob_size, wopts.part_size, wopts.crc_block, wopts.window)
    r = write_checkpoint(dst, source.tensors, source.load, source.tree, storage_options=dst_opts,
                         release=source.release, opts=wopts)
    return ConvertResult(src, dst, sfmt, dfmt, r.tensors, r.nbytes)


def objckpt_to_dcp(src: str, dst: str, storage_options: Optional[dict[str, Any]] = None,
                   dst_options: Optional[dict[str, Any]] = None, overwrite: bool = False) -> tuple[int, int]:
    """Write the objckpt checkpoint ``src`` as a DCP directory ``dst`` (local path or fsspec
    URL), one tensor in memory at a time.  Returns (tensors, bytes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from .dcp import StorageReader

    ck = ReadSession.open(src, storage_options)
    view = StorageReader(src, storage_options=storage_options)._view_for(ck, ck.manifest.tree)
    if "://" in dst:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        import fsspec

        fs, root = fsspec.core.url_to_fs(dst, **fsspec_options(dst, dst_options))
        if fs.exists(root.rstrip("/") + "/.metadata") and not overwrite:
            raise CheckpointExistsError(f"a DCP checkpoint already exists at {dst!r}; pass overwrite=True")
        writer: Any = FsspecWriter(dst, single_file_per_rank=False, thread_count=1, overwrite=True,
                                   **fsspec_options(dst, dst_options))
    else:
        if os.path.isfile(os.path.join(dst, ".metadata")) and not overwrite:
            raise CheckpointExistsError(f"a DCP checkpoint already exists at {dst!r}; pass overwrite=True")
        os.makedirs(dst, exist_ok=True)
        writer = dcp.FileSystemWriter(dst, single_file_per_rank=False, thread_count=1, overwrite=True)
    written = [0, 0]

    class _Lazy(DefaultSavePlanner):
        """Reads each tensor from objckpt when DCP resolves its write item, not before."""

        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            if write_item.index.fqn in view.torch_save and isinstance(obj, (bytes, bytearray)):
                return io.BytesIO(bytes(obj))  # already torch.save bytes: hand them over as they are
            if isinstance(obj, torch.Tensor) and id(obj) in view.placeholders:
                obj = ck.read(view.placeholders[id(obj)][1])
                written[0] += 1
                written[1] += obj.numel() * obj.element_size()
            else:
                obj = materialize(obj, view, ck.read)
            return self.transform_object(write_item, obj)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(view.decoded, storage_writer=writer, planner=_Lazy(), no_dist=True)
    return written[0], written[1]
