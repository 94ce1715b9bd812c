"""Symbolic placements: who holds and who wrote which box, computed, not listed (pure).

A DTensor's placements on a DeviceMesh (or "replicated on every rank" for a
plain tensor) determine every rank's box.  When every rank of a save describes
its state the same way, the ranks only need to agree on a digest of that
description: each one derives the global write assignment from it, and the
manifest stores the description instead of one record per rank and tensor.
That is what keeps planning and the manifest small at thousands of ranks
(format v2, ``docs/format.md``).

Rules (normative for format v2):

* ``Shard(d)`` on mesh dims m1 < m2 < ... splits tensor dim d left to right,
  each level like ``torch.chunk``: pieces of ceil(n / k), the last ones smaller
  or empty.  The piece of a rank along dim d is the row-major index of its
  coordinates on (m1, m2, ...).  This is torch's own DTensor rule.
* A *cell* is the box a mesh coordinate holds; the ranks that differ only on
  ``Replicate`` mesh dims hold the same cell (its replica group, ordered
  row-major over the Replicate dims: the *slot*).
* A cell is stored as ``split`` pieces along dim 0: piece i holds rows
  [r*i // split, r*(i+1) // split) of the cell's r rows (0-d: one piece); empty
  pieces are not stored.  Piece i is written by the replica in slot
  (i + rot) mod g, g being the group's size.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence

from ..format.manifest import Mesh, ShardSpec
from .assign import RankWrites, WriteItem
from .boxes import Box, intersect
from .pack import PackLimits, pack_items

REPLICATE = "R"


def parse_placement(p: str) -> Optional[int]:
    """The sharded tensor dim of a placement string, None for Replicate."""
    if p == REPLICATE:
        return None
    if len(p) >= 2 and p[0] == "S" and p[1:].isdigit():
        return int(p[1:])
    raise ValueError(f"unknown placement {p!r}")


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def ravel(coord: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for c, n in zip(coord, shape):
        flat = flat * n + c
    return flat


def chunk_piece(n: int, k: int, i: int) -> tuple[int, int]:
    """(start, length) of piece i when ``torch.chunk`` cuts n into k (may be empty)."""
    full = -(-n // k) if k else n
    start = min(n, full * i)
    return start, max(0, min(n, start + full) - start)


def dim_intervals(n: int, ks: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Starts and lengths of the pieces of a dim of size n split by nested
    ``torch.chunk`` levels of sizes ``ks``, in row-major piece order."""
    pieces = [(0, n)]
    for k in ks:
        nxt = []
        for s, m in pieces:
            for i in range(k):
                a, ln = chunk_piece(m, k, i)
                nxt.append((s + a, ln))
        pieces = nxt
    return tuple(p[0] for p in pieces), tuple(p[1] for p in pieces)


def _sharding(ndim: int, placements: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """Per tensor dim, the mesh dims sharding it (in order); and the Replicate mesh dims."""
    per_dim: list[list[int]] = [[] for _ in range(ndim)]
    rep = []
    for md, p in enumerate(placements):
        d = parse_placement(p)
        if d is None:
            rep.append(md)
        else:
            if d >= ndim:
                raise ValueError(f"placement {p} on a {ndim}-d tensor")
            per_dim[d].append(md)
    return per_dim, rep


def cell_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str],
             coord: Sequence[int]) -> Box:
    """The box the mesh point ``coord`` holds."""
    per_dim, _ = _sharding(len(shape), placements)
    offs, lens = [], []
    for d, n in enumerate(shape):
        mds = per_dim[d]
        if not mds:
            offs.append(0)
            lens.append(n)
            continue
        s, m = 0, n
        for md in mds:
            a, m = chunk_piece(m, mesh_shape[md], coord[md])
            s += a
        offs.append(s)
        lens.append(m)
    return tuple(offs), tuple(lens)


def group_size(mesh_shape: Sequence[int], placements: Sequence[str]) -> int:
    return math.prod(mesh_shape[md] for md, p in enumerate(placements) if p == REPLICATE)


def slot_of(mesh_shape: Sequence[int], placements: Sequence[str], coord: Sequence[int]) -> int:
    rep = [md for md, p in enumerate(placements) if p == REPLICATE]
    return ravel([coord[md] for md in rep], [mesh_shape[md] for md in rep])


def piece_rows(rows: int, split: int, i: int) -> tuple[int, int]:
    return rows * i // split, rows * (i + 1) // split


def _piece_box(offs: tuple[int, ...], shp: tuple[int, ...], split: int, i: int) -> "Box | None":
    """Piece ``i`` of the cell (offs, shp) split along dim 0 into ``split`` pieces; None when empty."""
    a, b = piece_rows(shp[0], split, i)
    return ((offs[0] + a,) + offs[1:], (b - a,) + shp[1:]) if b > a else None


