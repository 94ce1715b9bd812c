"""Planning at scale with symbolic layouts (format v2), without I/O.

    python -m benchmarks.bench_planning_symbolic --worlds 256,1024,4096 --out benchmarks/results/planning_symbolic.json

Same state and layouts as ``bench_planning`` (70B Llama-like + Adam, 2892
tensors, FSDP x TP on a (dp, tp) mesh; loaded into tp 8 x dp world/16).  It
runs objckpt's own functions on the path a symbolic multi-rank save and load
take, per rank (rank 0 and a middle rank), in CPU seconds:

save
  * describe: per tensor the placements, the mesh, the layout check of the
    local box (``cell_box``), the digest (what ``saving._describe`` does);
    torch's ``compute_local_shape_and_global_offset`` for every tensor (what
    ``local_part`` runs, on a fake process group) is reported separately;
  * the tree digest; unpickling every rank's first-round payload (digests);
  * ``plan_for_rank_symbolic`` on a cache miss (layouts for all tensors, this
    rank's pieces, packing) and on a hit;
  * this rank's index object (``rank_index.encode`` of its chunk records,
    random crcs), its size;
  * rank 0: unpickling every rank's outcome, ``build_manifest_v2`` + ``encode``;
    the manifest's size (JSON and as stored).
load
  * ``manifest.decode``; ``ChunkResolver.prefetch`` (which rank indexes this
    rank needs: fetched from an in-memory store, checked and decoded) and
    ``overlapping`` + ``plan_piece`` for every tensor this rank holds.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import sys
import time
from typing import Any

from benchmarks.bench_planning import (
    CRC_BLOCK, PLACEMENTS, Timer, _log, _Store, chunk_records, encoded_tree, llama_defs, rank_metas_torch, set_clock,
)

BLOB_SIZE = 1 << 30
PART_SIZE = 16 << 20


def _placements(kind: str) -> tuple[str, ...]:
    pl = PLACEMENTS[kind]
    return ("R",) if pl is None else tuple("R" if p[0] == "R" else f"S{p[1]}" for p in pl)


def describe(defs: list, mesh_shape: tuple[int, int], rank: int) -> tuple[list, list, bytes, dict]:
    """What ``saving._describe`` computes on one rank (boxes from the layout rule)."""
    import hashlib

    from objckpt.format.manifest import Mesh
    from objckpt.planning.layout import TensorDesc, cell_box

    world = mesh_shape[0] * mesh_shape[1]
    meshes = [Mesh((world,), tuple(range(world))), Mesh(mesh_shape, tuple(range(world)))]
    descs, boxes = [], {}
    for d in defs:
        pl = _placements(d.kind)
        mid = 0 if PLACEMENTS[d.kind] is None else 1
        coord = meshes[mid].coordinate(rank)
        boxes[d.key] = cell_box(d.shape, meshes[mid].shape, pl, coord)
        descs.append(TensorDesc(d.key, tuple(d.shape), d.itemsize, mid, pl))
    dtypes = {d.key: d.dtype for d in defs}
    digest = hashlib.blake2b(pickle.dumps(([(t, dtypes[t.key]) for t in descs], meshes, [], sorted(dtypes.items()))),
                             digest_size=20).digest()
    return descs, meshes, digest, boxes


def _index_bytes(descs: list, meshes: list, digest: bytes, mesh_shape: tuple[int, int], rank: int,
                 rng: random.Random) -> tuple[bytes, list[int]]:
    from objckpt.format import rank_index
    from objckpt.planning.layout import cell_box
    from objckpt.planning.rank_plan import plan_for_rank_symbolic

    boxes = {t.key: cell_box(t.shape, meshes[t.mesh].shape, t.placements, meshes[t.mesh].coordinate(rank))
             for t in descs}
    _, items, plan = plan_for_rank_symbolic(digest, descs, meshes, boxes, rank, _Store(), BLOB_SIZE, PART_SIZE)
    recs = chunk_records(items, plan, rng)
    return rank_index.encode("20261122T000000-000000000000", rank, recs), [b.size for b in plan.blobs]


def run(world: int, tp: int, load_ratio: float, rng_seed: int = 0) -> dict[str, Any]:
    from objckpt import _runtime
    from objckpt.checksum import crc32c
    from objckpt.engine.commit import build_manifest_v2
    from objckpt.engine.resolve import ChunkResolver
    from objckpt.format import layout as keys
    from objckpt.format.manifest import decode, encode
    from objckpt.planning import rank_plan
    from objckpt.planning.layout import assign_layouts, cell_box
    from objckpt.planning.reshard import plan_piece
    from objckpt.saving import _tree_digest
    from objckpt.storage.memory import MemoryStore

    rng = random.Random(rng_seed)
    defs, state = llama_defs()
    tree = encoded_tree(state)
    mesh_shape = (world // tp, tp)
    attempt = "20261122T000000-000000000000"
    out: dict[str, Any] = {"world": world, "tensors": len(defs), "mesh": list(mesh_shape), "save": {}, "load": {}}
    mid = world // 2 + 3
    for rank in (0, mid):
        r: dict[str, Any] = {}
        _, r["torch_local_boxes_s"] = rank_metas_torch(defs, mesh_shape, rank)
        with Timer() as t:
            descs, meshes, digest, boxes = describe(defs, mesh_shape, rank)
        r["describe_s"] = t.t
        with Timer() as t:
            tdig = _tree_digest(tree)
        r["tree_digest_s"] = t.t
        payloads = [pickle.dumps((digest, tdig, False, attempt if i == 0 else "", None)) for i in range(world)]
        with Timer() as t:
            for p in payloads:
                pickle.loads(p)
        r["round1_unpickle_s"], r["round1_bytes_total"] = t.t, sum(map(len, payloads))
        rank_plan._PLAN_CACHE.clear()
        with Timer() as t:
            layouts, items, plan = rank_plan.plan_for_rank_symbolic(digest, descs, meshes, boxes, rank, _Store(),
                                                                    BLOB_SIZE, PART_SIZE)
        r["plan_miss_s"] = t.t
        with Timer() as t:
            rank_plan.plan_for_rank_symbolic(digest, descs, meshes, boxes, rank, _Store(), BLOB_SIZE, PART_SIZE)
        r["plan_hit_s"] = t.t
        with Timer() as t:
            idx, _ = _index_bytes(descs, meshes, digest, mesh_shape, rank, rng)
        r["index_s"], r["index_bytes"], r["chunks"] = t.t, len(idx), len(plan.chunks)
        r["bytes_written"] = sum(b.size for b in plan.blobs)
        r["per_rank_s"] = (r["torch_local_boxes_s"] + r["describe_s"] + r["tree_digest_s"] + r["round1_unpickle_s"]
                           + r["plan_miss_s"] + r["index_s"])
        out["save"][rank] = r
        _log(f"world {world} save rank {rank}: {r['per_rank_s']:.2f} s (plan miss {r['plan_miss_s']:.2f} s, "
             f"index {len(idx) / 1e3:.0f} KB)")

    # the target layout of the load and the ranks whose index objects its sample ranks need
    lw = int(world * load_ratio)
    lmesh_shape = (lw // tp, tp)
    descs, meshes, digest, _ = describe(defs, mesh_shape, 0)
    layouts = assign_layouts(descs, meshes)
    from objckpt.format.manifest import Mesh
    from objckpt.planning.layout import overlapping_pieces

    lmeshes = [Mesh((lw,), tuple(range(lw))), Mesh(lmesh_shape, tuple(range(lw)))]
    targets_of: dict[int, list] = {}
    need: set[int] = set()
    for lr in (0, lw // 2 + 3):
        tg = []
        for t in descs:
            m = lmeshes[t.mesh]
            box = cell_box(t.shape, m.shape, t.placements, m.coordinate(lr))
            tg.append((t.key, box))
            need.update(w for w, _, _ in overlapping_pieces(t.shape, meshes[t.mesh], layouts[t.key], box))
        targets_of[lr] = tg
    _log(f"world {world}: generating {len(need)} rank indexes the sample load ranks need")
    store = MemoryStore()
    refs: dict[int, tuple[int, int, list[int]]] = {}
    for w in sorted(need | {0, mid}):
        data, sizes = _index_bytes(descs, meshes, digest, mesh_shape, w, rng)
        _runtime.run(store.put(keys.join("ck", keys.index_name(attempt, w)), data))
        refs[w] = (len(data), crc32c(data), sizes)
    avg = sum(v[0] for v in refs.values()) // len(refs)
    typical = refs[mid][2]  # other ranks: a middle rank's blob sizes, the average index size
    results = [((refs[w][0], refs[w][1]) if w in refs else (avg, 0),
                [(keys.blob_name(attempt, w, i), sz) for i, sz in enumerate(refs[w][2] if w in refs else typical)],
                None) for w in range(world)]
    outcome_payloads = [pickle.dumps(x) for x in results]
    with Timer() as t:
        results = [pickle.loads(p) for p in outcome_payloads]
    s0 = out["save"][0]
    s0["round2_unpickle_s"], s0["round2_bytes_total"] = t.t, sum(map(len, outcome_payloads))
    dtypes = {d.key: d.dtype for d in defs}
    with Timer() as t:
        m = build_manifest_v2(descs, meshes, layouts, dtypes, {}, tree, None, results, attempt, {}, CRC_BLOCK)
        data = encode(m)
    s0["manifest_build_encode_s"] = t.t
    raw = json.dumps(__import__("objckpt.format.manifest", fromlist=["to_json_obj"]).to_json_obj(m),
                     separators=(",", ":")).encode()
    out["manifest_json_bytes"], out["manifest_stored_bytes"] = len(raw), len(data)
    _runtime.run(store.put(keys.manifest_key("ck"), data))
    _log(f"world {world}: manifest {len(raw) / 1e6:.2f} MB JSON, {len(data) / 1e6:.3f} MB stored")

    for lr, tg in targets_of.items():
        r = {}
        with Timer() as t:
            mm = decode(_runtime.run(store.get(keys.manifest_key("ck"))))
        r["decode_s"] = t.t
        res = ChunkResolver(mm, store, "ck")
        with Timer() as t:
            _runtime.run(res.prefetch(tg))
        r["prefetch_s"], r["indexes_fetched"] = t.t, len(res._ranks)
        r["index_bytes_fetched"] = sum(refs[w][0] for w in res._ranks)
        npieces = 0
        with Timer() as t:
            for key, box in tg:
                isz = 2 if mm.tensors[key].dtype == "bfloat16" else 4
                for c, inter in res.overlapping(key, box):
                    plan_piece(c, inter, isz, mm.crc_block)
                    npieces += 1
        r["overlap_plan_s"], r["reads"] = t.t, npieces
        r["per_rank_s"] = r["decode_s"] + r["prefetch_s"] + r["overlap_plan_s"]
        out["load"][lr] = r
        _log(f"world {world} -> {lw} load rank {lr}: {r['per_rank_s']:.2f} s, {r['indexes_fetched']} rank indexes")
    out["load_world"] = lw
    return out


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="256,1024,4096")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--load-ratio", type=float, default=0.5)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    set_clock(args.clock)
    rows = [run(int(w), args.tp, args.load_ratio) for w in args.worlds.split(",")]
    print(f"{'world':>6} {'save s/rank':>12} {'plan miss':>10} {'plan hit':>9} {'index KB':>9} "
          f"{'manifest':>14} {'load s/rank':>12} {'indexes':>8}")
    for r in rows:
        sv = max(x["per_rank_s"] for x in r["save"].values())
        ld = max(x["per_rank_s"] for x in r["load"].values())
        print(f"{r['world']:>6} {sv:>12.2f} {max(x['plan_miss_s'] for x in r['save'].values()):>10.2f} "
              f"{max(x['plan_hit_s'] for x in r['save'].values()):>9.4f} "
              f"{max(x['index_bytes'] for x in r['save'].values()) / 1e3:>9.0f} "
              f"{r['manifest_json_bytes'] / 1e6:>6.2f}/{r['manifest_stored_bytes'] / 1e6:.2f} MB "
              f"{ld:>12.2f} {max(x['indexes_fetched'] for x in r['load'].values()):>8}")
    if args.out:
        meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores, python {sys.version.split()[0]}",
                "clock": args.clock, "when": time.strftime("%Y-%m-%d")}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
