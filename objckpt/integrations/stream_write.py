"""Write an objckpt checkpoint from a source that yields one tensor at a time.

:func:`objckpt.save` takes a whole state in memory.  A converter reads its
source (a DCP directory, a torch.save file, safetensors files) tensor by tensor,
so it needs a writer that asks for each tensor only when its bytes are due:
the blobs are laid out up front from shapes and dtypes alone (the same packing
as ``save``: chunks of at most ``part_size`` rows, 64-byte aligned, crc32c per
chunk and per ``crc_block``), then the parts are filled in order, asking
``load(key)`` for a tensor when its first chunk comes up and calling
``release(key)`` once its last chunk is staged.  At most ``window`` parts are
uploading at once, from ``window`` reused part buffers, so memory stays at one
tensor plus ``window`` parts.  The
manifest is committed last, conditionally, as every save does.
"""
from __future__ import annotations

import collections
import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .. import _runtime
from ..errors import CheckpointExistsError, ObjckptError, UnsupportedFormatError
from ..format import keys
from ..format.dtypes import dtype_name, itemsize
from ..format.manifest import Blob, Chunk, Manifest, TensorEntry
from ..layout.base import WRITER
from ..planning import crc_blocks
from ..planning.pack import PartPlan, TensorSpec, plan_save
from ..results import IOStats
from ..save.commit import CommitState, commit
from ..save.upload import ChunkCrc, part_crc, part_crcs
from ..storage import BlobWriter, ObjectStore
from ..storage.shape import save_sizes, shape_for
from .reading import open_uri


