"""Collective loads: direct vs broadcast vs allgather (vs DCP) with 4 gloo ranks, fast S3 server.

    python -m benchmarks.bench_collective --scale 0.05 --repeat 1     # quick check (~1 min)
    python -m benchmarks.bench_collective                             # scale 0.25, median of 3

Starts objckpt's fast in-memory S3 server in its own process (as
:mod:`benchmarks.bench_multirank` does, whose helpers this reuses) and spawns
``--world`` gloo ranks.  Every rank builds the GPT-like state of
:mod:`benchmarks.gpt_state` in one of two layouts:

* ``replicated``: every tensor plain, whole on every rank (data-parallel
  replicas, DDP-like): a replica group of the whole world;
* ``dp2xtp``: a (2, world/2) DeviceMesh; 2-D tensors DTensors
  ``[Replicate(), Shard(0)]`` (each TP shard held by the 2 ranks of a DP
  group), 1-D tensors plain.

The state is saved once per layout with ``objckpt.save`` (and with DCP's
``FsspecWriter`` for the DCP method), then loaded into a zeroed template of
the same layout by each method:

* ``direct``, ``broadcast``, ``allgather``, ``auto``: ``objckpt.load(...,
  read_strategy=...)``;
* ``dcp``: ``torch.distributed.checkpoint.load`` with ``FsspecReader`` over
  s3fs (default planner), as in ``bench_multirank``.

Storage regimes (``--limits``, ``CLIENT/SHARED`` MB/s, 0 = none): unlimited
(on this 2-core VM everything is then CPU-bound: ranks, server and gloo share
the cores) and storage-bound ones, emulated by :class:`LimitedStore`: each
rank reads at most CLIENT MB/s, all ranks together at most SHARED MB/s (the
wrapper sleeps, which costs no CPU, so storage really is the bottleneck).
DCP reads through s3fs and cannot be limited the same way: it runs only
unlimited.

Per layout, limit and method: one untimed warm-up load, then ``--repeat``
timed loads interleaved across methods.  Per load: rank 0 resets the server
stats, barrier, load, barrier; wall = rank 0's ``perf_counter`` between the
barriers; CPU = each rank's ``time.process_time`` over the load; peak RSS =
each rank's ``VmHWM`` after resetting it (``/proc/self/clear_refs``) just
before the load, minus the RSS then; storage bytes and requests from the
server's ``/_objckpt/stats`` (objckpt's per-rank ``LoadResult.bytes`` /
``requests`` / ``received_bytes`` / ``strategy`` are kept too).  Every load
is verified bit for bit against the source on every rank.

Medians go to a markdown table and everything to
``benchmarks/results/collective.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

from .bench_async import _proc_status, _reset_peak_rss
from .bench_multirank import (
    RESULTS_DIR,
    FastS3Server,
    _DcpMethod,
    _environment,
    _med,
    _reset_stats,
    _server_cpu,
    _spawn_world,
    _stats,
    in_gloo_group,
)

GiB = 1 << 30
METHOD_NAMES = ("direct", "broadcast", "allgather", "auto", "dcp")
LAYOUTS = ("replicated", "dp2xtp")


# --------------------------------------------------------------------------- storage limit


class LimitedStore:
    """Wraps an objckpt store so that storage, not the client, is the bottleneck.

    ``client_mbps``: this rank never reads faster (its own link); ``shared_mbps``:
    all ranks together never read faster (what the storage service or a shared
    NIC gives them), kept on one clock in shared memory.  Each read reserves its
    transfer time on both clocks (FIFO from when it was issued) and, once its
    bytes are in, sleeps until the later reservation ends: sleeping costs no
    CPU, so the limits hold even on an oversubscribed machine.  0 = no limit."""

    def __init__(self, inner: Any, client_mbps: float, shared_mbps: float, shared_clock: Any) -> None:
        self._inner = inner
        self._client = client_mbps * 1e6
        self._shared = shared_mbps * 1e6
        self._clock = shared_clock
        self._free_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def _wait(self, nbytes: int, issued: float) -> None:
        done = issued
        if self._client:
            self._free_at = max(issued, self._free_at) + nbytes / self._client
            done = self._free_at
        if self._shared:
            with self._clock.get_lock():
                self._clock.value = max(issued, self._clock.value) + nbytes / self._shared
                done = max(done, self._clock.value)
        delay = done - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

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


def parse_limit(text: str) -> tuple[float, float]:
    """``"CLIENT/SHARED"`` MB/s (0 = none), e.g. ``200/400``; a bare number limits each client only."""
    client, _, shared = text.partition("/")
    return float(client or 0), float(shared or 0)


def limit_name(limit: tuple[float, float]) -> str:
    client, shared = limit
    parts = ([f"{client:.0f} MB/s per rank"] if client else []) + ([f"{shared:.0f} MB/s shared"] if shared else [])
    return ", ".join(parts) or "none"


# --------------------------------------------------------------------------- ranks


def _build(layout: str, world: int, scale: float, seed: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(state, zeroed template, global state bytes) in ``layout``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from .gpt_state import iter_gpt_state, scaled_bytes

    mesh = init_device_mesh("cpu", (2, world // 2)) if layout == "dp2xtp" else None
    placements = [Replicate(), Shard(0)]

    def place(full: torch.Tensor) -> Any:
        if mesh is None or full.dim() != 2:
            return full
        dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
        return DTensor.from_local(dt.to_local().clone(), mesh, placements, run_check=False,
                                  shape=dt.shape, stride=dt.stride())

    state: dict[str, Any] = {}
    tmpl: dict[str, Any] = {}
    total = 0
    for key, full in iter_gpt_state(scaled_bytes(scale), seed):
        total += full.numel() * full.element_size()
        state[key] = place(full)
        tmpl[key] = place(torch.zeros_like(full))
    return state, tmpl, total


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _verify(state: dict[str, Any], tmpl: dict[str, Any]) -> list[str]:
    import torch

    return [k for k, v in state.items() if not torch.equal(_local(tmpl[k]), _local(v))]


def _held_bytes(state: dict[str, Any]) -> int:
    return sum(_local(v).numel() * _local(v).element_size() for v in state.values())


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], result_path: str, clock: Any) -> None:
    def body() -> None:
        out = {layout: _run_layout(rank, world, cfg, layout, clock) for layout in cfg["layouts"]}
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(out, f)

    in_gloo_group(rank, world, port, cfg, body)


def _run_layout(rank: int, world: int, cfg: dict[str, Any], layout: str, clock: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import objckpt
    from objckpt.storage import open_store

    endpoint = cfg["endpoint"]
    opts = {"endpoint_url": endpoint, "region_name": "us-east-1",
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    state, tmpl, state_bytes = _build(layout, world, cfg["scale"], cfg["seed"])
    base = f"s3://{cfg['bucket']}/{cfg['run_id']}/{layout}"
    objckpt.save(state, f"{base}/objckpt", storage_options=opts)
    dcp = _DcpMethod(cfg) if "dcp" in cfg["methods"] else None
    if dcp is not None:
        dcp.save(state, f"{base}/dcp")
    dist.barrier()
    held = _held_bytes(state)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    log(f"{layout}: {state_bytes / GiB:.3f} GiB, {len(state)} tensors, {held / GiB:.3f} GiB held per rank")

    def one(method: str, limit: tuple[float, float], rep: Optional[int]) -> dict[str, Any]:
        with torch.no_grad():
            for v in tmpl.values():
                _local(v).zero_()
        if rank == 0:
            _reset_stats(endpoint)
            scpu0 = _server_cpu(cfg["server_pid"])
        dist.barrier()
        _reset_peak_rss()
        rss0 = _proc_status("VmRSS")
        t0 = time.perf_counter()
        c0 = time.process_time()
        info: dict[str, Any] = {}
        err = None
        try:
            if method == "dcp":
                dcp.load(tmpl, f"{base}/dcp")  # type: ignore[union-attr]
            else:
                uri = f"{base}/objckpt"
                store = open_store(uri, opts)[0]
                if any(limit):
                    store = LimitedStore(store, limit[0], limit[1], clock)
                r = objckpt.load(tmpl, uri, store=store, read_strategy=method)
                info = {"bytes": r.bytes, "requests": r.requests, "received": r.received_bytes,
                        "strategy": r.strategy}
        except Exception as e:  # noqa: BLE001 - reported by every rank below
            err = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        cpu = time.process_time() - c0
        dist.barrier()
        wall = time.perf_counter() - t0
        peak = _proc_status("VmHWM")
        rec: dict[str, Any] = {"layout": layout, "limit": limit_name(limit), "method": method, "rep": rep,
                               "warmup": rep is None, "wall_s": wall}
        if rank == 0:
            rec["server"] = _stats(endpoint)
            s1 = _server_cpu(cfg["server_pid"])
            rec["server_cpu_s"] = (s1 - scpu0) if s1 is not None and scpu0 is not None else None
        bad = _verify(state, tmpl) if err is None else []
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, {"cpu_s": cpu, "info": info, "error": err, "bad": bad[:5],
                                          "peak_rss": peak, "rss_before": rss0})
        errors = [f"rank {r}: {p['error']}" for r, p in enumerate(per_rank) if p["error"]]
        if errors:
            raise RuntimeError(f"{layout} {method} load failed:\n" + "\n".join(errors))
        mism = [f"rank {r}: {p['bad']}" for r, p in enumerate(per_rank) if p["bad"]]
        if mism:
            raise RuntimeError(f"{layout} {method} load VERIFICATION FAILED:\n" + "\n".join(mism))
        rec["cpu_s_per_rank"] = [p["cpu_s"] for p in per_rank]
        rec["info_per_rank"] = [p["info"] for p in per_rank]
        rec["peak_rss_per_rank"] = [p["peak_rss"] for p in per_rank]
        rec["peak_rss_delta_per_rank"] = [p["peak_rss"] - p["rss_before"] if p["peak_rss"] and p["rss_before"]
                                          else None for p in per_rank]
        if rank == 0:
            s = rec["server"]
            strat = {p["info"].get("strategy") for p in per_rank} - {None}
            log(f"{layout} [{limit_name(limit)}] {method:9s} {'warm-up' if rep is None else f'rep {rep}':7s}: "
                f"{wall:6.3f} s, storage {s['bytes_out'] / 1e6:7.1f} MB in {sum(s['requests'].values())} reqs, "
                f"CPU {sum(rec['cpu_s_per_rank']):5.2f} s {'/'.join(sorted(strat))}  [verified]")
        return rec

    runs: list[dict[str, Any]] = []
    for limit in cfg["limits"]:
        limit = tuple(limit)  # type: ignore[assignment]
        methods = [m for m in cfg["methods"] if not (m == "dcp" and any(limit))]
        for m in methods:
            one(m, limit, None)
        for rep in range(cfg["repeat"]):
            for m in methods:
                runs.append(one(m, limit, rep))
    return {"state_bytes": state_bytes, "held_bytes_per_rank": held, "tensors": len(state), "runs": runs}


# --------------------------------------------------------------------------- summary (parent)


def summarize(layout: str, res: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    gb = res["state_bytes"] / 1e9
    order = list(dict.fromkeys(r["limit"] for r in res["runs"]))
    keys = sorted({(r["limit"], r["method"]) for r in res["runs"]},
                  key=lambda k: (order.index(k[0]), METHOD_NAMES.index(k[1])))
    for limit, method in keys:
        rs = [r for r in res["runs"] if r["limit"] == limit and r["method"] == method and not r["warmup"]]
        d: dict[str, Any] = {"layout": layout, "limit": limit, "method": method, "n": len(rs)}
        d["wall_s"] = _med([r["wall_s"] for r in rs])
        d["storage_bytes"] = _med([r["server"]["bytes_out"] for r in rs])
        d["storage_copies"] = d["storage_bytes"] / res["state_bytes"] if d["storage_bytes"] is not None else None
        d["requests"] = _med([sum(r["server"]["requests"].values()) for r in rs])
        d["cpu_s_total"] = _med([sum(r["cpu_s_per_rank"]) for r in rs])
        d["cpu_s_per_gb"] = d["cpu_s_total"] / gb if d["cpu_s_total"] is not None else None
        d["server_cpu_s"] = _med([r.get("server_cpu_s") for r in rs])
        d["peak_rss_max"] = _med([max(x for x in r["peak_rss_per_rank"] if x) for r in rs])
        d["peak_rss_delta_max"] = _med([max(x for x in r["peak_rss_delta_per_rank"] if x is not None) for r in rs])
        infos = [i for r in rs for i in r["info_per_rank"] if i]
        d["received_per_rank_mb"] = _med([i["received"] / 1e6 for i in infos]) if infos else None
        d["strategy"] = "/".join(sorted({i["strategy"] for i in infos})) if infos else None
        out.append(d)
    for d in out:  # wall time relative to direct reads under the same limit
        base = next((x for x in out if x["limit"] == d["limit"] and x["method"] == "direct"), None)
        d["vs_direct"] = d["wall_s"] / base["wall_s"] if base and base["wall_s"] and d["wall_s"] else None
    return out


def _f(x: Optional[float], fmt: str = "{:.3g}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["layout", "storage limit", "method", "load s", "vs direct", "storage MB (copies)", "requests",
            "MB received / rank", "CPU-s/GB", "peak RSS Δ (max rank)", "strategy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in rows:
        lines.append("| " + " | ".join([
            d["layout"], d["limit"],
            d["method"], _f(d["wall_s"]), _f(d["vs_direct"], "{:.2f}x"),
            f"{_f(d['storage_bytes'] and d['storage_bytes'] / 1e6, '{:.0f}')} ({_f(d['storage_copies'], '{:.2f}')})",
            _f(d["requests"], "{:.0f}"), _f(d["received_per_rank_mb"], "{:.0f}"), _f(d["cpu_s_per_gb"], "{:.2f}"),
            _f(d["peak_rss_delta_max"] and d["peak_rss_delta_max"] / 2**20, "{:.0f} MiB"), d["strategy"] or "–",
        ]) + " |")
    return "\n".join(lines)


def _spawn(world: int, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    import multiprocessing

    clock = multiprocessing.get_context("spawn").Value("d", 0.0)  # the shared storage limit's clock
    return _spawn_world(world, cfg, timeout, _rank_main, (clock,))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Collective loads vs direct reads vs DCP, gloo ranks, fast S3 server.")
    ap.add_argument("--world", type=int, default=4, help="ranks (even, for the dp2xtp layout)")
    ap.add_argument("--scale", type=float, default=0.25, help="state size relative to 1.03 GiB")
    ap.add_argument("--repeat", type=int, default=3, help="timed loads per method (medians)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--methods", default=",".join(METHOD_NAMES))
    ap.add_argument("--limits", default="0/0,200/400",
                    help="storage regimes, comma-separated CLIENT/SHARED MB/s (0 = none): per rank / all ranks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", default="bench-collective")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "collective.json"))
    args = ap.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    methods = [x for x in args.methods.split(",") if x]
    limits = [parse_limit(x) for x in args.limits.split(",") if x]
    if any(m not in METHOD_NAMES for m in methods) or any(x not in LAYOUTS for x in layouts):
        ap.error(f"--methods within {METHOD_NAMES}, --layouts within {LAYOUTS}")
    if args.world % 2:
        ap.error("--world must be even")

    from .bench_save_load import _client

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id = f"coll-{stamp}-{os.getpid()}"
    cpus = os.cpu_count() or 1
    t_start = time.perf_counter()
    server = FastS3Server(os.path.join(tempfile.gettempdir(), f"{run_id}-server.log"))
    try:
        print(f"fast S3 server at {server.endpoint_url} (pid {server.proc.pid}); {args.world} ranks on {cpus} cores"
              + (" (OVERSUBSCRIBED)" if args.world + 1 > cpus else ""), file=sys.stderr)
        _client(server.endpoint_url).create_bucket(Bucket=args.bucket)
        cfg = {"endpoint": server.endpoint_url, "server_pid": server.proc.pid, "bucket": args.bucket,
               "run_id": run_id, "scale": args.scale, "seed": args.seed, "repeat": args.repeat,
               "methods": methods, "layouts": layouts, "limits": limits, "torch_threads": args.torch_threads,
               "pg_timeout": args.timeout}
        raw = _spawn(args.world, cfg, args.timeout)
    except BaseException:
        print(f"server log kept: {server.log_path}", file=sys.stderr)
        server.log_path = ""
        raise
    finally:
        server.stop()
        if server.log_path:
            try:
                os.remove(server.log_path)
            except OSError:
                pass
    rows = [d for layout in layouts for d in summarize(layout, raw[layout])]
    table = markdown_table(rows)
    results = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": vars(args) | {"layouts": layouts, "methods": methods, "limits": limits},
        "environment": _environment(),
        "notes": [
            "wall = rank 0's perf_counter between a barrier before and after the load",
            "storage bytes / requests = the S3 server's counters over the load (all ranks)",
            "CPU-s/GB = sum over ranks of process CPU over the load / checkpoint GB (server excluded)",
            "peak RSS delta = VmHWM after resetting it before the load, minus VmRSS then; max over ranks",
            "storage limit: objckpt store wrapper (LimitedStore) sleeping so that one rank reads at most "
            "CLIENT MB/s and all ranks together at most SHARED MB/s; DCP is not limited and runs only without one",
            f"{args.world} ranks + the server on {cpus} cores" + (": oversubscribed" if args.world + 1 > cpus else ""),
        ],
        "summary": rows,
        "raw": raw,
        "table_markdown": table,
        "total_s": time.perf_counter() - t_start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(args.out + ".tmp", args.out)
    for layout in layouts:
        r = raw[layout]
        print(f"{layout}: {r['tensors']} tensors, {r['state_bytes'] / 1e9:.3f} GB checkpoint, "
              f"{r['held_bytes_per_rank'] / 1e9:.3f} GB held per rank")
    print(f"median of {args.repeat} after one warm-up; total {results['total_s']:.0f} s\n")
    print(table)
    print(f"\nresults: {os.path.relpath(os.path.abspath(args.out), os.path.dirname(RESULTS_DIR))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
