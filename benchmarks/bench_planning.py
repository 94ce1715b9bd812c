"""Planning at scale with symbolic layouts (format v2), without I/O.

    python -m benchmarks.bench_planning --worlds 256,1024,4096 --out benchmarks/results/planning_symbolic.json
    python -m benchmarks.bench_planning --model moe-1t --ep 64 --worlds 16384,32768,65536

A model of :mod:`benchmarks.planning_model` (``--model``: the 70B + Adam state, FSDP x TP on
(world/tp, tp); ``dense-1t``; ``moe-1t``, whose experts lie on (world/(ep*tp), ep, tp)), loaded
into half as many ranks (dp halves; ep and tp stay). Runs objckpt's own functions on the path
a symbolic multi-rank save and load take, for two sample ranks (rank 0 and a middle one),
in CPU seconds:

save: torch's ``compute_local_shape_and_global_offset`` for every tensor (what a real rank runs,
on a fake process group; objckpt's boxes are checked against it); objckpt's ``describe_symbolic``
of the rank's DTensors (meta tensors: placements, meshes, the ``cell_box`` check, digest; with
``--fsdp2`` FSDP2 x TP's ``_StridedShard`` placements, described on permuted meshes); the tree
digest; unpickling every rank's first-round payload;
``SymbolicLayout.plan`` on a cache miss and a hit; this rank's index object (``rank_index.encode``,
random crcs) and its size.  Each rank sends rank 0 its outcome (``RankOutcome.wire``; the
commit gathers them to rank 0 only: ``distributed/comm.decide_on_root``) and unpickles the
decision rank 0 broadcasts (``verdict_unpickle_s``: the status and one error slot per rank).

rank 0's commit: unpickling every rank's outcome (``outcomes_unpickle_s``), rebuilding them and
``SymbolicLayout.manifest`` (``save/pipeline.gathered_manifest``) + ``encode``, and the check of
the GET that confirms the conditional create (``save/commit.py`` ``_confirm_ours``: the bytes
read back compared with those written; ``confirm_s``); the manifest's size.

load: ``manifest.decode``; ``RankIndexResolver.prefetch`` (the rank indexes this rank needs, from an
in-memory store, checked and decoded); ``overlapping`` + ``plan_piece`` for every tensor it holds;
after the decode, the objects older than the manifest are frozen out of the collector's walks
(``runtime/gc_pause.FrozenOld``), as ``load`` does.
``--fetch-samples`` more load ranks (the first, the last, and evenly spread) only count the
rank indexes they would fetch: ``fetch_fraction_max`` is the largest count over the world size.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import pickle
import random
import resource
import sys
from typing import Any, Optional

from objckpt.runtime.gc_pause import FrozenOld
from objckpt.save.pipeline import gathered_manifest

from . import harness as h
from .planning_model import (ATTEMPT, CRC_BLOCK, KIND_MESH, MODELS, PLACEMENTS, Timer, chunk_records, encoded_tree,
                             internals, log, mesh_shapes, model_defs, set_clock, torch_session)


def mesh_list(world: int, tp: int, ep: int, kinds: set[str]) -> tuple[list[tuple[int, ...]], dict[int, int]]:
    """The shapes of the meshes the model's tensors lie on, and each used mesh's index among them."""
    shapes = mesh_shapes(world, tp, ep)
    used = sorted({KIND_MESH[k] for k in kinds})
    return [shapes[i] for i in used], {m: i for i, m in enumerate(used)}


def placements_of(kind: str) -> tuple[str, ...]:
    pl = PLACEMENTS[kind]
    return ("R",) if pl is None else tuple("R" if p[0] == "R" else f"S{p[1]}" for p in pl)


def describe(defs: list, world: int, tp: int, ep: int, rank: int) -> tuple[list, list, bytes, dict]:
    """What ``save()`` describes on one rank: tensor descriptions, meshes, digest, boxes by layout rule."""
    ock = internals()
    shapes, index = mesh_list(world, tp, ep, {d.kind for d in defs})
    meshes = [ock.Mesh(shape, tuple(range(world))) for shape in shapes]
    descs, boxes = [], {}
    for d in defs:
        pl, mid = placements_of(d.kind), index[KIND_MESH[d.kind]]
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


def save_side(defs: list, tree: Any, world: int, tp: int, ep: int, rank: int, rng: random.Random,
              strided: bool = False) -> dict[str, Any]:
    ock = internals()
    sess = torch_session(defs, (world // tp, tp), rank, ep, strided=strided)
    r: dict[str, Any] = {"torch_local_boxes_s": sess.boxes_s, "describe_s": sess.describe_s}
    if sess.description is None:
        raise AssertionError(f"rank {rank}: objckpt found no symbolic description (the save would gather boxes)")
    descs, meshes, digest, boxes = describe(defs, world, tp, ep, rank)
    if not strided and (sess.description.descs, sess.description.meshes) != (descs, meshes):
        raise AssertionError(f"rank {rank}: objckpt's description differs from the benchmark's")
    wrong = [k for k, (offs, shape) in sess.boxes.items() if boxes[k] != (offs, shape) and math.prod(shape)]
    if wrong:  # the placement rule objckpt computes must be torch's
        raise AssertionError(f"rank {rank}: objckpt's boxes differ from torch's for {wrong[:3]}")
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
    log(f"world {world} save rank {rank}: {r['per_rank_s']:.2f} s before the outcome exchange "
        f"(plan miss {r['plan_miss_s']:.2f} s, index {len(idx) / 1e3:.0f} KB)")
    return r


def writers_needed(defs: list, descs: list, meshes: list, layouts: dict, lmeshes: list, lrank: int,
                   memo: dict) -> set[int]:
    """The save ranks whose index objects load rank ``lrank`` needs (the writers of every
    stored piece overlapping its boxes): what ``RankIndexResolver.prefetch`` fetches."""
    ock = internals()
    need: set[int] = set()
    for t in descs:
        m = lmeshes[t.mesh]
        box = ock.cell_box(t.shape, m.shape, t.placements, m.coordinate(lrank))
        need.update(w for w, _, _ in ock.overlapping_pieces(t.shape, meshes[t.mesh], layouts[t.key], box, memo))
    return need


def run(world: int, tp: int, load_ratio: float, seed: int = 0, model: str = "70b", ep: int = 1,
        spread_digits: int = 0, fetch_samples: int = 16, layers: Optional[int] = None,
        strided: bool = False) -> dict[str, Any]:
    """One world size: two sample save ranks, rank 0's commit, two sample load ranks
    (``fetch_samples`` more load ranks only count the rank indexes they would fetch)."""
    ock = internals()
    run_ = ock._runtime.run
    rng = random.Random(seed)
    defs, state = model_defs(model, layers)
    if not any(KIND_MESH[d.kind] == 2 for d in defs):
        ep = 1  # no expert tensors: the (dp, ep, tp) mesh is not used
    tree = encoded_tree(state)
    mid = world // 2 + 3
    out: dict[str, Any] = {"world": world, "model": model, "tp": tp, "ep": ep, "spread_digits": spread_digits,
                           "tensors": len(defs), "bytes": sum(math.prod(d.shape) * d.itemsize for d in defs),
                           "meshes": mesh_list(world, tp, ep, {d.kind for d in defs})[0], "load": {},
                           "strided": strided,
                           "save": {rank: save_side(defs, tree, world, tp, ep, rank, rng, strided)
                                    for rank in (0, mid)}}
    # the load's target layout, and the ranks whose index objects its sample ranks need
    lw = int(world * load_ratio)
    descs, meshes, digest, _ = describe(defs, world, tp, ep, 0)
    layouts = ock.assign_shard_specs(descs, meshes)
    lmeshes = [ock.Mesh(shape, tuple(range(lw))) for shape in mesh_list(lw, tp, ep, {d.kind for d in defs})[0]]
    memo: dict = {}
    samples = (0, lw // 2 + 3)
    need: set[int] = set()
    for lr in samples:
        need |= writers_needed(defs, descs, meshes, layouts, lmeshes, lr, memo)
    log(f"world {world}: generating {len(need)} rank indexes the sample load ranks need")
    store = ock.MemoryStore()
    up = 1 if spread_digits else 0
    place = {w: ock.Placement("ck", w, up, spread_digits or 2) for w in sorted(need | {0, mid})}
    refs: dict[int, tuple[int, int, list[int]]] = {}
    for w, pl in place.items():
        data, sizes = rank_index(descs, meshes, digest, w, rng)
        run_(store.put(pl.key(pl.index_name(ATTEMPT)), data))
        refs[w] = (len(data), ock.crc32c(data), sizes)
    # other ranks: a middle rank's blobs; an index of about the average size with a random crc32c (as real ones
    # have: placeholder crcs and sizes that repeat would compress away and flatter the manifest's size)
    avg = sum(v[0] for v in refs.values()) // len(refs)

    def outcome(w: int) -> Any:
        pl = place.get(w) or ock.Placement("ck", w, up, spread_digits or 2)
        if w in refs:
            size, crc = refs[w][0], refs[w][1]
        else:
            size, crc = avg + rng.randint(-avg // 20, avg // 20), rng.getrandbits(32)
        return ock.RankOutcome(blobs=[ock.Blob(pl.blob_name(ATTEMPT, i), sz, w, pl.bucket)
                                      for i, sz in enumerate(refs.get(w, refs[mid])[2])],
                               index=ock.RankIndexRef(pl.index_name(ATTEMPT), size, crc, pl.bucket))

    outcomes = [pickle.dumps(outcome(w).wire()) for w in range(world)]
    s0 = out["save"][0]
    with Timer() as t:  # rank 0 only: the outcomes are gathered to it (distributed/comm.decide_on_root)
        wires = [pickle.loads(p) for p in outcomes]
    s0["outcomes_unpickle_s"], s0["outcomes_bytes_total"] = t.t, sum(map(len, outcomes))
    verdict = pickle.dumps((None, [None] * world))  # rank 0's broadcast: the status and every rank's error (None)
    with Timer() as t:
        pickle.loads(verdict)
    for r in out["save"].values():
        r["verdict_unpickle_s"], r["verdict_bytes"] = t.t, len(verdict)
        r["per_rank_s"] += t.t
    with Timer() as t:
        lay = layout(defs, tree, descs, meshes, digest)
        lay.specs = layouts
        m, _ = gathered_manifest(lay, wires, ock.ManifestCommon(ATTEMPT, {}, CRC_BLOCK))
        m.spread_up = up
        data = ock.encode(m)
    s0["manifest_build_encode_s"] = t.t
    got = bytes(bytearray(data))  # what the GET returns: other bytes of the same content
    with Timer() as t:  # the commit reads the manifest back to confirm the conditional create (save/commit.py)
        if got != data:
            ock.decode(got)
    s0["confirm_s"] = t.t
    s0["commit_s"] = s0["outcomes_unpickle_s"] + s0["manifest_build_encode_s"] + s0["confirm_s"]
    out["manifest_json_bytes"] = len(json.dumps(ock.to_json_obj(m), separators=(",", ":")).encode())
    out["manifest_stored_bytes"] = len(data)
    run_(store.put(ock.keys.manifest_key("ck"), data))
    log(f"world {world}: manifest {out['manifest_json_bytes'] / 1e6:.2f} MB JSON, {len(data) / 1e6:.3f} MB stored; "
        f"rank 0 commit {s0['commit_s']:.2f} s")
    for lr in samples:
        targets = []
        for t in descs:
            lm = lmeshes[t.mesh]
            targets.append((t.key, ock.cell_box(t.shape, lm.shape, t.placements, lm.coordinate(lr))))
        r: dict[str, Any] = {}
        with Timer() as t:
            mm = ock.decode(run_(store.get(ock.keys.manifest_key("ck"))))
        r["decode_s"] = t.t
        # as a load does (load/pipeline.py): once its manifest is decoded, every older object is
        # out of the collector's walks until the load ends; without it, the collections this
        # planning triggers walked the benchmark's own heap (every rank's outcome), not a job's
        frozen = FrozenOld()
        frozen.now()
        res = ock.RankIndexResolver(mm, store, "ck")
        with Timer() as t:
            run_(res.prefetch(targets))
        r.update(prefetch_s=t.t, indexes_fetched=len(res._ranks),
                 index_bytes_fetched=sum(refs[w][0] for w in res._ranks))
        r["reads"] = 0
        with Timer() as t:
            for key, box in targets:
                itemsize = 2 if mm.tensors[key].dtype == "bfloat16" else 4
                for c, inter in res.overlapping(key, box):
                    ock.plan_piece(c, inter, itemsize, mm.crc_block)
                    r["reads"] += 1
        r["overlap_plan_s"] = t.t
        frozen.close()
        r["per_rank_s"] = r["decode_s"] + r["prefetch_s"] + r["overlap_plan_s"]
        out["load"][lr] = r
        log(f"world {world} -> {lw} load rank {lr}: {r['per_rank_s']:.2f} s, {r['indexes_fetched']} rank indexes")
    # more load ranks, spread over the mesh (first and last included): only the indexes they would fetch
    extra = sorted({0, lw - 1} | {int(lw * (i + 0.5) / max(fetch_samples, 1)) for i in range(fetch_samples)})
    counts = {lr: len(writers_needed(defs, descs, meshes, layouts, lmeshes, lr, memo)) for lr in extra}
    counts.update({lr: r["indexes_fetched"] for lr, r in out["load"].items()})
    out["fetch_counts"] = counts
    out["fetch_fraction_max"] = max(counts.values()) / world
    out["load_world"] = lw
    return out


def table(rows: list[dict[str, Any]]) -> str:
    def worst(r: dict[str, Any], side: str, f: str) -> float:
        return max(x[f] for x in r[side].values())

    return h.md_table(["model", "ranks (load ranks)", "save s/rank", "plan miss s", "plan hit s", "index KB",
                       "rank 0 commit s", "manifest JSON / stored MB", "load s/rank",
                       "rank indexes fetched (max %)"], ([
        r["model"] + (" (FSDP2)" if r.get("strided") else ""), f"{r['world']} ({r['load_world']})",
        f"{worst(r, 'save', 'per_rank_s'):.2f}",
        f"{worst(r, 'save', 'plan_miss_s'):.2f}", f"{worst(r, 'save', 'plan_hit_s'):.4f}",
        f"{min(x['index_bytes'] for x in r['save'].values()) / 1e3:.0f}–{worst(r, 'save', 'index_bytes') / 1e3:.0f}",
        f"{r['save'][0]['commit_s']:.2f}",
        f"{r['manifest_json_bytes'] / 1e6:.2f} / {r['manifest_stored_bytes'] / 1e6:.3f}",
        f"{worst(r, 'load', 'per_rank_s'):.2f}",
        f"{min(r['fetch_counts'].values())}–{max(r['fetch_counts'].values())} "
        f"({100 * r['fetch_fraction_max']:.3f} %)"]
        for r in rows))


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="70b")
    ap.add_argument("--worlds", default="256,1024,4096")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--ep", type=int, default=64, help="expert-parallel degree (moe-1t only)")
    ap.add_argument("--load-ratio", type=float, default=0.5)
    ap.add_argument("--spread-digits", type=int, default=0, help="key_layout='spread' with these digits (0: default)")
    ap.add_argument("--fetch-samples", type=int, default=16, help="more load ranks whose fetches are counted")
    ap.add_argument("--fsdp2", action="store_true",
                    help="describe FSDP2 x TP's placements (_StridedShard on dp where tp shards the same dim)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (quick runs)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    set_clock(args.clock)
    rows = [run(int(w), args.tp, args.load_ratio, model=args.model, ep=args.ep, spread_digits=args.spread_digits,
                fetch_samples=args.fetch_samples, layers=args.layers, strided=args.fsdp2)
            for w in args.worlds.split(",")]
    print(table(rows))
    if args.out:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        h.write_results(args.out, {"meta": {"clock": args.clock, "argv": sys.argv[1:] if argv is None else argv,
                                            "peak_rss_mib": round(peak), "environment": h.environment()},
                                   "rows": rows})


if __name__ == "__main__":
    main()
