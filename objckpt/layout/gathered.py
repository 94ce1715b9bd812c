"""The gathered layout (format v1): every rank's boxes known to every rank.

Any layout works this way (hand-made :class:`objckpt.Shard` boxes included),
at a cost that grows with ranks x tensors: each rank plans from the gathered
boxes, and the manifest lists every chunk inline.  Single-process saves use
it too, so readers of format v1 can read them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..errors import CorruptCheckpointError, StateDictMismatchError
from ..format.dtypes import dtype_from_name, itemsize
from ..format.manifest import Blob, Chunk, ChunkRecord, Manifest, TensorEntry
from ..format.spread import Placement
from ..planning.assign import RankWrites, TensorMeta, plan_rank_writes
from ..planning.boxes import Box, whole
from ..planning.pack import PackLimits
from ..planning.read_plan import ChunkIndex, Overlap
from ..planning.tiling import describe, tiling_defect
from ..results import IOStats
from ..storage import ObjectStore
from .base import WRITER, ManifestCommon, RankOutcome, SaveLayout


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the others in a gathered save."""

    metas: dict[str, TensorMeta]
    tree: Any
    aliases: dict[str, str]
    dtypes: dict[str, str]


class GatheredLayout(SaveLayout):
    version = 1

    def __init__(self, reports: list[RankReport]) -> None:
        self.reports = reports

    def plan(self, rank: int, boxes: dict[str, Box], limits: PackLimits) -> RankWrites:
        """Planned anew: a save of a structure saved before reuses its plan one level up
        (:mod:`objckpt.save.plan_cache`, keyed on the structure), so a digest of every
        rank's boxes here (a pickle of them all: ~5 ms at 3,200 tensors) would only cost
        the first save of each structure."""
        return plan_rank_writes([r.metas for r in self.reports], rank, limits)

    async def publish(self, records: list[ChunkRecord], blobs: list[Blob], store: ObjectStore, place: Placement,
                      attempt: str, rank: int, stats: IOStats) -> RankOutcome:
        return RankOutcome(blobs=blobs, records=records)

    def manifest(self, outcomes: list[RankOutcome], common: ManifestCommon) -> Manifest:
        metas0: dict[str, TensorMeta] = {}
        dtypes: dict[str, str] = {}
        for r in self.reports:
            for k, t in r.metas.items():
                metas0.setdefault(k, t)
            for k, d in r.dtypes.items():
                dtypes.setdefault(k, d)
        aliases = self.reports[0].aliases
        entries: dict[str, TensorEntry] = {}
        for k in dtypes:
            if k in aliases:
                target = metas0[aliases[k]]
                entries[k] = TensorEntry(k, target.dtype, target.shape, alias_of=aliases[k])
            else:
                t = metas0[k]
                entries[k] = TensorEntry(k, t.dtype, t.shape)
        trees = [r.tree for r in self.reports]
        first = json.dumps(trees[0], sort_keys=True) if len(trees) > 1 else ""  # (encoded once; none alone)
        same = all(json.dumps(t, sort_keys=True) == first for t in trees[1:])
        return _inline_manifest(entries, outcomes, trees[0], None if same else trees, common)


def _inline_manifest(entries: dict[str, TensorEntry], outcomes: list[RankOutcome], tree: Any,
                     rank_trees: Optional[list[Any]], common: ManifestCommon) -> Manifest:
    """Every rank's chunk records listed inline in ``entries`` (each rank's blob numbers
    rebased onto the manifest's blob list, chunks in offset order)."""
    blobs: list[Blob] = []
    for rank, out in enumerate(outcomes):
        base = len(blobs)
        blobs.extend(out.blobs)
        for rec in out.records:
            entry = entries.get(rec.key)
            if entry is None:
                raise StateDictMismatchError(f"rank {rank} wrote a chunk of {rec.key!r}, a tensor the manifest "
                                             "being committed does not hold")
            c = rec.chunk
            entry.chunks.append(Chunk(c.offsets, c.shape, base + c.blob, c.offset, c.length, c.crc32c,
                                      c.block_crc32c))
    for e in entries.values():
        e.chunks.sort(key=lambda c: c.offsets)
    return Manifest(
        tensors=entries, blobs=blobs, tree=tree, metadata=common.metadata, attempt=common.attempt,
        world_size=max(1, len(outcomes)), writer=WRITER, crc_block=common.crc_block, rank_trees=rank_trees,
    )


