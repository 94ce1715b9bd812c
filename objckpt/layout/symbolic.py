"""The symbolic layout (format v2): placements instead of gathered boxes.

Every rank describes its state by DTensor placements (plain tensors:
replicated over the group); when the ranks' digests agree, each derives the
same ``split`` / ``rot`` per tensor and its own pieces, and writes its chunk
records to an index object of its own.  The manifest keeps the layouts, the
meshes and the index references, so it stays small at thousands of ranks.
Readers compute the pieces that overlap their boxes, and their writers,
fetch just those writers' indexes (each verified by size and crc32c), and
check that every piece is tiled by its chunks.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import pickle
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from ..checksum import crc32c
from ..errors import BlobMissingError, CorruptCheckpointError, NotFoundError
from ..format import rank_index
from ..format.tables import BlobTable, IndexTable, blob_columns
from ..format.dtypes import dtype_from_name, itemsize
from ..format.spread import Placement
from ..format.manifest import SEALED_VERSION, Blob, Chunk, ChunkRecord, Manifest, RankIndexRef, TensorEntry, ShardSpec
from ..planning.assign import RankWrites
from ..planning.boxes import Box, intersect
from ..planning.pack import PackLimits
from ..planning.read_plan import ChunkIndex, Overlap
from ..planning.tiling import describe, tiling_defect
from ..planning.symbolic import StoredPiece, SymbolicDescription, overlapping_pieces, plan_rank_writes_symbolic
from ..results import IOStats
from ..storage import ObjectStore
from .base import PLAN_CACHE, WRITER, ManifestCommon, RankOutcome, SaveLayout
from .gathered import InlineResolver


class SymbolicLayout(SaveLayout):
    version = 2

    def __init__(self, desc: SymbolicDescription, dtypes: dict[str, str], aliases: dict[str, str], tree: Any,
                 rank_trees: Optional[list[Any]]) -> None:
        self.desc = desc
        self.dtypes = dtypes
        self.aliases = aliases
        self.tree = tree
        self.rank_trees = rank_trees
        self.specs: dict[str, ShardSpec] = {}

    def plan(self, rank: int, boxes: dict[str, Box], limits: PackLimits) -> RankWrites:
        d = self.desc
        digest = hashlib.blake2b(d.digest + pickle.dumps((rank, limits)), digest_size=20).digest()
        self.specs, writes = PLAN_CACHE.get(
            digest, lambda: plan_rank_writes_symbolic(d.descs, d.meshes, boxes, rank, limits))
        return writes

    writes_index = True

    async def publish(self, records: list[ChunkRecord], blobs: list[Blob], store: ObjectStore, place: Placement,
                      attempt: str, rank: int, stats: IOStats) -> RankOutcome:
        """The records go to this rank's index object, not to rank 0."""
        name = place.index_name(attempt)
        data = rank_index.encode(attempt, rank, records)
        await store.put(place.key(name), data)
        stats.add(len(data))
        return RankOutcome(blobs=blobs, index=RankIndexRef(name, len(data), crc32c(data), place.bucket))

    def manifest(self, outcomes: list[RankOutcome], common: ManifestCommon) -> Manifest:
        by_key = {d.key: d for d in self.desc.descs}
        entries: dict[str, TensorEntry] = {}
        for k, dt in self.dtypes.items():
            if k in self.aliases:
                entries[k] = TensorEntry(k, dt, by_key[self.aliases[k]].shape, alias_of=self.aliases[k])
            else:
                entries[k] = TensorEntry(k, dt, by_key[k].shape, layout=self.specs[k])
        # the tables as columns, straight from the outcomes' rows: at 65,536 ranks rank 0 makes
        # no Blob or RankIndexRef for the manifest it writes
        blobs = BlobTable.from_rows([b for out in outcomes for b in out.blob_rows()], common.attempt)
        rows = []
        for rank, out in enumerate(outcomes):
            row = out.index_row()
            if row is None:
                raise CorruptCheckpointError(f"rank {rank} reported no index object")
            rows.append(row)
        refs = IndexTable.from_rows(rows, common.attempt)
        return Manifest(
            tensors=entries, blobs=blobs, tree=self.tree, metadata=common.metadata, attempt=common.attempt,
            world_size=len(outcomes), writer=WRITER, crc_block=common.crc_block, rank_trees=self.rank_trees,
            format_version=SEALED_VERSION, meshes=list(self.desc.meshes), rank_indexes=refs,
        )


