"""Strided shards (torch's ``_StridedShard``, FSDP2 x tensor parallel), exactly (pure).

FSDP2 on top of tensor parallel shards a weight on the "tp" mesh dim first and
on the "dp" mesh dim second, while DTensor reads placements left to right; torch
marks the first one ``_StridedShard(d, split_factor=sf)``: cut the current
extent of dim ``d`` into ``sf`` pieces (like ``torch.chunk``), cut each of them
into ``k`` pieces (``k`` the mesh dim's size), and give the mesh point at ``c``
the ``c``-th piece of each, concatenated.  A plain ``Shard(d)`` is the same
with ``sf = 1``.  Steps compose left to right on the *local* positions the
earlier steps left, which is how torch computes offsets
(``_compute_local_shape_and_global_offset``).

What a mesh point holds along one dim is therefore an ordered list of global
runs (start, length): usually one (then the local tensor is one box), in
general several (the local tensor is a grid of boxes, one per combination of
runs).  :func:`local_pieces` lists them; :func:`nested_order` finds, when one
exists, the order of mesh dims in which plain nested ``Shard`` placements give
every point exactly the same indices -- the usual FSDP2 x TP case, which a
symbolic save then records as plain ``Shard`` on a permuted mesh (no new format,
planning as fast as for ``Shard``).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .boxes import Box
from .symbolic import chunk_piece

Run = tuple[int, int]  # (global start, length) along one tensor dim


@dataclass(frozen=True)
class Step:
    """One sharding of a tensor dim: over a mesh dim of ``size`` points, split factor ``sf`` (1: plain Shard)."""

    size: int
    sf: int = 1


@dataclass(frozen=True)
class LocalPiece:
    """A box of the global tensor a mesh point holds, and where it sits in the local tensor."""

    box: Box
    local_offsets: tuple[int, ...]


def _select(runs: Sequence[Run], ranges: Sequence[Run]) -> list[Run]:
    """The global runs at local positions ``ranges`` ((start, length), in order) of ``runs``."""
    out: list[Run] = []
    starts = list(itertools.accumulate((ln for _, ln in runs), initial=0))
    for a, ln in ranges:
        b = a + ln
        for (s, n), p in zip(runs, starts):
            lo, hi = max(a, p), min(b, p + n)
            if hi > lo:
                out.append((s + lo - p, hi - lo))
    return out


def _merge(runs: Sequence[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for s, n in runs:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def dim_runs(n: int, steps: tuple[Step, ...], coords: tuple[int, ...]) -> tuple[Run, ...]:
    """The global runs, in local order, that the mesh point with ``coords`` (one per
    step) holds of a dim of size ``n``; adjacent runs merged, empty ones dropped."""
    runs: Sequence[Run] = ((0, n),)
    for st, c in zip(steps, coords):
        size = sum(ln for _, ln in runs)
        if st.sf <= 1:
            ranges = [chunk_piece(size, st.size, c)]
        else:
            ranges = []
            for j in range(st.sf):
                a, m = chunk_piece(size, st.sf, j)
                b, ln = chunk_piece(m, st.size, c)
                ranges.append((a + b, ln))
        runs = _merge(_select(runs, ranges))
    return _merge(runs)


def local_pieces(shape: Sequence[int], steps: Sequence[Sequence[Step]],
                 coords: Sequence[Sequence[int]]) -> list[LocalPiece]:
    """The boxes a mesh point holds: ``steps[d]`` / ``coords[d]`` are the shardings of
    tensor dim ``d`` (left to right) and the point's coordinate on each.  Empty when
    the point holds nothing; one box when its local tensor is one box of the global."""
    return list(_local_pieces(tuple(int(n) for n in shape), tuple(tuple(st) for st in steps),
                              tuple(tuple(int(c) for c in co) for co in coords)))


@functools.lru_cache(maxsize=16384)  # a model repeats its shapes layer after layer
def _local_pieces(shape: tuple[int, ...], steps: tuple[tuple[Step, ...], ...],
                  coords: tuple[tuple[int, ...], ...]) -> tuple[LocalPiece, ...]:
    per_dim = [dim_runs(int(n), tuple(st), tuple(co)) if st else ((0, int(n)),) if n else ()
               for n, st, co in zip(shape, steps, coords)]
    if any(not r for r in per_dim):
        return ()
    local_starts = [list(itertools.accumulate((ln for _, ln in r), initial=0)) for r in per_dim]
    out = []
    for combo in itertools.product(*(range(len(r)) for r in per_dim)):
        runs = [per_dim[d][i] for d, i in enumerate(combo)]
        out.append(LocalPiece((tuple(s for s, _ in runs), tuple(n for _, n in runs)),
                              tuple(local_starts[d][i] for d, i in enumerate(combo))))
    return tuple(out)


#: above this many points a dim's order is checked on a sample of them (see :func:`_dim_order`)
FULL_CHECK_POINTS = 64


def _sample(k: int) -> list[int]:
    """Coordinates along a mesh dim of size k where uneven splits differ: both ends and the middle."""
    return sorted({c for c in (0, 1, k // 2, k - 2, k - 1) if 0 <= c < k})


@functools.lru_cache(maxsize=4096)
def _dim_order(n: int, steps: tuple[Step, ...]) -> Optional[tuple[int, ...]]:
    """An order of ``steps`` in which plain nested chunking gives the mesh points
    the indices the strided rule gives them; None when there is none.

    Up to :data:`FULL_CHECK_POINTS` points every one is checked; beyond, a sample
    (the ends and middle of each mesh dim, where uneven splits differ), so a
    4,096-rank mesh costs what a small one does.  That is safe because this
    only *proposes* a description: every rank then checks its own box against
    it, and a save in which any rank disagrees lists its chunks instead
    (:func:`objckpt.save.describe.describe_symbolic`)."""
    sizes = tuple(s.size for s in steps)
    if math.prod(sizes) <= FULL_CHECK_POINTS:
        coords = list(itertools.product(*(range(k) for k in sizes)))
    else:
        coords = list(itertools.product(*(_sample(k) for k in sizes)))
    want = [dim_runs(n, steps, c) for c in coords]
    if any(len(w) > 1 for w in want):
        return None
    for order in itertools.permutations(range(len(steps))):
        ks = [sizes[i] for i in order]
        ok = True
        for c, w in zip(coords, want):
            # the point's piece under plain nested chunking, level by level: only the sampled
            # points are computed, not every piece of the dim (65,536 at 65,536 ranks)
            start, length = 0, n
            for i, k in zip(order, ks):
                a, length = chunk_piece(length, k, c[i])
                start += a
            got = ((start, length),) if length else ()
            if got != w:
                ok = False
                break
        if ok:
            return order
    return None


def nested_order(shape: Sequence[int], mesh_shape: Sequence[int],
                 shardings: Sequence[Optional[tuple[int, int]]]) -> Optional[tuple[int, ...]]:
    """A permutation of the mesh dims under which plain nested ``Shard`` placements
    hold what ``shardings`` hold (checked on a sample of points for big meshes:
    see :func:`_dim_order`), or None.

    ``shardings[m]``: (tensor dim, split factor) of mesh dim ``m``, None for
    Replicate.  The result ``perm`` says that new mesh dim ``p`` is old mesh dim
    ``perm[p]``; only mesh dims sharding the same tensor dim trade places, so
    the Replicate dims keep their order (and so the replica slots theirs)."""
    return _nested_order(tuple(int(n) for n in shape), tuple(int(k) for k in mesh_shape), tuple(shardings))


@functools.lru_cache(maxsize=16384)
def _nested_order(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                  shardings: tuple[Optional[tuple[int, int]], ...]) -> Optional[tuple[int, ...]]:
    perm = list(range(len(mesh_shape)))
    if math.prod(shape) == 0:  # nothing to hold: every order holds the same (nothing)
        return tuple(perm)
    by_dim: dict[int, list[int]] = {}
    for m, s in enumerate(shardings):
        if s is not None:
            by_dim.setdefault(s[0], []).append(m)
    for d, mds in by_dim.items():
        steps = tuple(Step(int(mesh_shape[m]), int(shardings[m][1])) for m in mds)  # type: ignore[index]
        if all(s.sf <= 1 for s in steps):
            continue
        order = _dim_order(int(shape[d]), steps)
        if order is None:
            return None
        for pos, i in zip(mds, order):
            perm[pos] = mds[i]
    return tuple(perm)


def local_shape(shape: Sequence[int], steps: Sequence[Sequence[Step]],
                coords: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The shape of the local tensor of the mesh point (empty pieces included)."""
    return tuple(sum(ln for _, ln in dim_runs(int(n), tuple(st), tuple(co))) if st else int(n)
                 for n, st, co in zip(shape, steps, coords))
