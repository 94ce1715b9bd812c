"""Planning at scale with symbolic layouts (format v2), without I/O.

    python -m benchmarks.bench_planning --worlds 256,1024,4096 --out benchmarks/results/planning_symbolic.json

The 70B + Adam state of :mod:`benchmarks.planning_model` (FSDP x TP on (world/tp, tp)), loaded
into half as many ranks. Runs objckpt's own functions on the path a symbolic multi-rank save and
load take, for two sample ranks (rank 0 and a middle one), in CPU seconds:

save: torch's ``compute_local_shape_and_global_offset`` for every tensor (what a real rank runs,
on a fake process group); the description (placements, mesh, ``cell_box``, digest); the tree
digest; unpickling every rank's first-round payload; ``SymbolicLayout.plan`` on a cache miss
and a hit; this rank's index object (``rank_index.encode``, random crcs) and its size. Rank 0
also unpickles every rank's outcome, runs ``SymbolicLayout.manifest`` + ``encode``; the manifest's size.

load: ``manifest.decode``; ``RankIndexResolver.prefetch`` (the rank indexes this rank needs, from an
in-memory store, checked and decoded); ``overlapping`` + ``plan_piece`` for every tensor it holds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
from typing import Any

from . import harness as h
from .planning_model import (ATTEMPT, CRC_BLOCK, PLACEMENTS, Timer, chunk_records,
                             encoded_tree, internals, llama_defs, log, set_clock, torch_boxes)


def describe(defs: list, mesh_shape: tuple[int, int], rank: int) -> tuple[list, list, bytes, dict]:
    """What ``save()`` describes on one rank: tensor descriptions, meshes, digest, boxes by layout rule."""
    ock = internals()
    world = mesh_shape[0] * mesh_shape[1]
    meshes = [ock.Mesh((world,), tuple(range(world))), ock.Mesh(mesh_shape, tuple(range(world)))]
    descs, boxes = [], {}
    for d in defs:
        pl = ("R",) if PLACEMENTS[d.kind] is None else tuple(
            "R" if p[0] == "R" else f"S{p[1]}" for p in PLACEMENTS[d.kind])  # type: ignore[union-attr]
        mid = 0 if PLACEMENTS[d.kind] is None else 1
        boxes[d.key] = ock.cell_box(d.shape, meshes[mid].shape, pl, meshes[mid].coordinate(rank))
        descs.append(ock.TensorDesc(d.key, tuple(d.shape), d.itemsize, mid, pl))
    dtypes = {d.key: d.dtype for d in defs}
    digest = hashlib.blake2b(pickle.dumps(([(t, dtypes[t.key]) for t in descs], meshes, [], sorted(dtypes.items()))),
                             digest_size=20).digest()
    return descs, meshes, digest, boxes


def rank_index(descs: list, meshes: list, digest: bytes, rank: int, rng: random.Random) -> tuple[bytes, list[int]]:
    """This rank's index object (its chunk records, random crcs) and its blob sizes."""
    ock = internals()
    boxes = {t.key: ock.cell_box(t.shape, meshes[t.mesh].shape, t.placements, meshes[t.mesh].coordinate(rank))
             for t in descs}
    _, w = ock.plan_rank_writes_symbolic(descs, meshes, boxes, rank, ock.limits)
    return ock.rank_index.encode(ATTEMPT, rank, chunk_records(w.items, w.plan, rng)), [b.size for b in w.plan.blobs]


def layout(defs: list, tree: Any, descs: list, meshes: list, digest: bytes) -> Any:
    """The ``SymbolicLayout`` a save holds once the ranks' digests agreed."""
    ock = internals()
    return ock.SymbolicLayout(ock.SymbolicDescription(descs, meshes, digest), {d.key: d.dtype for d in defs}, {}, tree,
                              None)


