"""Who writes what in a multi-rank save (pure).

Every rank reports, per tensor key, the dtype, the global shape and the boxes
(global offsets + shape) it holds.  From the gathered reports every rank
computes the same assignment: a box held by one rank is written by it; a box
held by several ranks (replicated tensors, the replicated dimension of a
DTensor mesh) is written once — split along dim 0 across its holders when it is
large (replica-parallel save), else given whole to the least-loaded holder —
balancing bytes across ranks.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import StateDictMismatchError
from .boxes import Box
from .pack import PackLimits, SavePlan, pack_items


@dataclass(frozen=True)
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]  # global
    itemsize: int
    boxes: tuple[Box, ...]  # boxes this rank holds

    @classmethod
    def made(cls, dtype: str, shape: tuple[int, ...], itemsize: int, boxes: tuple[Box, ...]) -> "TensorMeta":
        """The same as ``TensorMeta(...)``, built without the frozen dataclass's one
        ``object.__setattr__`` per field: a save describes every tensor of the state."""
        m = object.__new__(cls)
        m.__dict__.update(dtype=dtype, shape=shape, itemsize=itemsize, boxes=boxes)
        return m


@dataclass(frozen=True)
class WriteItem:
    """Rows [row_start, row_end) (dim 0, relative to ``box``) of a box this rank holds."""

    key: str
    box: Box
    row_start: int
    row_end: int

    @classmethod
    def made(cls, key: str, box: Box, row_start: int, row_end: int) -> "WriteItem":
        """The same as ``WriteItem(...)``, built without the frozen dataclass's one
        ``object.__setattr__`` per field (see :meth:`TensorMeta.made`)."""
        it = object.__new__(cls)
        it.__dict__.update(key=key, box=box, row_start=row_start, row_end=row_end)
        return it

    @property
    def offsets(self) -> tuple[int, ...]:
        o, _ = self.box
        return (o[0] + self.row_start,) + tuple(o[1:]) if o else ()

    @property
    def shape(self) -> tuple[int, ...]:
        _, s = self.box
        return (self.row_end - self.row_start,) + tuple(s[1:]) if s else ()


def _volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def check_consistent(metas: Sequence[dict[str, TensorMeta]]) -> dict[str, TensorMeta]:
    """One (dtype, global shape) per key across ranks, and boxes that tile each tensor."""
    first: dict[str, tuple[int, TensorMeta]] = {}
    boxes: dict[str, set[Box]] = {}
    for rank, m in enumerate(metas):
        for key, t in m.items():
            if key not in first:
                first[key] = (rank, t)
            else:
                r0, t0 = first[key]
                if (t0.dtype, t0.shape) != (t.dtype, t.shape):
                    raise StateDictMismatchError(
                        f"tensor {key!r}: rank {r0} has {t0.dtype} {list(t0.shape)}, rank {rank} has "
                        f"{t.dtype} {list(t.shape)}"
                    )
            for off, shp in t.boxes:
                if shp == t.shape and len(off) == len(shp) and not any(off):
                    continue  # all of the tensor (a plain tensor: the common case) lies inside it
                if len(off) != len(t.shape) or any(o < 0 or o + s > d for o, s, d in zip(off, shp, t.shape)):
                    raise StateDictMismatchError(
                        f"tensor {key!r}: rank {rank}'s shard at {list(off)} of shape {list(shp)} lies outside "
                        f"the global shape {list(t.shape)}"
                    )
            got = boxes.get(key)
            if got is None:
                boxes[key] = set(t.boxes)
            else:
                got.update(t.boxes)
    for key, bs in boxes.items():
        t = first[key][1]
        if len(bs) == 1:
            (box,) = bs
            if box[1] == t.shape:  # one box of the whole shape (inside it, checked above): covers it
                continue
        covered = sum(_volume(s) for _, s in bs)
        if covered != _volume(t.shape):
            raise StateDictMismatchError(
                f"tensor {key!r}: the ranks' shards hold {covered} elements, the global shape "
                f"{list(t.shape)} has {_volume(t.shape)} (shards missing or overlapping)"
            )
    return {k: v for k, (_, v) in first.items()}


def assign_writes(
    metas: Sequence[dict[str, TensorMeta]], *, split_bytes: int = 4 << 20
) -> list[list[WriteItem]]:
    """Per rank, the pieces it writes; every element of every tensor exactly once."""
    world = len(metas)
    check_consistent(metas)
    if world == 1:  # every box has one holder: each written whole by rank 0, in (key, box) order
        pairs = [(key, box) for key, t in metas[0].items() for box in t.boxes]
        if any(len(t.boxes) > 1 for t in metas[0].values()):
            pairs = list(set(pairs))
        pairs.sort()
        made = WriteItem.made
        return [[made(key, box, 0, box[1][0] if box[1] else 1) for key, box in pairs]]
    holders: dict[tuple[str, Box], list[int]] = {}
    sizes: dict[tuple[str, Box], int] = {}
    for rank, m in enumerate(metas):
        for key, t in m.items():
            for box in t.boxes:
                holders.setdefault((key, box), []).append(rank)
                sizes[(key, box)] = _volume(box[1]) * t.itemsize
    load = [0] * world
    out: list[list[WriteItem]] = [[] for _ in range(world)]
    singles = [g for g, h in holders.items() if len(h) == 1]
    shared = [g for g, h in holders.items() if len(h) > 1]
    for g in sorted(singles):
        r = holders[g][0]
        _, (_, shape) = g
        out[r].append(WriteItem(g[0], g[1], 0, shape[0] if shape else 1))
        load[r] += sizes[g]
    # biggest first, each piece to the least-loaded holder (ties: lowest rank)
    for g in sorted(shared, key=lambda g: (-sizes[g], g)):
        key, box = g
        hs = holders[g]
        rows = box[1][0] if box[1] else 1
        n = max(1, min(len(hs), rows)) if sizes[g] >= split_bytes and box[1] else 1
        heap = [(load[r], r) for r in hs]
        heapq.heapify(heap)
        for i in range(n):
            r0, r1 = rows * i // n, rows * (i + 1) // n
            _, r = heapq.heappop(heap)
            out[r].append(WriteItem(key, box, r0, r1))
            load[r] += sizes[g] * (r1 - r0) // max(rows, 1)
    return out


@dataclass(frozen=True)
class RankWrites:
    """What one rank writes in a save: its write items and their blob layout."""

    items: list[WriteItem]
    plan: SavePlan


def plan_rank_writes(metas: Sequence[dict[str, TensorMeta]], rank: int, limits: PackLimits) -> RankWrites:
    """This rank's writes and their blob layout, from every rank's boxes."""
    items = assign_writes(metas)[rank]
    sizes = {k: t.itemsize for m in metas for k, t in m.items()}
    return RankWrites(items, pack_items(items, sizes, limits))
