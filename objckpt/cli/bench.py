"""``objckpt bench URI``: how fast this machine saves to and loads from a target.

A quick check of a deployment (instance type, bucket, endpoint, settings) before
a training job relies on it: a synthetic state of the given size (a few large
and some small tensors, like a model's) is saved, loaded in place and read back
``--repeat`` times; the report gives wall time, GB/s, client CPU-seconds per GB,
requests and the peak RSS growth, then deletes what it wrote.  The comparisons
with other tools live in ``benchmarks/`` (docs/benchmarks.md); this command
measures objckpt alone, on the target you point it at.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import api
from ..logs import Progress
from ..runtime import loop as _runtime
from ..storage import open_store
from ..units import MiB
from .demo import embedded_s3
from .options import add_command, bar, storage_options


def synthetic_state(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Mostly 16–64 MiB float32 matrices plus a tail of small vectors (norms, biases)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    left, i = total_bytes, 0
    sizes = [64 * MiB, 16 * MiB, 32 * MiB]
    while left > 1 * MiB:
        n = min(sizes[i % 3], left) // 4 // 1024 * 1024
        if n == 0:
            break
        state[f"layer{i}.weight"] = torch.rand(n // 1024, 1024, generator=g)
        state[f"layer{i}.bias"] = torch.rand(1024, generator=g)
        left -= n * 4 + 4096
        i += 1
    return state


@dataclass
class Figures:
    op: str
    seconds: float
    gbps: float
    cpu_s_per_gb: float
    requests: int


def _cpu() -> float:
    return time.process_time()


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(uri: str, storage_options: Optional[dict[str, Any]], size_mb: int, repeat: int,
              progress: Optional[Progress] = None) -> list[Figures]:
    """Save, load and read ``repeat`` + 1 times (the first round untimed); ``progress``
    counts the operations done."""
    state = synthetic_state(size_mb * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    ck = uri.rstrip("/") + "/objckpt-bench"
    runs: dict[str, list[tuple[float, float, int]]] = {"save": [], "load": [], "read one tensor": []}
    key = next(iter(state))
    try:
        for i in range(repeat + 1):  # the first round warms clients and buffers, untimed
            t, c = time.perf_counter(), _cpu()
            s = api.save(state, ck, storage_options=storage_options, overwrite=True)
            save = (time.perf_counter() - t, _cpu() - c, s.requests)
            t, c = time.perf_counter(), _cpu()
            ld = api.load(target, ck, storage_options=storage_options)
            load = (time.perf_counter() - t, _cpu() - c, ld.requests)
            t, c = time.perf_counter(), _cpu()
            api.read(ck, [key], storage_options=storage_options)
            one = (time.perf_counter() - t, _cpu() - c, 0)
            if progress is not None:
                progress.update(3)
            if i:
                runs["save"].append(save)
                runs["load"].append(load)
                runs["read one tensor"].append(one)
        if not all(torch.equal(target[k], v) for k, v in state.items()):
            raise RuntimeError("loaded tensors differ from the saved ones")
    finally:
        _cleanup(ck, storage_options)
    out = []
    for op, rs in runs.items():
        sec = statistics.median(r[0] for r in rs)
        cpu = statistics.median(r[1] for r in rs)
        moved = nbytes if op != "read one tensor" else state[key].numel() * 4
        out.append(Figures(op, sec, moved / sec / 1e9 if sec else 0.0, cpu / (moved / 1e9), rs[-1][2]))
    return out


def _cleanup(ck: str, storage_options: Optional[dict[str, Any]]) -> None:
    store, prefix = open_store(ck, storage_options)

    async def go() -> None:
        objs = await store.list(prefix.rstrip("/") + "/")
        if objs:
            await store.delete([o.key for o in objs])

    try:
        _runtime.run(go())
    except Exception:
        pass  # best effort: `objckpt gc` sweeps what is left


def cmd_bench(args: argparse.Namespace) -> int:
    """Bench the target (default: an embedded moto S3) and print the medians."""
    size_mb, repeat = args.size_mb, args.repeat
    rss0 = _rss_peak_mb()
    with bar(args, "bench", 3 * (repeat + 1), unit="ops") as pb:
        if args.uri is None:
            with embedded_s3() as (u, opts):
                print(f"target: embedded moto S3 at {opts['endpoint_url']} (pass a URI to measure a real target)")
                figs = run_bench(u, opts, size_mb, repeat, pb)
        else:
            print(f"target: {args.uri}")
            figs = run_bench(args.uri, storage_options(args), size_mb, repeat, pb)
    print(f"{size_mb} MB synthetic state, median of {repeat}:")
    print(f"  {'op':<16} {'seconds':>8} {'GB/s':>7} {'CPU-s/GB':>9} {'requests':>9}")
    for f in figs:
        print(f"  {f.op:<16} {f.seconds:>8.3f} {f.gbps:>7.2f} {f.cpu_s_per_gb:>9.2f} {f.requests:>9}")
    print(f"  peak RSS grew by {_rss_peak_mb() - rss0:.0f} MB (the state and the load target included: 2 x {size_mb} MB)")
    return 0


def add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "bench", "measure save/load speed against a target (default: embedded moto S3)",
                    cmd_bench)
    p.add_argument("uri", nargs="?", help="a prefix to write a scratch checkpoint under (deleted afterwards)")
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
