"""The cost of ``CheckpointManager.reached_preemption(step)`` per call on gloo ranks.

    python -m benchmarks.bench_preemption                       # 2, 4, 8, 16 ranks, 400 calls each
    python -m benchmarks.bench_preemption --worlds 2,4 --calls 200 --out ""

Every rank makes a manager (a local root, ``preemption_check_every=1``: every call is the
all-reduce), calls ``reached_preemption`` ``--warmup`` times, meets the others at a barrier,
then times ``--calls`` calls one by one (no signal arrives: the steady-state cost a training
loop pays).  Per rank: the median, 90th percentile and mean wall time of one call, and the
CPU seconds per call (``time.process_time``).  The ranks are forked from a forkserver that
imported torch once (testkit.procs).  The load average is recorded: the ranks share the
machine's cores, so above the core count a call costs as much as the scheduler makes it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from . import harness as h


def _rank(rank: int, world: int, rdzv: str, root: str, warmup: int, calls: int, q: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    import objckpt

    m = objckpt.CheckpointManager(root, preemption_check_every=1)
    try:
        for s in range(warmup):
            m.reached_preemption(s)
        dist.barrier()
        times = []
        cpu0 = time.process_time()
        for s in range(warmup, warmup + calls):
            t0 = time.perf_counter()
            if m.reached_preemption(s):
                raise RuntimeError("no signal was sent, yet the ranks agreed on a preemption")
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        times.sort()
        q.put((rank, {"p50_us": 1e6 * statistics.median(times), "p90_us": 1e6 * times[int(0.9 * (len(times) - 1))],
                      "mean_us": 1e6 * statistics.fmean(times), "cpu_us_per_call": 1e6 * cpu / calls}))
        m.close()
    finally:
        dist.destroy_process_group()


def measure(world: int, warmup: int, calls: int) -> dict[str, Any]:
    from testkit.procs import rank_context

    ctx = rank_context()
    tmp = tempfile.mkdtemp(prefix="objckpt-bench-preempt-")
    q = ctx.Queue()
    load_before = os.getloadavg()[0]
    try:
        procs = [ctx.Process(target=_rank, args=(r, world, "file://" + os.path.join(tmp, "rdzv"),
                                                 os.path.join(tmp, "root"), warmup, calls, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        ranks = dict(q.get(timeout=600) for _ in range(world))
        for p in procs:
            p.join(60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    per = [ranks[r] for r in range(world)]
    return {"world": world, "calls": calls, "load_avg_1m_before": load_before,
            "load_avg_1m_after": os.getloadavg()[0],
            "p50_us_median_over_ranks": statistics.median(x["p50_us"] for x in per),
            "p50_us_max_over_ranks": max(x["p50_us"] for x in per),
            "mean_us_max_over_ranks": max(x["mean_us"] for x in per),
            "cpu_us_per_call_median_over_ranks": statistics.median(x["cpu_us_per_call"] for x in per),
            "ranks": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4,8,16")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--out", default=h.result_path("preemption-collective"))
    args = ap.parse_args()
    results = [measure(int(w), args.warmup, args.calls) for w in args.worlds.split(",")]
    for r in results:
        h.log(f"world {r['world']:>2}: p50 {r['p50_us_median_over_ranks']:8.0f} us (max over ranks "
              f"{r['p50_us_max_over_ranks']:.0f}), mean max {r['mean_us_max_over_ranks']:.0f} us, cpu "
              f"{r['cpu_us_per_call_median_over_ranks']:.0f} us/call, load {r['load_avg_1m_before']:.1f}")
    out = {"config": {"worlds": args.worlds, "warmup": args.warmup, "calls": args.calls, "backend": "gloo",
                      "preemption_check_every": 1}, "results": results, "environment": h.environment()}
    if args.out:
        print(h.write_results(args.out, out))


if __name__ == "__main__":
    main()
