"""Multi-rank save and load, objckpt against DCP over s3fs: gloo ranks, FSDP-like DTensors, fast S3 target.

    python -m benchmarks.bench_multirank --scale 0.05 --repeat 1     # quick check
    python -m benchmarks.bench_multirank                             # worlds 2,4, scale 0.25, median of 3

Per world (``--worlds``) a gloo group of spawned ranks (:func:`benchmarks.harness.spawn_gloo`).
Every rank builds the GPT-like state, makes each 2-D tensor a ``Shard(0)`` DTensor over a 1-D
CPU mesh (1-D tensors stay plain, replicated) and loads into zeros with the same placements.
``objckpt.save/load`` against ``dcp.save/load`` with ``FsspecWriter(sync_files=False)`` /
``FsspecReader`` over s3fs, default planners and process group. One untimed warm-up save+load
per method and world, then ``--repeat`` timed ones interleaved across methods.

Wall = rank 0's time between a barrier before and after the op; CPU = every rank's
``process_time`` over the op, summed; per-rank bytes from ``SaveResult/LoadResult.bytes``
(DCP: the server's bytes / world, an approximation); requests and bytes from the server's
counters, reset before each op. Every load is verified shard by shard; a difference aborts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

from . import harness as h
from .methods import dcp, fsspec_reader, fsspec_writer

OPS = ("save", "load")
METHOD_NAMES = ("objckpt", "dcp")


def dtensor_state(scale: float, seed: int, mesh: Any, placements: list, gpt_filter: Any = None) -> tuple:
    """(state, zeros template, global bytes): 2-D tensors as DTensors with ``placements`` on ``mesh``
    (when ``mesh`` is given), the rest plain. ``distribute_tensor(src_data_rank=None)`` splits the
    tensor each rank generated itself; the shard is cloned so the full tensor is freed."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from .gpt_state import iter_gpt_state, scaled_bytes

    def place(full: torch.Tensor) -> Any:
        if mesh is None or full.dim() != 2:
            return full
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
        return DTensor.from_local(dt.to_local().clone(), mesh, placements, run_check=False, shape=dt.shape,
                                  stride=dt.stride())

    state, tmpl, total = {}, {}, 0
    for key, full in iter_gpt_state(scaled_bytes(scale), seed):
        total += full.numel() * full.element_size()
        state[key], tmpl[key] = place(full), place(torch.zeros_like(full))
    return state, tmpl, total


def save_load(method: str, op: str, state: dict, tmpl: dict, uri: str, endpoint: str) -> dict[str, Any]:
    """One op of one method on this rank; objckpt's own byte/request counts."""
    import objckpt

    if method == "objckpt":
        fn = objckpt.save if op == "save" else objckpt.load
        r = fn(state if op == "save" else tmpl, uri, storage_options=h.s3_options(endpoint))
        return {"bytes": r.bytes, "requests": r.requests}
    if op == "save":
        dcp().save(state, storage_writer=fsspec_writer(uri, endpoint))
    else:
        dcp().load(tmpl, storage_reader=fsspec_reader(uri, endpoint))
    return {}


def timed_op(rank: int, world: int, cfg: dict[str, Any], body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Barrier, ``body()``, barrier: rank 0's wall time and server counters, every rank's CPU
    seconds, peak RSS (reset before) and ``body``'s result; a failing rank fails them all."""
    import torch.distributed as dist

    if rank == 0:
        h.server_stats(cfg["endpoint"], reset=True)
        scpu0 = h.cpu_seconds(cfg["server_pid"])
    dist.barrier()
    with h.PeakRss() as rss:
        t0, c0 = time.perf_counter(), time.process_time()
        info, err = {}, None
        try:
            info = body()
        except Exception as e:  # noqa: BLE001 - reported by every rank below
            err = f"{type(e).__name__}: {e}"
        cpu = time.process_time() - c0
        dist.barrier()
        wall = time.perf_counter() - t0
    rec: dict[str, Any] = {"wall_s": wall}
    if rank == 0:
        rec["server"] = h.server_stats(cfg["endpoint"])
        s1 = h.cpu_seconds(cfg["server_pid"])
        rec["server_cpu_s"] = s1 - scpu0 if s1 is not None and scpu0 is not None else None
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, {"cpu_s": cpu, "info": info, "error": err, "peak_rss": rss.op_peak,
                                      "rss_delta": rss.delta})
    errors = [f"rank {r}: {p['error']}" for r, p in enumerate(per_rank) if p["error"]]
    if errors:
        raise RuntimeError("\n".join(errors))
    rec["cpu_s_per_rank"] = [p["cpu_s"] for p in per_rank]
    return rec, per_rank