class RankIndexResolver(InlineResolver):
    """Chunks listed in the writers' index objects (v2): ``prefetch`` fetches the
    indexes of the ranks that wrote a piece of what is wanted, and only those."""

    def __init__(self, m: Manifest, store: ObjectStore, prefix: str) -> None:
        super().__init__(m)
        self.store = store
        self.prefix = prefix
        self._ranks: dict[int, Mapping[str, dict[tuple[int, ...], Chunk]]] = {}
        self._ranks_col: Optional[np.ndarray] = None  # each blob's writer rank
        self._blob_sizes: list[int] = []
        self._pieces: dict[tuple[tuple[int, ...], ShardSpec, Box], list[StoredPiece]] = {}
        self._rank_idx: dict[tuple[int, str], ChunkIndex] = {}

    def _placed_pieces(self, key: str, box: Box) -> list[StoredPiece]:
        """The stored pieces overlapping ``box`` of tensor ``key``: a pure function of the
        tensor's shape, its shard spec (mesh included) and the box, so it is computed once
        per distinct triple.  A model's layers repeat the same few (shape, layout) pairs and
        a rank loads the same box of each: 2,892 tensors of a dense model are ~20 triples."""
        e = self.m.tensors[key]
        if e.layout is None:
            raise CorruptCheckpointError(f"tensor {key!r} has no layout in a format v2 manifest")
        memo = (e.shape, e.layout, box)
        hit = self._pieces.get(memo)
        if hit is None:
            hit = self._pieces[memo] = overlapping_pieces(e.shape, self.m.meshes[e.layout.mesh], e.layout, box)
        return hit

    async def prefetch(self, wanted: Iterable[tuple[str, Box]], stats: Optional[IOStats] = None) -> None:
        """Fetch the index objects of every rank that wrote a piece of ``wanted``."""
        need: set[int] = set()
        for key, box in wanted:
            if self.m.tensors[key].layout is not None:
                need.update(r for r, _, _ in self._placed_pieces(key, box))
        need -= set(self._ranks)
        if need:
            got = await asyncio.gather(*(self._fetch(r, stats) for r in sorted(need)))
            self._ranks.update(zip(sorted(need), got))

    async def _fetch(self, rank: int, stats: Optional[IOStats]) -> Mapping[str, dict[tuple[int, ...], Chunk]]:
        m = self.m
        ref = m.rank_indexes[rank]
        key = m.index_key(self.prefix, rank)
        where = repr(key)
        try:
            data = await self.store.get(key)
        except NotFoundError:
            raise BlobMissingError(f"rank index {where} (rank {rank}) is missing") from None
        if stats is not None:
            stats.add(len(data))
        if len(data) != ref.size or crc32c(data) != ref.crc32c:
            raise CorruptCheckpointError(f"rank index {where} (rank {rank}): size or crc32c differs from the manifest")
        if self._ranks_col is None:  # from the table's columns: no Blob made for the blobs of other ranks
            ranks, sizes = blob_columns(m.blobs)
            self._ranks_col, self._blob_sizes = np.asarray(ranks, dtype=np.int64), list(sizes)
        mine = np.flatnonzero(self._ranks_col == rank).tolist()  # this rank's blobs, in manifest order
        return rank_index.decode(data, where, attempt=m.attempt, rank=rank, blobs=mine,
                                 blob_sizes=self._blob_sizes, crc_block=m.crc_block,
                                 require_crc=m.format_version >= SEALED_VERSION, lazy=True)

    def overlapping(self, key: str, box: Box) -> list[Overlap]:
        e = self.m.tensors[key]
        if e.layout is None:
            return super().overlapping(key, box)
        isz = itemsize(dtype_from_name(e.dtype, key))
        out: list[Overlap] = []
        for rank, piece, _ in self._placed_pieces(key, box):
            for c in self._piece_chunks(rank, key, piece, isz):
                inter = intersect((c.offsets, c.shape), box) if c.shape else ((), ())
                if inter is not None:
                    out.append(Overlap(c, inter))
        return out

    def _piece_chunks(self, rank: int, key: str, piece: Box, isz: int) -> list[Chunk]:
        """The chunks (rows of) ``piece`` is stored as in ``rank``'s index, checked to tile it."""
        idx = self._rank_idx.get((rank, key))
        if idx is None:
            idx = self._rank_idx[(rank, key)] = ChunkIndex(list(self._ranks[rank].get(key, {}).values()))
        found = [c for c, inter in idx.overlapping(piece)]
        if len(found) == 1:  # the common case: the piece stored as one chunk, which tiles it if it is the piece
            c = found[0]
            if c.offsets == piece[0] and c.shape == piece[1] and c.length == math.prod(c.shape) * isz:
                return found
        bad = [c for c in found if c.length != math.prod(c.shape) * isz]
        defect = tiling_defect([(c.offsets, c.shape) for c in found], piece) if found else None
        if bad or defect is not None or not found:
            why = (f"the chunk at {list(bad[0].offsets)} has a length that does not match its shape" if bad
                   else describe(defect) if defect is not None else "no chunk holds it")
            raise CorruptCheckpointError(
                f"tensor {key!r}: the piece at {list(piece[0])} of shape {list(piece[1])} is not stored whole in "
                f"rank {rank}'s index ({self.m.rank_indexes[rank].name}): {why}"
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