def sourced_manifest(tensors: dict[str, tuple[str, tuple[int, ...]]], outcomes: list[RankOutcome], tree: Any,
                     common: ManifestCommon) -> Manifest:
    """The manifest of a save whose pieces a source chose (DCP's planner, a converter's
    stream; ``tensors``: key -> (dtype name, shape)), listed inline as the gathered
    layout lists them.  A source may hand over boxes that hold nothing (a rank's
    empty shard of a DTensor): those chunks are dropped, and an empty tensor keeps one
    empty chunk covering it (docs/format.md §4).  Every tensor is checked to be tiled
    exactly, so rows no rank wrote are never committed."""
    entries = {k: TensorEntry(k, dtype, tuple(shape)) for k, (dtype, shape) in tensors.items()}
    m = _inline_manifest(entries, outcomes, tree, None, common)
    for e in m.tensors.values():
        _drop_empty_chunks(e)
        check_coverage(e)
    return m


def _drop_empty_chunks(e: TensorEntry) -> None:
    if math.prod(e.shape) == 0:
        if not e.chunks:
            raise CorruptCheckpointError(f"no chunk of the empty tensor {e.key!r} was written")
        first = e.chunks[0]
        e.chunks[:] = [Chunk((0,) * len(e.shape), tuple(e.shape), first.blob, first.offset, 0, 0)]
        return
    e.chunks[:] = [c for c in e.chunks if c.length]


def check_coverage(entry: TensorEntry) -> None:
    """The chunks tile the tensor exactly (each element once, every chunk inside
    it) and each chunk's length matches its shape: an element count alone would
    accept a chunk whose offsets were changed, and rows never written would load."""
    isz = itemsize(dtype_from_name(entry.dtype, entry.key))
    for c in entry.chunks:
        if c.length != math.prod(c.shape) * isz:  # as_strided stays in bounds
            raise CorruptCheckpointError(
                f"tensor {entry.key!r}: the chunk at {list(c.offsets)} of shape {list(c.shape)} is {c.length} bytes, "
                f"not {math.prod(c.shape) * isz}"
            )
    shape = tuple(entry.shape)
    if (len(entry.chunks) == 1 and tuple(entry.chunks[0].shape) == shape and min(shape, default=0) >= 0
            and tuple(entry.chunks[0].offsets) == (0,) * len(shape)):
        return  # one chunk at the origin, of the tensor's shape (most tensors): tiled, without the walk below
    defect = tiling_defect([(c.offsets, c.shape) for c in entry.chunks], whole(entry.shape))
    if defect is not None:
        raise CorruptCheckpointError(
            f"tensor {entry.key!r}: its chunks do not tile shape {list(entry.shape)} exactly: {describe(defect)}"
        )


class InlineResolver:
    """Chunks listed in the manifest (v1): an index sorted by dim-0 start answers."""

    def __init__(self, m: Manifest) -> None:
        self.m = m
        self._index: dict[str, ChunkIndex] = {}

    async def prefetch(self, wanted: Iterable[tuple[str, Box]], stats: Optional[IOStats] = None) -> None:
        return None  # everything is in the manifest

    def overlapping(self, key: str, box: Box) -> list[Overlap]:
        idx = self._index.get(key)
        if idx is None:
            e = self.m.tensors[key]
            check_coverage(e)
            idx = self._index[key] = ChunkIndex(e.chunks)
        return idx.overlapping(box)

    async def resolve_all(self, stats: Optional[IOStats] = None) -> None:
        return None