def verify_all(world: int, state: dict, tmpl: dict, what: str) -> None:
    """Every rank compares its shards with the source; any difference on any rank aborts the run."""
    import torch.distributed as dist

    bad: list[Any] = [None] * world
    dist.all_gather_object(bad, h.differing(state, tmpl)[:5])
    if any(bad):
        raise RuntimeError(f"{what}: VERIFICATION FAILED: {bad}")


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import torch.distributed as dist

    state, tmpl, state_bytes = dtensor_state(cfg["scale"], cfg["seed"], init_device_mesh("cpu", (world,)), [Shard(0)])
    client = h.boto3_client(cfg["endpoint"]) if rank == 0 else None
    runs = []

    def one(method: str, op: str, prefix: str, rep: Optional[int]) -> dict[str, Any]:
        if op == "load":
            h.zero_(tmpl)
        uri = f"s3://{cfg['bucket']}/{prefix}"
        rec, per_rank = timed_op(rank, world, cfg, lambda: save_load(method, op, state, tmpl, uri, cfg["endpoint"]))
        if op == "load":
            verify_all(world, state, tmpl, f"world {world} {method} load")
        rec.update(world=world, method=method, op=op, rep=rep, warmup=rep is None)
        if method == "objckpt":
            rec["bytes_per_rank"] = [p["info"]["bytes"] for p in per_rank]
            rec["requests_per_rank"] = [p["info"]["requests"] for p in per_rank]
        elif rank == 0:  # DCP reports no per-rank bytes
            rec["bytes_per_rank"] = [rec["server"]["bytes_in" if op == "save" else "bytes_out"] / world] * world
        if rank == 0:
            s = rec["server"]
            h.log(f"world {world} {method:8s} {op:4s} {'warm-up' if rep is None else f'rep {rep}':7s}: "
                  f"{rec['wall_s']:6.3f} s, CPU {sum(rec['cpu_s_per_rank']):5.2f} s, {sum(s['requests'].values())} "
                  f"reqs, in {s['bytes_in'] / 1e6:.0f} MB, out {s['bytes_out'] / 1e6:.0f} MB")
        return rec

    for rep in [None] + list(range(cfg["repeat"])):  # an untimed warm-up, then interleaved across methods
        for method in cfg["methods"]:
            prefix = f"{cfg['run_id']}/w{world}/{method}/{'warmup' if rep is None else f'r{rep}'}"
            recs = [one(method, op, prefix, rep) for op in OPS]
            runs += recs if rep is not None else []
            if rank == 0:
                h.delete_prefix(client, cfg["bucket"], prefix)
            dist.barrier()
    return {"world": world, "state_bytes": state_bytes, "tensors": len(state), "runs": runs}