def cell_pieces(box: Box, split: int) -> Iterator[tuple[int, Box]]:
    """(piece index, piece box) of a cell's stored pieces (empty ones skipped): those
    overlapping all of its rows."""
    offs, shp = box
    lo = offs[0] if shp else 0
    yield from pieces_overlapping_rows(box, split, lo, lo + (shp[0] if shp else 1))


def my_pieces(shape: Sequence[int], mesh: Mesh, lay: ShardSpec, rank: int) -> list[Box]:
    """The pieces ``rank`` writes of a tensor (possibly none).

    Only the pieces of this rank's slot are visited (i = slot - rot mod g, then
    every g-th), not all ``split`` pieces of the cell: a tensor split over a
    replica group of thousands costs each rank O(1), not O(group)."""
    coord = mesh.coordinate(rank)
    if coord is None:
        return []
    g = group_size(mesh.shape, lay.placements)
    slot = slot_of(mesh.shape, lay.placements, coord)
    offs, shp = cell_box(shape, mesh.shape, lay.placements, coord)
    if any(n == 0 for n in shp):
        return []
    if not shp:
        return [(offs, shp)] if (lay.rot % g) == slot else []
    out = []
    for i in range((slot - lay.rot) % g, lay.split, g):
        piece = _piece_box(offs, shp, lay.split, i)
        if piece is not None:
            out.append(piece)
    return out