def save_side(defs: list, tree: Any, mesh_shape: tuple[int, int], rank: int, rng: random.Random) -> dict[str, Any]:
    ock = internals()
    world = mesh_shape[0] * mesh_shape[1]
    r: dict[str, Any] = {"torch_local_boxes_s": torch_boxes(defs, mesh_shape, rank)[1]}
    with Timer() as t:
        descs, meshes, digest, boxes = describe(defs, mesh_shape, rank)
    r["describe_s"] = t.t
    with Timer() as t:
        tdig = ock._tree_digest(tree)
    r["tree_digest_s"] = t.t
    payloads = [pickle.dumps((digest, tdig, False, ATTEMPT if i == 0 else "", None)) for i in range(world)]
    with Timer() as t:
        for p in payloads:
            pickle.loads(p)
    r["round1_unpickle_s"], r["round1_bytes_total"] = t.t, sum(map(len, payloads))
    ock.PLAN_CACHE._plans.clear()
    lay = layout(defs, tree, descs, meshes, digest)
    for case in ("miss", "hit"):
        with Timer() as t:
            plan = lay.plan(rank, boxes, ock.limits).plan
        r[f"plan_{case}_s"] = t.t
    with Timer() as t:
        idx, _ = rank_index(descs, meshes, digest, rank, rng)
    r.update(index_s=t.t, index_bytes=len(idx), chunks=len(plan.chunks), bytes_written=sum(b.size for b in plan.blobs))
    r["per_rank_s"] = sum(r[k] for k in ("torch_local_boxes_s", "describe_s", "tree_digest_s", "round1_unpickle_s",
                                         "plan_miss_s", "index_s"))
    log(f"world {world} save rank {rank}: {r['per_rank_s']:.2f} s (plan miss {r['plan_miss_s']:.2f} s, "
        f"index {len(idx) / 1e3:.0f} KB)")
    return r