def summarize(world: int, method: str, runs: list[dict[str, Any]], state_bytes: int) -> dict[str, Any]:
    gb = state_bytes / 1e9
    out: dict[str, Any] = {"world": world, "method": method}
    for op in OPS:
        rs = [r for r in runs if r["method"] == method and r["op"] == op]
        d = {"n": len(rs), "wall_s": h.median(r["wall_s"] for r in rs),
             "cpu_s_total": h.median(sum(r["cpu_s_per_rank"]) for r in rs),
             "requests": h.median(sum(r["server"]["requests"].values()) for r in rs),
             "server_bytes_in": h.median(r["server"]["bytes_in"] for r in rs),
             "server_bytes_out": h.median(r["server"]["bytes_out"] for r in rs),
             "server_cpu_s": h.median(r.get("server_cpu_s") for r in rs),
             "bytes_per_rank": [h.median(r["bytes_per_rank"][k] for r in rs) for k in range(world)]}
        d["gbps"] = gb / d["wall_s"] if d["wall_s"] else None
        d["cpu_s_per_gb"] = d["cpu_s_total"] / gb if d["cpu_s_total"] is not None else None
        out[op] = d
    return out


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    head = ["world", "method", "save s", "load s", "CPU-s/GB save", "CPU-s/GB load", "save reqs / MB in",
            "load reqs / MB out", "MB/rank save", "MB/rank load", "server CPU-s save / load"]

    def per_rank(d: dict[str, Any], method: str) -> str:
        lo, hi = min(d["bytes_per_rank"]) / 1e6, max(d["bytes_per_rank"]) / 1e6
        return (f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}") + ("*" if method == "dcp" else "")

    rows = []
    for s in summaries:
        sv, ld = s["save"], s["load"]
        rows.append([s["world"], s["method"], h.fmt(sv["wall_s"]), h.fmt(ld["wall_s"]), h.fmt(sv["cpu_s_per_gb"]),
                     h.fmt(ld["cpu_s_per_gb"]), f"{sv['requests']:.0f} / {sv['server_bytes_in'] / 1e6:.0f}",
                     f"{ld['requests']:.0f} / {ld['server_bytes_out'] / 1e6:.0f}", per_rank(sv, s["method"]),
                     per_rank(ld, s["method"]), f"{h.fmt(sv['server_cpu_s'], '{:.2f}')} / "
                     f"{h.fmt(ld['server_cpu_s'], '{:.2f}')}"])
        o, d = ({x["method"]: x for x in summaries if x["world"] == s["world"]}.get(m) for m in METHOD_NAMES)
        if s["method"] == "dcp" and o and d:
            rows.append([s["world"], "**objckpt/DCP**"] + [h.ratio(o[op][f], d[op][f]) for f in ("wall_s", "cpu_s_per_gb")
                                                            for op in OPS] + [""] * 5)
    return h.md_table(head, rows)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--scale", type=float, default=0.25, help="state size relative to 1.03 GiB")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions per method and world (medians)")
    ap.add_argument("--methods", default=",".join(METHOD_NAMES), help="subset of objckpt,dcp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", default="bench-multirank")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads in each rank")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per world before the ranks are killed")
    ap.add_argument("--out", default=h.result_path("multirank"))
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    methods = [m for m in args.methods.split(",") if m]
    cpus = os.cpu_count() or 1
    t0 = time.perf_counter()
    summaries, raw = [], []
    notes = ["wall = rank 0's perf_counter between a barrier before and after the op",
             "CPU = sum over ranks of process_time over the op; server CPU separate",
             "DCP per-rank bytes = server bytes / world (approximation); GB = 1e9 bytes"]
    with h.Server("fast", args.bucket) as server:
        for world in worlds:
            if world + 1 > cpus:
                notes.append(f"world {world}: {world} ranks + the S3 server on {cpus} cores: oversubscribed")
                h.log(notes[-1])
            cfg = {"endpoint": server.url, "server_pid": server.pid, "bucket": args.bucket,
                   "run_id": h.run_id("mr"), "scale": args.scale, "seed": args.seed, "repeat": args.repeat,
                   "methods": methods, "torch_threads": args.torch_threads, "pg_timeout": args.timeout}
            w = h.spawn_gloo(world, rank_main, cfg, args.timeout)
            raw.append(w)
            summaries += [summarize(world, m, w["runs"], w["state_bytes"]) for m in methods]
    table = markdown_table(summaries)
    state_bytes = raw[0]["state_bytes"] if raw else 0
    path = h.write_results(args.out, {"config": dict(vars(args), worlds=worlds, methods=methods),
                                      "environment": h.environment("s3fs", "fsspec", "aiobotocore"), "notes": notes,
                                      "state_bytes": state_bytes, "summary": summaries, "worlds_raw": raw,
                                      "table_markdown": table, "total_s": time.perf_counter() - t0})
    print(f"\n{raw[0]['tensors'] if raw else 0} tensors, {state_bytes / 1e9:.3f} GB, 2-D tensors Shard(0), 1-D "
          f"replicated; median of {args.repeat} after one warm-up\n\n{table}\n\n* DCP MB/rank = server bytes / world. "
          f"objckpt/DCP rows: ratios of the medians (< 1: objckpt better).\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
