"""Collective loads: direct vs broadcast vs allgather (vs DCP), gloo ranks, fast S3 target.

    python -m benchmarks.bench_collective --scale 0.05 --repeat 1     # quick check
    python -m benchmarks.bench_collective                             # 4 ranks, scale 0.25, median of 3

Layouts: ``replicated`` (every tensor plain and whole on every rank: one replica group of
the whole world) and ``dp2xtp`` (a (2, world/2) mesh; 2-D tensors ``[Replicate(), Shard(0)]``,
1-D plain). Each is saved once (objckpt, and DCP's ``FsspecWriter`` for the DCP method), then
loaded into zeros by ``objckpt.load(read_strategy=direct|broadcast|allgather|auto)`` and by
``dcp.load`` with ``FsspecReader`` over s3fs.

Storage regimes (``--limits CLIENT/SHARED`` MB/s, 0 = none): unlimited (CPU-bound on 2 cores)
and storage-bound ones, emulated by :class:`LimitedStore` (it sleeps, which costs no CPU).
DCP reads through s3fs and cannot be limited that way: it runs only unlimited. One untimed
warm-up load per layout, limit and method, then ``--repeat`` timed loads interleaved across
methods, as in :mod:`benchmarks.bench_multirank` (whose barrier timing this uses); peak RSS Δ is
each rank's ``VmHWM`` after a reset before the load minus its RSS then. Every load is verified
bit for bit on every rank.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, Optional

from . import harness as h
from .bench_multirank import dtensor_state, save_load, timed_op, verify_all

METHOD_NAMES = ("direct", "broadcast", "allgather", "auto", "dcp")
LAYOUTS = ("replicated", "dp2xtp")


class LimitedStore:
    """Wraps an objckpt store so that storage, not the client, is the bottleneck.

    ``client_mbps``: this rank never reads faster; ``shared_mbps``: all ranks together never read
    faster (one clock in shared memory). Each read reserves its transfer time on both clocks
    (FIFO from when it was issued) and, once its bytes are in, sleeps until the later
    reservation ends. 0 = no limit."""

    def __init__(self, inner: Any, client_mbps: float, shared_mbps: float, shared_clock: Any) -> None:
        self._inner, self._client, self._shared, self._clock = inner, client_mbps * 1e6, shared_mbps * 1e6, shared_clock
        self._free_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _wait(self, nbytes: int, issued: float) -> None:
        done = issued
        if self._client:
            self._free_at = done = max(issued, self._free_at) + nbytes / self._client
        if self._shared:
            with self._clock.get_lock():
                self._clock.value = max(issued, self._clock.value) + nbytes / self._shared
                done = max(done, self._clock.value)
        if done > time.monotonic():
            await asyncio.sleep(done - time.monotonic())

    async def get(self, key: str) -> bytes:
        t = time.monotonic()
        data = await self._inner.get(key)
        await self._wait(len(data), t)
        return data

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        t = time.monotonic()
        data = await self._inner.get_range(key, offset, length)
        await self._wait(len(data), t)
        return data

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        t = time.monotonic()
        await self._inner.get_range_into(key, offset, out)
        await self._wait(len(out), t)

    async def get_range_scatter(self, key: str, offset: int, outs: Any) -> None:
        t = time.monotonic()
        await self._inner.get_range_scatter(key, offset, outs)
        await self._wait(sum(len(o) for o in outs), t)


def limit_name(limit: tuple[float, float]) -> str:
    client, shared = limit
    return ", ".join(([f"{client:.0f} MB/s per rank"] if client else []) +
                     ([f"{shared:.0f} MB/s shared"] if shared else [])) or "none"


def rank_main(rank: int, world: int, cfg: dict[str, Any], clock: Any) -> dict[str, Any]:
    return {layout: run_layout(rank, world, cfg, layout, clock) for layout in cfg["layouts"]}


def run_layout(rank: int, world: int, cfg: dict[str, Any], layout: str, clock: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import objckpt
    from objckpt.storage import open_store

    endpoint, opts = cfg["endpoint"], h.s3_options(cfg["endpoint"])
    mesh = init_device_mesh("cpu", (2, world // 2)) if layout == "dp2xtp" else None
    state, tmpl, state_bytes = dtensor_state(cfg["scale"], cfg["seed"], mesh, [Replicate(), Shard(0)])
    base = f"s3://{cfg['bucket']}/{cfg['run_id']}/{layout}"
    for m in ("objckpt",) + (("dcp",) if "dcp" in cfg["methods"] else ()):
        save_load(m, "save", state, tmpl, f"{base}/{m}", endpoint)
    dist.barrier()
    held = sum(h.local(v).numel() * h.local(v).element_size() for v in state.values())
    if rank == 0:
        h.log(f"{layout}: {state_bytes / h.GiB:.3f} GiB, {len(state)} tensors, {held / h.GiB:.3f} GiB held per rank")

    def load(method: str, limit: tuple[float, float]) -> dict[str, Any]:
        if method == "dcp":
            return save_load("dcp", "load", state, tmpl, f"{base}/dcp", endpoint)
        store = open_store(f"{base}/objckpt", opts)[0]
        if any(limit):
            store = LimitedStore(store, limit[0], limit[1], clock)
        r = objckpt.load(tmpl, f"{base}/objckpt", store=store, read_strategy=method)
        return {"bytes": r.bytes, "requests": r.requests, "received": r.received_bytes, "strategy": r.strategy}

    def one(method: str, limit: tuple[float, float], rep: Optional[int]) -> dict[str, Any]:
        h.zero_(tmpl)
        rec, per_rank = timed_op(rank, world, cfg, lambda: load(method, limit))
        verify_all(world, state, tmpl, f"{layout} {method} load")
        rec.update(layout=layout, limit=limit_name(limit), method=method, rep=rep, warmup=rep is None,
                   info_per_rank=[p["info"] for p in per_rank], peak_rss_per_rank=[p["peak_rss"] for p in per_rank],
                   peak_rss_delta_per_rank=[p["rss_delta"] for p in per_rank])
        if rank == 0:
            s, strat = rec["server"], {p["info"].get("strategy") for p in per_rank} - {None}
            h.log(f"{layout} [{limit_name(limit)}] {method:9s} {'warm-up' if rep is None else f'rep {rep}':7s}: "
                  f"{rec['wall_s']:6.3f} s, storage {s['bytes_out'] / 1e6:7.1f} MB in {sum(s['requests'].values())} "
                  f"reqs, CPU {sum(rec['cpu_s_per_rank']):5.2f} s {'/'.join(sorted(strat))}  [verified]")
        return rec

    runs = []
    for limit in map(tuple, cfg["limits"]):
        methods = [m for m in cfg["methods"] if not (m == "dcp" and any(limit))]
        for rep in [None] + list(range(cfg["repeat"])):
            recs = [one(m, limit, rep) for m in methods]
            runs += recs if rep is not None else []
    return {"state_bytes": state_bytes, "held_bytes_per_rank": held, "tensors": len(state), "runs": runs}


def summarize(layout: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    gb = res["state_bytes"] / 1e9
    for limit in dict.fromkeys(r["limit"] for r in res["runs"]):
        for method in METHOD_NAMES:
            rs = [r for r in res["runs"] if r["limit"] == limit and r["method"] == method]
            if not rs:
                continue
            infos = [i for r in rs for i in r["info_per_rank"] if i]
            d = {"layout": layout, "limit": limit, "method": method, "n": len(rs),
                 "wall_s": h.median(r["wall_s"] for r in rs),
                 "storage_bytes": h.median(r["server"]["bytes_out"] for r in rs),
                 "requests": h.median(sum(r["server"]["requests"].values()) for r in rs),
                 "cpu_s_total": h.median(sum(r["cpu_s_per_rank"]) for r in rs),
                 "server_cpu_s": h.median(r.get("server_cpu_s") for r in rs),
                 "peak_rss_max": h.median(max(x or 0 for x in r["peak_rss_per_rank"]) for r in rs),
                 "peak_rss_delta_max": h.median(max(x or 0 for x in r["peak_rss_delta_per_rank"]) for r in rs),
                 "received_per_rank_mb": h.median(i["received"] / 1e6 for i in infos) if infos else None,
                 "strategy": "/".join(sorted({i["strategy"] for i in infos})) or None}
            d["storage_copies"] = d["storage_bytes"] / res["state_bytes"]
            d["cpu_s_per_gb"] = d["cpu_s_total"] / gb
            out.append(d)
    for d in out:  # wall time relative to direct reads under the same limit
        base = next((x for x in out if x["limit"] == d["limit"] and x["method"] == "direct"), None)
        d["vs_direct"] = d["wall_s"] / base["wall_s"] if base and base["wall_s"] and d["wall_s"] else None
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["layout", "storage limit", "method", "load s", "vs direct", "storage MB (copies)", "requests",
            "MB received / rank", "CPU-s/GB", "peak RSS Δ (max rank)", "strategy"]
    return h.md_table(head, ([
        d["layout"], d["limit"], d["method"], h.fmt(d["wall_s"]), h.fmt(d["vs_direct"], "{:.2f}x"),
        f"{d['storage_bytes'] / 1e6:.0f} ({d['storage_copies']:.2f})", h.fmt(d["requests"], "{:.0f}"),
        h.fmt(d["received_per_rank_mb"], "{:.0f}"), h.fmt(d["cpu_s_per_gb"], "{:.2f}"),
        h.fmt(d["peak_rss_delta_max"] / 2**20, "{:.0f} MiB"), d["strategy"] or "–"] for d in rows))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="ranks (even, for the dp2xtp layout)")
    ap.add_argument("--scale", type=float, default=0.25, help="state size relative to 1.03 GiB")
    ap.add_argument("--repeat", type=int, default=3, help="timed loads per method (medians)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--methods", default=",".join(METHOD_NAMES))
    ap.add_argument("--limits", default="0/0,200/400", help="storage regimes, comma-separated CLIENT/SHARED MB/s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", default="bench-collective")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=h.result_path("collective"))
    args = ap.parse_args(argv)
    layouts, methods = [x for x in args.layouts.split(",") if x], [x for x in args.methods.split(",") if x]
    limits = [tuple(float(v or 0) for v in x.partition("/")[::2]) for x in args.limits.split(",") if x]
    if any(m not in METHOD_NAMES for m in methods) or any(x not in LAYOUTS for x in layouts) or args.world % 2:
        ap.error(f"--methods within {METHOD_NAMES}, --layouts within {LAYOUTS}, --world even")
    import multiprocessing

    t0, cpus = time.perf_counter(), os.cpu_count() or 1
    with h.Server("fast", args.bucket) as server:
        cfg = {"endpoint": server.url, "server_pid": server.pid, "bucket": args.bucket, "run_id": h.run_id("coll"),
               "scale": args.scale, "seed": args.seed, "repeat": args.repeat, "methods": methods, "layouts": layouts,
               "limits": limits, "torch_threads": args.torch_threads, "pg_timeout": args.timeout}
        clock = multiprocessing.get_context("spawn").Value("d", 0.0)  # the shared storage limit's clock
        raw = h.spawn_gloo(args.world, rank_main, cfg, args.timeout, (clock,))
    rows = [d for layout in layouts for d in summarize(layout, raw[layout])]
    table = markdown_table(rows)
    notes = ["wall = rank 0's perf_counter between barriers; storage bytes/requests = the server's counters",
             "CPU-s/GB = all ranks' process CPU over the load / checkpoint GB (server excluded)",
             "peak RSS delta = VmHWM after a reset before the load minus VmRSS then; max over ranks",
             f"{args.world} ranks + the server on {cpus} cores" + (": oversubscribed" if args.world + 1 > cpus else "")]
    path = h.write_results(args.out, {"config": dict(vars(args), layouts=layouts, methods=methods, limits=limits),
                                      "environment": h.environment("s3fs"), "notes": notes, "summary": rows,
                                      "raw": raw, "table_markdown": table, "total_s": time.perf_counter() - t0})
    for layout in layouts:
        r = raw[layout]
        print(f"{layout}: {r['tensors']} tensors, {r['state_bytes'] / 1e9:.3f} GB checkpoint, "
              f"{r['held_bytes_per_rank'] / 1e9:.3f} GB held per rank")
    print(f"median of {args.repeat} after one warm-up\n\n{table}\n\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