def pieces_overlapping_rows(box: Box, split: int, lo: int, hi: int) -> Iterator[tuple[int, Box]]:
    """(piece index, piece box) of the stored pieces of the cell ``box`` whose rows meet
    the global rows [lo, hi): the first candidate is computed, not searched for, so the
    cost is the number of pieces returned, not ``split``."""
    offs, shp = box
    if any(n == 0 for n in shp):
        return
    if not shp:
        yield 0, box
        return
    rows = shp[0]
    a = max(0, lo - offs[0])
    # piece i holds rows [rows*i // split, rows*(i+1) // split): the piece holding row a is >= a*split // rows
    for i in range(a * split // rows, split):
        r0, r1 = piece_rows(rows, split, i)
        if offs[0] + r0 >= hi:
            break
        if r1 > r0 and r1 > a:
            yield i, ((offs[0] + r0,) + offs[1:], (r1 - r0,) + shp[1:])


def dim_overlaps(n: int, ks: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], int, int]]:
    """(coordinates on the sharding mesh dims, start, length) of the non-empty pieces of a
    dim of size ``n``, split by nested ``torch.chunk`` levels of sizes ``ks``, that meet
    [lo, hi), in row-major order.  Each level's candidates are found by division, so
    the cost is (levels x pieces returned), whatever the mesh size: what
    :func:`dim_intervals` would list in full."""
    out: list[tuple[tuple[int, ...], int, int]] = []

    def walk(level: int, coord: tuple[int, ...], start: int, size: int) -> None:
        if level == len(ks):
            out.append((coord, start, size))
            return
        k = ks[level]
        full = -(-size // k)
        for i in range(max(0, (lo - start) // full), k):
            a, ln = chunk_piece(size, k, i)
            if ln == 0 or start + a >= hi:
                break  # the rest are empty or past the range
            if start + a + ln > lo:
                walk(level + 1, coord + (i,), start + a, ln)

    if n > 0 and hi > lo:
        walk(0, (), 0, n)
    return out


class StoredPiece(NamedTuple):
    """A stored piece of a tensor that overlaps a wanted box."""

    writer: int  # the rank that wrote it
    piece: Box
    inter: Box  # its intersection with the wanted box


Intervals = dict[tuple[int, tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def overlapping_pieces(shape: Sequence[int], mesh: Mesh, lay: ShardSpec, box: Box,
                       memo: Optional[Intervals] = None) -> list[StoredPiece]:
    """(writer rank, stored piece box, intersection with ``box``) of every stored
    piece overlapping ``box``: per dim the overlapping cells by division
    (:func:`dim_overlaps`), then the overlapping pieces of each cell, so the cost
    is the number of overlapping pieces, not of ranks or of pieces per cell.
    ``memo`` is accepted for older callers and not needed."""
    ndim = len(shape)
    per_dim, rep = _sharding(ndim, lay.placements)
    mshape = mesh.shape
    g = math.prod(mshape[md] for md in rep)
    if any(n == 0 for n in box[1]):
        return []
    choices: list[list[tuple[tuple[int, ...], int, int]]] = []  # per dim: (coords on its mesh dims, start, len)
    for d in range(ndim):
        opts = dim_overlaps(shape[d], tuple(mshape[md] for md in per_dim[d]), box[0][d], box[0][d] + box[1][d])
        if not opts:
            return []
        choices.append(opts)
    rep_shape = [mshape[md] for md in rep]
    lo, hi = (box[0][0], box[0][0] + box[1][0]) if ndim else (0, 1)
    out: list[StoredPiece] = []
    for combo in itertools.product(*choices):
        coord = [0] * len(mshape)
        for d, (sub, _, _) in enumerate(combo):
            for md, c in zip(per_dim[d], sub):
                coord[md] = c
        cell = (tuple(c[1] for c in combo), tuple(c[2] for c in combo))
        for i, piece in pieces_overlapping_rows(cell, lay.split, lo, hi):
            inter = intersect(piece, box) if ndim else ((), ())
            if inter is None:
                continue
            rcoord = unravel((i + lay.rot) % g, rep_shape)
            for md, c in zip(rep, rcoord):
                coord[md] = c
            out.append(StoredPiece(mesh.ranks[ravel(coord, mshape)], piece, inter))
    return out


@dataclass(frozen=True)
class TensorDesc:
    """What every rank knows of a tensor in a symbolic save."""

    key: str
    shape: tuple[int, ...]
    itemsize: int
    mesh: int
    placements: tuple[str, ...]


@dataclass(frozen=True)
class SymbolicDescription:
    """A rank's state described symbolically: the same on every rank of a
    symbolic save, which the ranks check by exchanging only ``digest``."""

    descs: list[TensorDesc]
    meshes: list[Mesh]
    digest: bytes


def assign_shard_specs(descs: Sequence[TensorDesc], meshes: Sequence[Mesh], *,
                       split_bytes: int = 4 << 20, small_spread: int = 8, tiny_bytes: int = 64 << 10) -> dict[str, ShardSpec]:
    """``split`` and ``rot`` of every tensor, the same on every rank.

    A cell of at least ``split_bytes`` is split over its replicas (replica-
    parallel save); a smaller one goes whole to the replica slot that has the
    fewest bytes so far (per group size), so small replicated tensors spread
    over the replicas instead of piling onto the first one -- but only over
    the first ``small_spread`` slots: a reader fetches the index object of
    every rank that wrote a piece it needs, and hundreds of tiny replicated
    tensors (optimizer steps, norms) spread over a thousand ranks would make
    every reader fetch a thousand index objects for a few kilobytes.  Cells
    under ``tiny_bytes`` (optimizer steps, norm weights) all go to slot 0:
    writing them costs nothing, and readers then find them in few indexes.
    """
    heaps: dict[int, list[tuple[int, int]]] = {}
    loads: dict[int, list[int]] = {}
    out: dict[str, ShardSpec] = {}
    for t in descs:
        mesh = meshes[t.mesh]
        g = group_size(mesh.shape, t.placements)
        if g == 1:
            out[t.key] = ShardSpec(t.mesh, t.placements)
            continue
        per_dim, _ = _sharding(len(t.shape), t.placements)
        ncells = math.prod(mesh.shape[md] for mds in per_dim for md in mds)
        big = cell_box(t.shape, mesh.shape, t.placements, [0] * len(mesh.shape))[1]  # the first cell is the largest
        nbytes = math.prod(big) * t.itemsize
        rows = big[0] if big else 1
        if g not in loads:
            loads[g] = [0] * g
            heaps[g] = [(0, s) for s in range(g)]
        load, heap = loads[g], heaps[g]
        split = max(1, min(g, rows)) if nbytes >= split_bytes and t.shape else 1
        if split == 1:
            rot = 0 if nbytes < tiny_bytes else min(range(min(g, small_spread)), key=load.__getitem__)
        else:
            while True:  # lazy heap: skip stale entries
                ld, rot = heap[0]
                if ld == load[rot]:
                    break
                heapq.heappop(heap)
        for i in range(split):
            a, b = piece_rows(rows, split, i)
            s = (i + rot) % g
            load[s] += nbytes * (b - a) // max(rows, 1) * ncells
            heapq.heappush(heap, (load[s], s))
        out[t.key] = ShardSpec(t.mesh, t.placements, split, rot)
    return out


def plan_rank_writes_symbolic(descs: Sequence[TensorDesc], meshes: Sequence[Mesh], boxes: dict[str, Box],
                              rank: int, limits: PackLimits) -> tuple[dict[str, ShardSpec], RankWrites]:
    """Every tensor's shard spec (the same on every rank) and this rank's writes.

    ``boxes`` are this rank's local boxes, which the pieces are rows of."""
    specs = assign_shard_specs(descs, meshes)
    own: list[WriteItem] = []
    shared: list[WriteItem] = []  # pieces of replicated cells: many ranks read them
    for t in descs:
        g = group_size(meshes[t.mesh].shape, t.placements)
        for p_off, p_shape in my_pieces(t.shape, meshes[t.mesh], specs[t.key], rank):
            box = boxes[t.key]
            r0 = p_off[0] - box[0][0] if p_off else 0
            (own if g == 1 else shared).append(WriteItem(t.key, box, r0, r0 + (p_shape[0] if p_shape else 1)))
    # replicated pieces packed together after this rank's own shards, so a
    # reader that needs them all (every rank, for plain tensors) gets them in
    # one merged range instead of one small range per tensor
    items = own + shared
    return specs, RankWrites(items, pack_items(items, {t.key: t.itemsize for t in descs}, limits))
