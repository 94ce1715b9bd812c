"""Planning at scale on the gathered path (format v1), and DCP's planning, without I/O.

    python -m benchmarks.bench_planning_gathered --worlds 64,256,1024,4096 --dcp 64,256,1024 --out /tmp/planning.json
    python -m benchmarks.bench_planning_gathered --worlds 64 --dcp 64                       # ~1 min

The path ``objckpt.Shard`` and non-symbolic layouts take: every rank's boxes are all-gathered and
the manifest lists every chunk. Same model as :mod:`benchmarks.bench_planning` (the boxes from
:func:`~benchmarks.planning_model.local_box`, checked against torch's function on the sample
ranks). Each world runs in its own subprocess. Per world, in CPU seconds of one run:

save: every rank's metadata payload built, pickled and unpickled (what ``all_gather_object``
does); the plan-cache key (pickle + blake2b of all gathered metas); ``check_consistent`` and
``assign_writes``; ``pack_items`` for two sample ranks; ``GatheredLayout.plan`` itself (miss and hit)
up to ``--plan-for-rank-max-world``; every rank's chunk records, then the manifest: JSON bytes
(streamed tensor by tensor, byte-identical to ``encode``, which runs and is timed up to
``--full-manifest-max-chunks``) and zstd bytes.

load (target: ``--load-tp`` x world * ``--load-ratio``): ``manifest.decode``; per sample target
rank, ``check_coverage`` + ``ChunkIndex`` for every tensor, then ``overlapping`` and ``plan_piece``.

dcp (``--dcp``): ``DefaultSavePlanner.create_global_plan`` on equivalent local plans (rank 0),
and ``create_read_items_for_chunk_list`` per target rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import pickle
import random
import sys
import time
from typing import Any, Optional

from . import harness as h
from . import planning_model as pm
from .planning_model import (CRC_BLOCK, PLACEMENTS, Timer,
                             chunk_records, encoded_tree, internals, llama_defs, local_box, log, set_clock, torch_boxes)


def rank_metas(defs: list, mesh: tuple[int, int], rank: int) -> dict:
    """What a rank reports in ``save()``'s first all-gather: key -> TensorMeta with its one box."""
    ock, coord = internals(), (rank // mesh[1], rank % mesh[1])
    return {d.key: ock.TensorMeta(d.dtype, tuple(d.shape), d.itemsize, (local_box(d.shape, mesh, coord,
                                                                                  PLACEMENTS[d.kind]),))
            for d in defs}


def plan_rank(items: list, itemsizes: dict[str, int]) -> Any:
    """One rank's blob layout for its write items."""
    ock = internals()
    return ock.pack_items(items, itemsizes, ock.limits)


def manifest_json(header: dict[str, Any], entries: Any, tree: Any) -> list[bytes]:
    """The manifest JSON exactly as ``encode`` writes it, built tensor by tensor (the large worlds
    cannot hold metas, Chunk objects and JSON dicts at once)."""
    dumps = lambda o: json.dumps(o, separators=(",", ":"), allow_nan=False).encode()  # noqa: E731
    out = [dumps(header)[:-1] + b',"tensors":{']
    out += [(b"," if i else b"") + dumps(k) + b":" + dumps(d) for i, (k, d) in enumerate(entries)]
    return out + [b'},"tree":' + dumps(tree) + b',"crc_block":' + str(CRC_BLOCK).encode() + b"}"]


def run_objckpt(world: int, args: argparse.Namespace) -> dict[str, Any]:
    import zstandard

    ock = internals()
    defs, state = llama_defs()
    mesh, tree = (world // args.tp, args.tp), encoded_tree(state)
    dtypes = {d.key: d.dtype for d in defs}
    attempt = ock.keys.new_attempt_id()
    sample = [0, world // 2 + args.tp // 2]
    res: dict[str, Any] = {"world": world, "mesh": list(mesh), "tensors": len(defs)}
    t_build, t_unpickle, sizes, metas = Timer(), Timer(), [], []
    for r in range(world):  # 1. the gathered metadata
        with t_build:
            blob = pickle.dumps((rank_metas(defs, mesh, r), tree, {}, dtypes, False, attempt if r == 0 else "", None))
        sizes.append(len(blob))
        with t_unpickle:
            metas.append(pickle.loads(blob)[0])
    for r in sample:
        boxes, t_torch = torch_boxes(defs, mesh, r)
        assert all(metas[r][k].boxes == (b,) for k, b in boxes.items()), f"rank {r}: boxes differ from torch's"
    res["meta"] = {"build_pickle_s_per_rank": t_build.t / world, "torch_boxes_s_per_rank": t_torch,
                   "unpickle_s_all_ranks": t_unpickle.t, "bytes_per_rank_mean": sum(sizes) / world,
                   "bytes_total": sum(sizes), "boxes_total": sum(len(t.boxes) for m in metas for t in m.values())}
    log(f"world {world}: metadata {sum(sizes) / 1e6:.0f} MB pickled, unpickled in {t_unpickle.t:.1f} s")
    itemsizes = {d.key: d.itemsize for d in defs}
    with Timer() as t_key:  # 2. save planning, as GatheredLayout.plan does on a cache miss
        hashlib.blake2b(pickle.dumps((metas, 0, ock.limits)), digest_size=20).digest()
    with Timer() as t_check:
        ock.check_consistent(metas)
    with Timer() as t_assign:
        writes = ock.assign_writes(metas)
    save: dict[str, Any] = {"cache_key_s": t_key.t, "check_consistent_s": t_check.t, "assign_writes_s": t_assign.t,
                            "ranks": {}}
    for r in sample:
        with Timer() as t:
            plan = plan_rank(writes[r], itemsizes)
        save["ranks"][r] = {"items": len(writes[r]), "plan_save_s": t.t, "chunks": len(plan.chunks)}
    save["per_rank_s"] = t_assign.t + max(v["plan_save_s"] for v in save["ranks"].values())
    if world <= args.plan_for_rank_max_world:
        ock.PLAN_CACHE._plans.clear()
        lay = ock.GatheredLayout([ock.RankReport(m, tree, {}, dtypes) for m in metas])
        for case in ("miss", "hit"):
            with Timer() as t:
                lay.plan(0, {}, ock.limits)
            save[f"plan_for_rank_{case}_s"] = t.t
        ock.PLAN_CACHE._plans.clear()
    res["save"] = save
    log(f"world {world}: assign_writes {t_assign.t:.2f} s, cache key {t_key.t:.2f} s")
    rng, results = random.Random(world), []  # 3. every rank's chunk records -> the manifest
    for r in range(world):
        plan = plan_rank(writes[r], itemsizes)
        blobs = [ock.Blob(ock.keys.blob_name(attempt, r, b.index), b.size, r) for b in plan.blobs]
        results.append(ock.RankOutcome(blobs=blobs, records=chunk_records(writes[r], plan, rng)))
        writes[r] = None
    man: dict[str, Any] = {"chunks": sum(len(x.records) for x in results), "blobs": sum(len(x.blobs) for x in results)}
    full = man["chunks"] <= args.full_manifest_max_chunks
    m, data = None, b""
    if full:
        gathered = ock.GatheredLayout([ock.RankReport(metas[r], tree, {}, dtypes) for r in range(world)])
        with Timer() as t_bm:
            m = gathered.manifest(results, ock.ManifestCommon(attempt, {}, CRC_BLOCK))
        with Timer() as t_enc:
            data = ock.encode(m)
        man.update(build_manifest_s=t_bm.t, encode_s=t_enc.t, json_bytes_encode=len(ock.encode(m, compress=False)))
        del gathered
    del metas, writes
    by_key: dict[str, list] = {d.key: [] for d in defs}
    blobs = []
    for rank, out in enumerate(results):
        base = len(blobs)
        blobs += [{"name": b.name, "size": b.size, "rank": b.rank} for b in out.blobs]
        for rec in out.records:
            by_key[rec.key].append(dataclasses.replace(rec.chunk, blob=base + rec.chunk.blob))
        results[rank] = None  # type: ignore[call-overload]
    header = {"format": "objckpt", "format_version": 1,
              "writer": m.writer if m else f"objckpt {ock.objckpt.__version__}", "created": m.created if m else time.time(),
              "attempt": attempt, "world_size": world, "metadata": {}, "blobs": blobs}
    entries = ((d.key, {"dtype": d.dtype, "shape": list(d.shape), "chunks": [
        ock._chunk_to_json(c) for c in sorted(by_key.pop(d.key), key=lambda c: c.offsets)]}) for d in defs)
    raw = b"".join(manifest_json(header, entries, tree))
    man["json_bytes"] = len(raw)
    if full:
        assert len(raw) == man["json_bytes_encode"], "the streamed manifest differs from encode()'s"
    else:
        data = zstandard.ZstdCompressor(level=3).compress(raw)  # what encode() does
    man["zstd_bytes"] = len(data)
    del raw, m
    gc.collect()
    log(f"world {world}: {man['chunks']} chunks, manifest {man['json_bytes'] / 1e6:.1f} MB JSON, "
        f"{man['zstd_bytes'] / 1e6:.1f} MB zstd")
    with Timer() as t_dec:  # 4. load: decode (every loading rank), then what plan_fill plans per rank
        m2 = ock.decode(data)
    man["decode_s"] = t_dec.t
    lworld = max(args.load_tp, int(world * args.load_ratio))
    lmesh = (lworld // args.load_tp, args.load_tp)
    res["load"] = {"world": lworld, "mesh": list(lmesh),
                   "ranks": {r: plan_load_rank(m2, defs, lmesh, r) for r in (0, lworld // 2 + args.load_tp // 2)}}
    res["load"]["per_rank_s"] = max(v["per_rank_s"] for v in res["load"]["ranks"].values())
    res["manifest"] = man
    res["peak_rss"] = h.proc_status("VmHWM")
    return res


def plan_load_rank(m: Any, defs: list, lmesh: tuple[int, int], rank: int) -> dict[str, Any]:
    """What ``plan_fill`` computes before any read for one target rank holding one box of every
    tensor: ``check_coverage`` + ``ChunkIndex`` per tensor, ``overlapping``, ``plan_piece`` per overlap."""
    ock, coord = internals(), (rank // lmesh[1], rank % lmesh[1])
    st = {"check_coverage_index_s": 0.0, "overlap_plan_s": 0.0, "overlaps": 0}
    for d in defs:
        box = local_box(d.shape, lmesh, coord, PLACEMENTS[d.kind])
        t0 = pm.clock()
        ock.check_coverage(m.tensors[d.key])
        index = ock.ChunkIndex(m.tensors[d.key].chunks)
        t1 = pm.clock()
        ov = index.overlapping(box)
        for c, inter in ov:
            ock.plan_piece(c, inter, d.itemsize, m.crc_block, True)
        st["check_coverage_index_s"] += t1 - t0
        st["overlap_plan_s"] += pm.clock() - t1
        st["overlaps"] += len(ov)
    st["per_rank_s"] = st["check_coverage_index_s"] + st["overlap_plan_s"]
    return st


def run_dcp(world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    defs, state = llama_defs()
    tp = args.tp
    mesh = (world // tp, tp)
    dts = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    byte_keys = [f"optim.param_groups.0.{k}" for k in state["optim"]["param_groups"][0]]  # DCP's BYTE_IO items
    mapping = {k: tuple(k.split(".")) for k in [d.key for d in defs] + byte_keys}

    def local_plan(rank: int) -> SavePlan:
        items = []
        for d in defs:
            o, s = local_box(d.shape, mesh, (rank // tp, rank % tp), PLACEMENTS[d.kind])
            chunk = ChunkStorageMetadata(torch.Size(o), torch.Size(s))
            items.append(WriteItem(index=MetadataIndex(d.key, torch.Size(o)),
                                   type=WriteItemType.TENSOR if PLACEMENTS[d.kind] is None else WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dts[d.dtype]),
                                                               size=torch.Size(d.shape))))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in byte_keys]
        return SavePlan(items, planner_data=dict(mapping))

    t_unpickle, plans = Timer(), []
    for r in range(world):
        b = pickle.dumps(local_plan(r))
        with t_unpickle:
            plans.append(pickle.loads(b))
    res: dict[str, Any] = {"world": world, "local_plan_bytes_per_rank": len(b), "unpickle_s_all_ranks": t_unpickle.t}
    with Timer() as t_global:
        _, md = DefaultSavePlanner().create_global_plan(plans)
    del plans
    res["create_global_plan_s"], res["metadata_pickled_bytes"] = t_global.t, len(pickle.dumps(md))
    lworld = max(args.load_tp, int(world * args.load_ratio))
    lmesh, load = (lworld // args.load_tp, args.load_tp), {}
    for r in (0, lworld // 2 + args.load_tp // 2):
        with Timer() as t:
            for d in defs:
                o, s = local_box(d.shape, lmesh, (r // lmesh[1], r % lmesh[1]), PLACEMENTS[d.kind])
                create_read_items_for_chunk_list(d.key, md.state_dict_metadata[d.key],
                                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s))])
        load[r] = t.t
    res["load_per_rank_s"], res["peak_rss"] = max(load.values()), h.proc_status("VmHWM")
    return res


def table(rows: list[dict[str, Any]], dcp: dict[int, dict[str, Any]]) -> str:
    def s(x: Optional[float]) -> str:
        return "–" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")

    out = []
    for r in rows:
        d = dcp.get(r["world"], {})
        if "error" in r:
            out.append([r["world"], r["error"]] + [""] * 13)
            continue
        mt, sv, mn, ld = r["meta"], r["save"], r["manifest"], r["load"]
        lr = max(ld["ranks"].values(), key=lambda v: v["per_rank_s"])
        out.append([f"{r['world']} ({r['mesh'][0]}x{r['mesh'][1]})", f"{mt['boxes_total']:,}", f"{mn['chunks']:,}",
                    s(mt["unpickle_s_all_ranks"]), s(sv["cache_key_s"]), s(sv["assign_writes_s"]),
                    s(max(v["plan_save_s"] for v in sv["ranks"].values())),
                    f"{mt['bytes_per_rank_mean'] / 1e3:.0f} kB / {mt['bytes_total'] / 1e6:.0f} MB",
                    f"{mn['json_bytes'] / 1e6:.1f} / {mn['zstd_bytes'] / 1e6:.1f}",
                    f"{s(mn['build_manifest_s'])} + {s(mn['encode_s'])}" if "encode_s" in mn else "–",
                    s(mn["decode_s"]), s(lr["check_coverage_index_s"]), s(lr["overlap_plan_s"]),
                    s(d.get("create_global_plan_s")), s(d.get("load_per_rank_s"))])
    return h.md_table(["world", "boxes gathered", "chunks", "unpickle gathered metadata s", "cache key s",
                       "`assign_writes` s", "`pack_items` s", "metadata per rank / total", "manifest JSON / zstd MB",
                       "rank 0 `GatheredLayout.manifest` + `encode` s", "decode s/rank", "load `check_coverage`+`ChunkIndex` "
                       "s/rank", "overlap + `plan_piece` s/rank", "DCP `create_global_plan` s (rank 0)",
                       "DCP load s/rank"], out)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="64,256,1024,4096")
    ap.add_argument("--dcp", default="64,256,1024", help="worlds for the DCP comparison ('' for none)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--load-tp", type=int, default=4)
    ap.add_argument("--load-ratio", type=float, default=0.5, help="load world = save world x this")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per world subprocess")
    ap.add_argument("--full-manifest-max-chunks", type=int, default=2_000_000,
                    help="above this, GatheredLayout.manifest + encode are not run (the JSON is streamed only)")
    ap.add_argument("--plan-for-rank-max-world", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=["objckpt", "dcp"], help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    set_clock(args.clock)
    if args.child:
        res = (run_dcp if args.child == "dcp" else run_objckpt)(args.world, args)
        print(json.dumps(res, default=str), flush=True)
        return
    child_args = list(argv if argv is not None else sys.argv[1:])

    def spawn(kind: str, world: int) -> dict[str, Any]:
        log(f"{kind} world {world} ...")
        r = h.run_json(["-m", "benchmarks.bench_planning_gathered", *child_args, "--child", kind, "--world", str(world)],
                       args.timeout, show_stderr=True, world=world)
        if r.get("ok") is False:
            r["error"] = r.get("error", "")[:300]
        log(json.dumps(r, default=str)[:1500])
        return r

    rows = [spawn("objckpt", int(w)) for w in args.worlds.split(",") if w]
    dcp = {int(w): spawn("dcp", int(w)) for w in args.dcp.split(",") if w}
    report = {"clock": args.clock, "environment": h.environment(), "objckpt": rows, "dcp": list(dcp.values()),
              "table": table(rows, dcp)}
    print(report["table"])
    if args.out:
        h.write_results(args.out, report)


if __name__ == "__main__":
    main()