@dataclass(frozen=True)
class SourceTensor:
    """A tensor a source will produce: its key in the checkpoint, dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WriteOptions:
    """How the streamed checkpoint is packed and committed (the ``save`` options that apply)."""

    overwrite: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    #: None: by the endpoint's shape (single-PUT blobs on moto, multipart elsewhere), as ``save``
    blob_size: Optional[int] = None
    part_size: Optional[int] = None
    #: None: chosen from the tensors' sizes, as ``save`` does
    crc_block: Optional[int] = None
    window: int = 2


@dataclass(frozen=True)
class StreamResult:
    """What a streamed write stored."""

    uri: str
    tensors: int
    nbytes: int
    blobs: int


class _Current:
    """The one source tensor held at a time."""

    def __init__(self, infos: dict[str, SourceTensor], load: Callable[[str], torch.Tensor],
                 release: Optional[Callable[[str], None]]) -> None:
        self.infos, self.load, self.release = infos, load, release
        self.key: Optional[str] = None
        self.t: Optional[torch.Tensor] = None

    def get(self, key: str) -> torch.Tensor:
        if key != self.key:
            self.drop()
            t = self.load(key)
            info = self.infos[key]
            if t.dtype != info.dtype or tuple(t.shape) != info.shape:
                raise UnsupportedFormatError(f"source tensor {key!r} is {t.dtype} {list(t.shape)}, but its header "
                                             f"said {info.dtype} {list(info.shape)}")
            self.key, self.t = key, t
        assert self.t is not None
        return self.t

    def drop(self) -> None:
        if self.key is not None and self.release is not None:
            self.release(self.key)
        self.key, self.t = None, None


def _stage(part: PartPlan, cur: _Current, buf: torch.Tensor) -> torch.Tensor:
    """Copy ``part``'s chunks into ``buf`` (reused across parts: allocating a fresh
    part-sized buffer each time leaves freed 16 MiB blocks in malloc's arenas and
    resident memory creeps up by many of them)."""
    buf = buf[: part.size]
    buf.zero_()  # zero padding between chunks
    for c in part.chunks:
        if not c.length:
            continue
        t = cur.get(c.key)
        src = t.reshape(1) if t.dim() == 0 else t[c.row_start : c.row_end]
        rel = c.offset - part.offset
        buf[rel : rel + c.length].view(src.dtype).view(src.shape).copy_(src)
    return buf


def write_checkpoint(uri: str, sources: Sequence[SourceTensor], load: Callable[[str], torch.Tensor], tree: Any, *,
                     storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None,
                     release: Optional[Callable[[str], None]] = None,
                     opts: WriteOptions = WriteOptions()) -> StreamResult:
    """Write ``sources`` (in order) and the encoded ``tree`` as a checkpoint at ``uri``.

    ``tree`` names each tensor by its key (``{"$tensor": key}``, docs/format.md §7).
    An existing checkpoint is refused before anything is uploaded unless
    ``opts.overwrite``; a failure aborts the uploads, deletes finished blobs and
    commits nothing."""
    st, prefix = open_uri(uri, storage_options, store)
    if _runtime.run(st.head(keys.manifest_key(prefix))) is not None and not opts.overwrite:
        raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; pass overwrite=True to replace it")
    infos = {s.key: s for s in sources}
    specs = [TensorSpec(s.key, s.shape, itemsize(s.dtype)) for s in sources]
    dtypes = {s.key: dtype_name(s.dtype, s.key) for s in sources}
    blob_size, part_size = save_sizes(opts.blob_size, opts.part_size, _runtime.run(shape_for(st)))
    plan = plan_save(specs, blob_bytes=blob_size, part_bytes=max(part_size, st.min_part_size),
                     chunk_bytes=part_size, max_part_bytes=st.max_part_size)
    crc_block = opts.crc_block if opts.crc_block is not None else crc_blocks.for_boxes(
        (math.prod(s.shape) * itemsize(s.dtype) for s in sources), part_size)
    attempt = keys.new_attempt_id()
    names = [keys.blob_name(attempt, 0, b.index) for b in plan.blobs]
    blob_keys = [keys.join(prefix, n) for n in names]
    stats = IOStats()
    crcs: dict[Any, ChunkCrc] = {}
    cur = _Current(infos, load, release)
    writers: dict[int, BlobWriter] = {}
    completed: list[int] = []
    pending: collections.deque[tuple[concurrent.futures.Future[None], torch.Tensor]] = collections.deque()
    window = max(1, opts.window)
    free = [torch.empty(plan.max_part, dtype=torch.uint8) for _ in range(min(window, len(plan.chunks) or 1))]
    try:
        for b in plan.blobs:
            w = writers[b.index] = st.open_writer(blob_keys[b.index], b.size, len(b.parts))
            for part in b.parts:
                if not free:  # every buffer is uploading: wait for the oldest
                    fut, done = pending.popleft()
                    fut.result()
                    free.append(done)
                whole = free.pop()
                buf = _stage(part, cur, whole)
                found = part_crcs(part, buf, crc_block)
                crcs.update(zip(part.chunks, found))
                view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")  # type: ignore[arg-type]
                pending.append((_runtime.submit(w.write_part_views(part.index, part.offset, [view],
                                                                   crc32c=part_crc(part, found))), whole))
                stats.add(part.size)
            while pending:
                fut, done = pending.popleft()
                fut.result()
                free.append(done)
            _runtime.run(w.complete())
            completed.append(b.index)
        cur.drop()
    except BaseException:
        for fut, _ in pending:
            fut.cancel()
        concurrent.futures.wait([f for f, _ in pending])
        for i, w in writers.items():
            if i not in completed:
                _quiet(w.abort())
        _quiet(st.delete([blob_keys[i] for i in completed]))
        raise
    entries = {s.key: TensorEntry(s.key, dtypes[s.key], s.shape) for s in sources}
    for c in plan.chunks:
        k = crcs[c]
        entries[c.key].chunks.append(Chunk(tuple(c.offsets), tuple(c.shape), c.blob, c.offset, c.length, k.total,
                                           k.blocks))
    blobs = [Blob(n, b.size, 0) for n, b in zip(names, plan.blobs)]
    m = Manifest(tensors=entries, blobs=blobs, tree=tree, metadata=dict(opts.metadata), attempt=attempt,
                 writer=WRITER, crc_block=crc_block)
    errors: list[BaseException] = []
    status = commit(st, prefix, m, opts.overwrite, uri, blob_keys, stats, errors)
    if status.state == CommitState.EXISTS:
        raise CheckpointExistsError(status.message)
    if status.state != CommitState.OK:
        raise ObjckptError(status.message) from (errors[0] if errors else None)
    return StreamResult(uri, len(sources), sum(b.size for b in plan.blobs), len(blobs))


def _quiet(coro: Any) -> None:
    try:
        _runtime.run(coro)
    except Exception:
        pass  # left for gc: no manifest names it