def run(world: int, tp: int, load_ratio: float, seed: int = 0) -> dict[str, Any]:
    ock = internals()
    run_ = ock._runtime.run
    rng = random.Random(seed)
    defs, state = llama_defs()
    tree = encoded_tree(state)
    mesh_shape = (world // tp, tp)
    mid = world // 2 + 3
    out: dict[str, Any] = {"world": world, "tensors": len(defs), "mesh": list(mesh_shape), "load": {},
                           "save": {rank: save_side(defs, tree, mesh_shape, rank, rng) for rank in (0, mid)}}
    # the load's target layout, and the ranks whose index objects its sample ranks need
    lw = int(world * load_ratio)
    descs, meshes, digest, _ = describe(defs, mesh_shape, 0)
    layouts = ock.assign_layouts(descs, meshes)
    lmeshes = [ock.Mesh((lw,), tuple(range(lw))), ock.Mesh((lw // tp, tp), tuple(range(lw)))]
    targets_of: dict[int, list] = {}
    need: set[int] = set()
    for lr in (0, lw // 2 + 3):
        targets_of[lr] = []
        for t in descs:
            m = lmeshes[t.mesh]
            box = ock.cell_box(t.shape, m.shape, t.placements, m.coordinate(lr))
            targets_of[lr].append((t.key, box))
            need.update(w for w, _, _ in ock.overlapping_pieces(t.shape, meshes[t.mesh], layouts[t.key], box))
    log(f"world {world}: generating {len(need)} rank indexes the sample load ranks need")
    store = ock.MemoryStore()
    refs: dict[int, tuple[int, int, list[int]]] = {}
    for w in sorted(need | {0, mid}):
        data, sizes = rank_index(descs, meshes, digest, w, rng)
        run_(store.put(ock.keys.join("ck", ock.keys.index_name(ATTEMPT, w)), data))
        refs[w] = (len(data), ock.crc32c(data), sizes)
    avg = sum(v[0] for v in refs.values()) // len(refs)  # other ranks: the average index, a middle rank's blobs
    outcomes = [pickle.dumps(ock.RankOutcome(
        blobs=[ock.Blob(ock.keys.blob_name(ATTEMPT, w, i), sz, w) for i, sz in enumerate(refs.get(w, refs[mid])[2])],
        index=ock.RankIndexRef(ock.keys.index_name(ATTEMPT, w), *((refs[w][0], refs[w][1]) if w in refs else (avg, 0)))))
        for w in range(world)]
    s0 = out["save"][0]
    with Timer() as t:
        results = [pickle.loads(p) for p in outcomes]
    s0["round2_unpickle_s"], s0["round2_bytes_total"] = t.t, sum(map(len, outcomes))
    with Timer() as t:
        lay = layout(defs, tree, descs, meshes, digest)
        lay.layouts = layouts
        m = lay.manifest(results, ock.ManifestCommon(ATTEMPT, {}, CRC_BLOCK))
        data = ock.encode(m)
    s0["manifest_build_encode_s"] = t.t
    out["manifest_json_bytes"] = len(json.dumps(ock.to_json_obj(m), separators=(",", ":")).encode())
    out["manifest_stored_bytes"] = len(data)
    run_(store.put(ock.keys.manifest_key("ck"), data))
    log(f"world {world}: manifest {out['manifest_json_bytes'] / 1e6:.2f} MB JSON, {len(data) / 1e6:.3f} MB stored")
    for lr, targets in targets_of.items():
        r: dict[str, Any] = {}
        with Timer() as t:
            mm = ock.decode(run_(store.get(ock.keys.manifest_key("ck"))))
        r["decode_s"] = t.t
        res = ock.RankIndexResolver(mm, store, "ck")
        with Timer() as t:
            run_(res.prefetch(targets))
        r.update(prefetch_s=t.t, indexes_fetched=len(res._ranks), index_bytes_fetched=sum(refs[w][0] for w in res._ranks))
        r["reads"] = 0
        with Timer() as t:
            for key, box in targets:
                itemsize = 2 if mm.tensors[key].dtype == "bfloat16" else 4
                for c, inter in res.overlapping(key, box):
                    ock.plan_piece(c, inter, itemsize, mm.crc_block)
                    r["reads"] += 1
        r["overlap_plan_s"] = t.t
        r["per_rank_s"] = r["decode_s"] + r["prefetch_s"] + r["overlap_plan_s"]
        out["load"][lr] = r
        log(f"world {world} -> {lw} load rank {lr}: {r['per_rank_s']:.2f} s, {r['indexes_fetched']} rank indexes")
    out["load_world"] = lw
    return out


def table(rows: list[dict[str, Any]]) -> str:
    def worst(r: dict[str, Any], side: str, f: str) -> float:
        return max(x[f] for x in r[side].values())

    return h.md_table(["ranks (load ranks)", "save s/rank", "plan miss s", "plan hit s", "index KB", "manifest JSON / "
                       "stored MB", "load s/rank", "rank indexes fetched"], ([
        f"{r['world']} ({r['load_world']})", f"{worst(r, 'save', 'per_rank_s'):.2f}", f"{worst(r, 'save', 'plan_miss_s'):.2f}",
        f"{worst(r, 'save', 'plan_hit_s'):.4f}", f"{min(x['index_bytes'] for x in r['save'].values()) / 1e3:.0f}–"
        f"{worst(r, 'save', 'index_bytes') / 1e3:.0f}", f"{r['manifest_json_bytes'] / 1e6:.2f} / "
        f"{r['manifest_stored_bytes'] / 1e6:.3f}", f"{worst(r, 'load', 'per_rank_s'):.2f}",
        f"{min(x['indexes_fetched'] for x in r['load'].values())}–{worst(r, 'load', 'indexes_fetched')}"] for r in rows))


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="256,1024,4096")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--load-ratio", type=float, default=0.5)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    set_clock(args.clock)
    rows = [run(int(w), args.tp, args.load_ratio) for w in args.worlds.split(",")]
    print(table(rows))
    if args.out:
        h.write_results(args.out, {"meta": {"clock": args.clock, "environment": h.environment()}, "rows": rows})


if __name__ == "__main__":
    main()
