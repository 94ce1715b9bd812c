"""Which stored chunks overlap a wanted box, for either manifest version.

v1 lists chunks inline: an index sorted by dim-0 start answers.  v2 computes
the overlapping pieces and their writers from the layout, fetches just those
writers' index objects (concurrently, each verified by size and crc32c) and
looks the pieces up there; a piece missing from its writer's index is an
error, so coverage is checked piece by piece.
"""
from __future__ import annotations

import asyncio
import math
from typing import Iterable, Optional

from ..checksum import crc32c
from ..errors import CorruptCheckpointError, NotFoundError
from ..format import layout as keys
from ..format import rank_index
from ..format.dtypes import dtype_from_name, itemsize
from ..format.manifest import Chunk, Manifest, TensorEntry
from ..planning.layout import overlapping_pieces
from ..planning.reshard import Box, ChunkIndex, intersect
from ..storage import ObjectStore
from .stats import IOStats


def check_coverage(entry: TensorEntry) -> None:
    """The chunks hold exactly the tensor's elements (each once, inside it)."""
    isz = itemsize(dtype_from_name(entry.dtype, entry.key))
    ok = all(c.length == math.prod(c.shape) * isz for c in entry.chunks)  # as_strided stays in bounds
    if entry.shape:
        ok = ok and sum(math.prod(c.shape) for c in entry.chunks) == entry.numel
    else:
        ok = ok and len(entry.chunks) == 1
    if not ok:
        raise CorruptCheckpointError(
            f"tensor {entry.key!r}: its chunks do not cover shape {list(entry.shape)} exactly once"
        )


class ChunkResolver:
    """Answers ``overlapping(key, box)`` after ``prefetch`` fetched what it needs."""

    def __init__(self, m: Manifest, store: ObjectStore, prefix: str) -> None:
        self.m = m
        self.store = store
        self.prefix = prefix
        self._v1: dict[str, ChunkIndex] = {}
        self._ranks: dict[int, dict[str, dict[tuple[int, ...], Chunk]]] = {}
        self._blobs: Optional[list[list[int]]] = None
        self._blob_sizes: list[int] = []
        self._pieces: dict[tuple[str, Box], list[tuple[int, Box, Box]]] = {}
        self._rank_idx: dict[tuple[int, str], ChunkIndex] = {}

    def _layout_pieces(self, key: str, box: Box) -> list[tuple[int, Box, Box]]:
        hit = self._pieces.get((key, box))
        if hit is None:
            e = self.m.tensors[key]
            assert e.layout is not None
            hit = overlapping_pieces(e.shape, self.m.meshes[e.layout.mesh], e.layout, box)
            self._pieces[(key, box)] = hit
        return hit

    async def prefetch(self, wanted: Iterable[tuple[str, Box]], stats: Optional[IOStats] = None) -> None:
        """Fetch the index objects of every rank that wrote a piece of ``wanted``."""
        need: set[int] = set()
        for key, box in wanted:
            if self.m.tensors[key].layout is not None:
                need.update(r for r, _, _ in self._layout_pieces(key, box))
        need -= set(self._ranks)
        if need:
            got = await asyncio.gather(*(self._fetch(r, stats) for r in sorted(need)))
            self._ranks.update(zip(sorted(need), got))

    async def _fetch(self, rank: int, stats: Optional[IOStats]) -> dict[str, dict[tuple[int, ...], Chunk]]:
        m = self.m
        ref = m.rank_indexes[rank]
        where = repr(keys.join(self.prefix, ref.name))
        try:
            data = await self.store.get(keys.join(self.prefix, ref.name))
        except NotFoundError:
            raise CorruptCheckpointError(f"rank index {where} (rank {rank}) is missing") from None
        if stats is not None:
            stats.add(len(data))
        if len(data) != ref.size or crc32c(data) != ref.crc32c:
            raise CorruptCheckpointError(f"rank index {where} (rank {rank}): size or crc32c differs from the manifest")
        if self._blobs is None:
            per: list[list[int]] = [[] for _ in m.rank_indexes]
            for i, b in enumerate(m.blobs):
                if b.rank < len(per):
                    per[b.rank].append(i)
            self._blobs, self._blob_sizes = per, [b.size for b in m.blobs]
        return rank_index.decode(data, where, attempt=m.attempt, rank=rank, blobs=self._blobs[rank],
                                 blob_sizes=self._blob_sizes, crc_block=m.crc_block)

    def overlapping(self, key: str, box: Box) -> list[tuple[Chunk, Box]]:
        e = self.m.tensors[key]
        if e.layout is None:
            idx = self._v1.get(key)
            if idx is None:
                check_coverage(e)
                idx = self._v1[key] = ChunkIndex(e.chunks)
            return idx.overlapping(box)
        isz = itemsize(dtype_from_name(e.dtype, key))
        out: list[tuple[Chunk, Box]] = []
        for rank, piece, _ in self._layout_pieces(key, box):
            for c in self._piece_chunks(rank, key, piece, isz):
                inter = intersect((c.offsets, c.shape), box) if c.shape else ((), ())
                if inter is not None:
                    out.append((c, inter))
        return out

    def _piece_chunks(self, rank: int, key: str, piece: Box, isz: int) -> list[Chunk]:
        """The chunks (rows of) ``piece`` is stored as in ``rank``'s index, checked to tile it."""
        idx = self._rank_idx.get((rank, key))
        if idx is None:
            idx = self._rank_idx[(rank, key)] = ChunkIndex(list(self._ranks[rank].get(key, {}).values()))
        found = [c for c, inter in idx.overlapping(piece)]
        inside = all(intersect((c.offsets, c.shape), piece) == (c.offsets, c.shape) or not c.shape for c in found)
        ok = inside and all(c.length == math.prod(c.shape) * isz for c in found)
        ok = ok and sum(math.prod(c.shape) for c in found) == math.prod(piece[1])
        if not ok or not found:
            raise CorruptCheckpointError(
                f"tensor {key!r}: the piece at {list(piece[0])} of shape {list(piece[1])} is not stored whole in "
                f"rank {rank}'s index ({self.m.rank_indexes[rank].name})"
            )
        return found

    async def resolve_all(self, stats: Optional[IOStats] = None) -> None:
        """List every chunk of every v2 tensor in ``m`` (tools that walk whole checkpoints)."""
        m = self.m
        await self.prefetch([], stats)
        missing = [r for r in range(len(m.rank_indexes)) if r not in self._ranks]
        got = await asyncio.gather(*(self._fetch(r, stats) for r in missing))
        self._ranks.update(zip(missing, got))
        for key, e in m.tensors.items():
            if e.layout is None or e.alias_of is not None:
                continue
            whole: Box = (tuple(0 for _ in e.shape), tuple(e.shape))
            e.chunks = sorted((c for c, _ in self.overlapping(key, whole)), key=lambda c: c.offsets)
