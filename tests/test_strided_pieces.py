"""What a rank holds of a DTensor with ``_StridedShard`` placements, checked against torch itself.

torch's own splitting code (each placement's ``_split_tensor``, applied left to
right as DTensor does) is the reference for which global elements a mesh point
holds and in what local order; ``_compute_local_shape_and_global_offset`` for
the local shape and first offset.  Meshes, split factors and uneven sizes are
drawn by Hypothesis.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from objckpt.planning.strided import Step, local_pieces, local_shape, nested_order
from objckpt.planning.symbolic import cell_box


def torch_local(g: torch.Tensor, mesh: tuple[int, ...], placements: list[Any], coord: tuple[int, ...]) -> torch.Tensor:
    """The local tensor DTensor gives ``coord``: torch's splitting, left to right."""
    t = g
    for md, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh[md], with_padding=False)[0][coord[md]]
    return t


def our_local(g: torch.Tensor, mesh: tuple[int, ...], placements: list[Any], coord: tuple[int, ...]) -> torch.Tensor:
    """The same local tensor assembled from :func:`local_pieces`: each box of ``g`` at its local offsets."""
    steps: list[list[Step]] = [[] for _ in g.shape]
    coords: list[list[int]] = [[] for _ in g.shape]
    for md, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            steps[p.dim].append(Step(mesh[md], int(p.split_factor) if isinstance(p, _StridedShard) else 1))
            coords[p.dim].append(coord[md])
    pieces = local_pieces(tuple(g.shape), steps, coords)
    shape = local_shape(tuple(g.shape), steps, coords)
    out = torch.full(shape, -1, dtype=g.dtype)
    for pc in pieces:
        src = g[tuple(slice(o, o + n) for o, n in zip(*pc.box))]
        out[tuple(slice(o, o + n) for o, n in zip(pc.local_offsets, pc.box[1]))] = src
    return out


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    ndim = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(0, 13)) for _ in range(ndim))
    mesh = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3))))
    placements: list[Any] = []
    for _ in mesh:
        kind = draw(st.sampled_from(["R", "S", "SS"]))
        d = draw(st.integers(0, ndim - 1))
        placements.append(Replicate() if kind == "R" else Shard(d) if kind == "S"
                          else _StridedShard(d, split_factor=draw(st.integers(1, 4))))
    return shape, mesh, placements


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_pieces_match_torch_on_every_mesh_point(layout: tuple[tuple[int, ...], tuple[int, ...], list[Any]]) -> None:
    shape, mesh, placements = layout
    g = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    seen = torch.zeros(math.prod(shape), dtype=torch.int64)
    for coord in itertools.product(*(range(k) for k in mesh)):
        want = torch_local(g, mesh, placements, coord)
        got = our_local(g, mesh, placements, coord)
        assert tuple(got.shape) == tuple(want.shape) and torch.equal(got, want), (shape, mesh, placements, coord)
        lshape, loff = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
        assert tuple(lshape) == tuple(want.shape)
        if want.numel():  # torch's offset is the first element it holds, per dim
            first = want.reshape(-1)[0].item()
            assert tuple(loff) == tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shape))
        if all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate)):
            seen[want.reshape(-1)] += 1
    assert bool((seen == 1).all()), "the points' pieces must hold every element exactly once"


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_nested_order_holds_the_same_boxes_as_the_strided_rule(
        layout: tuple[tuple[int, ...], tuple[int, ...], list[Any]]) -> None:
    """Where a permutation exists, plain Shard on the permuted mesh (what a symbolic
    save records) gives every point exactly its strided pieces."""
    shape, mesh, placements = layout
    shardings = [None if isinstance(p, Replicate) else
                 (p.dim, int(p.split_factor) if isinstance(p, _StridedShard) else 1) for p in placements]
    perm = nested_order(shape, mesh, shardings)
    g = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    plain = tuple("R" if s is None else f"S{s[0]}" for s in shardings)
    points = list(itertools.product(*(range(k) for k in mesh)))
    wants = [torch_local(g, mesh, placements, c) for c in points]

    def reproduces(order: tuple[int, ...]) -> bool:
        pmesh, pplain = tuple(mesh[i] for i in order), tuple(plain[i] for i in order)
        for coord, want in zip(points, wants):
            off, shp = cell_box(shape, pmesh, pplain, tuple(coord[i] for i in order))
            got = g[tuple(slice(o, o + n) for o, n in zip(off, shp))]
            if not torch.equal(got, want) and (got.numel() or want.numel()):  # empty: the same nothing
                return False
        return True

    if perm is None:  # no order of the mesh dims does it (brute force agrees)
        assert not any(reproduces(o) for o in itertools.permutations(range(len(mesh))))
    else:
        assert sorted(perm) == list(range(len(mesh))) and reproduces(perm), perm


def _boxes(shape: tuple[int, ...], mesh: tuple[int, ...], placements: list[Any], coord: tuple[int, ...]) -> list[Any]:
    steps: list[list[Step]] = [[] for _ in shape]
    coords: list[list[int]] = [[] for _ in shape]
    for md, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            steps[p.dim].append(Step(mesh[md], int(p.split_factor) if isinstance(p, _StridedShard) else 1))
            coords[p.dim].append(coord[md])
    return local_pieces(shape, steps, coords)


def test_fsdp2_tp_is_plain_shard_on_the_swapped_mesh() -> None:
    """torchtitan's 2-D layout: (_StridedShard(0, sf=tp), Shard(0)) on ("dp", "tp")
    is Shard(0), Shard(0) on ("tp", "dp"), uneven sizes included."""
    for n in (8, 10, 7, 5):
        assert nested_order((n, 6), (2, 2), [(0, 2), (0, 1)]) == (1, 0)
    assert nested_order((16, 4), (2, 4), [(0, 4), (0, 1)]) == (1, 0)
    assert nested_order((8, 6), (2, 2), [(0, 1), (1, 1)]) == (0, 1)  # no strided dim: unchanged
    assert nested_order((1, 6), (2, 2), [(0, 2), (0, 1)]) == (0, 1)  # one row: the mesh as it is does it too
    assert nested_order((8,), (2,), [(0, 2)]) is None  # _StridedShard alone: each rank holds two boxes
