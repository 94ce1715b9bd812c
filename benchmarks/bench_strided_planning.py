"""Planning cost of ``_StridedShard`` (FSDP2 x TP) against plain ``Shard``, without I/O.

    python -m benchmarks.bench_strided_planning --worlds 1024,4096

The 70B + Adam state of :mod:`benchmarks.planning_model` on a (world/8, 8) ("dp", "tp")
mesh. Its column-wise tensors are placed two ways: ``(Shard(0), Shard(0))`` (the
baseline) and torchtitan's ``(_StridedShard(0, sf=8), Shard(0))``. For one rank, cold
caches, CPU seconds of what a symbolic save and load compute: this rank's boxes
(``cell_box``, or :func:`objckpt.planning.strided.local_pieces` for strided), the
description (strided: :func:`~objckpt.planning.strided.nested_order` and the permuted
mesh), ``plan_rank_writes_symbolic``, and on load ``overlapping_pieces`` for every
tensor. Prints both times and their ratio.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from .planning_model import PLACEMENTS, internals, llama_defs


def plan_one(defs: list, world: int, tp: int, rank: int, strided: bool) -> float:
    from objckpt.planning import strided as sp

    ock = internals()
    sp.dim_runs.cache_clear()
    sp._dim_order.cache_clear()
    sp._local_pieces.cache_clear()
    sp._nested_order.cache_clear()
    t0 = time.process_time()
    dp = world // tp
    grid = [[r * tp + c for c in range(tp)] for r in range(dp)]  # (dp, tp) mesh, row-major ranks
    flat = ock.Mesh((world,), tuple(range(world)))
    base = ock.Mesh((dp, tp), tuple(r for row in grid for r in row))
    meshes = [flat, base]
    coord = (rank // tp, rank % tp)
    base_ranks = [r for row in grid for r in row]
    swapped_ranks = [grid[r][c] for c in range(tp) for r in range(dp)]
    descs, boxes = [], {}
    by_perm: dict = {}
    for d in defs:
        pl: tuple[str, ...]
        kind = PLACEMENTS[d.kind]
        if kind is None:
            mid, pl = 0, ("R",)
            boxes[d.key] = ock.cell_box(d.shape, flat.shape, pl, (rank,))
        elif strided and d.kind == "col":
            shardings = [(0, tp), (0, 1)]  # _StridedShard(0, sf=tp) on dp, Shard(0) on tp
            pieces = sp.local_pieces(d.shape, [[sp.Step(dp, tp), sp.Step(tp, 1)]] + [[] for _ in d.shape[1:]],
                                     [list(coord)] + [[] for _ in d.shape[1:]])
            perm = sp.nested_order(d.shape, (dp, tp), shardings)
            assert perm == (1, 0), perm
            # the permuted mesh's ranks, per tensor as objckpt's mesh_description lists them;
            # the Mesh itself is made once per (mesh, permutation), as describe_symbolic does
            ranks = list(swapped_ranks)
            if perm not in by_perm:
                by_perm[perm] = len(meshes)
                meshes.append(ock.Mesh((tp, dp), tuple(ranks)))
            mid, pl = by_perm[perm], ("S0", "S0")
            rule = ock.cell_box(d.shape, meshes[mid].shape, pl, meshes[mid].coordinate(rank))
            assert (pieces[0].box == rule) if pieces else 0 in rule[1], (d.key, pieces, rule)
            boxes[d.key] = rule
        else:
            ranks = list(base_ranks)  # as mesh_description lists them (``tolist()``), per tensor
            mid = 1
            pl = tuple("R" if p[0] == "R" else f"S{p[1]}" for p in kind)
            boxes[d.key] = ock.cell_box(d.shape, base.shape, pl, coord)
        descs.append(ock.TensorDesc(d.key, tuple(d.shape), d.itemsize, mid, pl))
    layouts, _ = ock.plan_rank_writes_symbolic(descs, meshes, boxes, rank, ock.limits)
    memo: dict = {}
    for t in descs:  # load at the same layout: every tensor's stored pieces that overlap this rank's box
        ock.overlapping_pieces(t.shape, meshes[t.mesh], layouts[t.key], boxes[t.key], memo)
    return time.process_time() - t0


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="1024,4096")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    defs, _ = llama_defs()
    for world in (int(w) for w in args.worlds.split(",")):
        rank = world // 2 + 3
        shard = min(plan_one(defs, world, args.tp, rank, False) for _ in range(args.repeat))
        strided = min(plan_one(defs, world, args.tp, rank, True) for _ in range(args.repeat))
        print(f"world {world:5d} ({world // args.tp}x{args.tp}): Shard {shard:.3f} s, "
              f"_StridedShard {strided:.3f} s, ratio {strided / shard:.2f}")


if __name__ == "__main__":
    main()
