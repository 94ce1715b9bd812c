"""Upload a save plan in order, asking a source for each tensor when its bytes are due.

:func:`.upload.write_plan` uploads every part at once from tensors already in
memory.  A converter reads its source tensor by tensor, so here the parts are
filled in plan order: ``load(key)`` is asked for a tensor when its first chunk
comes up, and ``release(key)`` is called when the next tensor is asked for
(its last chunk is staged by then).  At most ``window`` parts are uploading at
once, from ``window`` part buffers reused for the whole save (allocating a fresh
part-sized buffer each time leaves freed 16 MiB blocks in malloc's arenas, and
resident memory creeps up by many of them), so memory stays at about one
tensor plus ``window`` parts.  The staging, the crc32c (whole and per block) and
the part crc are those of ``write_plan``; on any failure the unfinished uploads
are aborted and the finished blobs deleted, as there.
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from ..runtime import loop as _runtime
from ..planning.pack import ChunkPlan, SavePlan
from ..results import IOStats
from ..storage import BlobWriter, ObjectStore
from .upload import ChunkCrc, enqueue_part, part_crc, part_crcs

Pending = collections.deque[tuple["concurrent.futures.Future[None]", torch.Tensor]]


class _Held(Mapping[str, torch.Tensor]):
    """The one source tensor held at a time, as the mapping :func:`enqueue_part` reads."""

    def __init__(self, load: Callable[[str], torch.Tensor], release: Optional[Callable[[str], None]]) -> None:
        self.load, self.release = load, release
        self.key: Optional[str] = None
        self.t: Optional[torch.Tensor] = None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key != self.key or self.t is None:
            self.drop()
            self.t, self.key = self.load(key), key
        return self.t

    def __iter__(self) -> Iterator[str]:
        return iter(() if self.key is None else (self.key,))

    def __len__(self) -> int:
        return 0 if self.key is None else 1

    def drop(self) -> None:
        if self.key is not None and self.release is not None:
            self.release(self.key)
        self.key, self.t = None, None


def _wait_oldest(pending: Pending, free: list[torch.Tensor]) -> None:
    fut, buf = pending.popleft()
    fut.result()
    free.append(buf)


def write_plan_in_order(store: ObjectStore, blob_keys: list[str], plan: SavePlan,
                        load: Callable[[str], torch.Tensor], release: Optional[Callable[[str], None]],
                        stats: IOStats, *, crc_block: int, window: int = 2) -> dict[ChunkPlan, ChunkCrc]:
    """Upload every blob of ``plan`` in order (``load``/``release`` by packing key);
    returns the crc32c of each chunk."""
    held = _Held(load, release)
    crcs: dict[ChunkPlan, ChunkCrc] = {}
    writers: dict[int, BlobWriter] = {}
    completed: list[int] = []
    pending: Pending = collections.deque()
    free = [torch.empty(plan.max_part, dtype=torch.uint8) for _ in range(min(max(1, window), len(plan.chunks) or 1))]
    try:
        for b in plan.blobs:
            w = writers[b.index] = store.open_writer(blob_keys[b.index], b.size, len(b.parts))
            for part in b.parts:
                if not free:  # every buffer is uploading: wait for the oldest
                    _wait_oldest(pending, free)
                whole = free.pop()
                ev = enqueue_part(part, held, whole)
                if ev is not None:  # a source handed over a device tensor: its copy must be done
                    ev.synchronize()
                found = part_crcs(part, whole, crc_block)
                crcs.update(zip(part.chunks, found))
                buf = whole[: part.size]
                view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")  # type: ignore[arg-type]
                pending.append((_runtime.submit(w.write_part_views(part.index, part.offset, [view],
                                                                   crc32c=part_crc(part, found))), whole))
                stats.add(part.size)
            while pending:
                _wait_oldest(pending, free)
            _runtime.run(w.complete())
            if len(b.parts) > 1:
                stats.add(0, 2)  # create + complete of the multipart upload
            completed.append(b.index)
        held.drop()
    except BaseException:
        for fut, _ in pending:
            fut.cancel()
        concurrent.futures.wait([f for f, _ in pending])
        for i, w in writers.items():
            if i not in completed:
                _quiet(w.abort())
        _quiet(store.delete([blob_keys[i] for i in completed]))
        raise
    return crcs


def _quiet(coro: Any) -> None:
    try:
        _runtime.run(coro)
    except Exception:
        pass  # left for gc: no manifest names it
