"""Async save from GPU tensors: stall time against the pinned D2H copy of the state.

    python -m benchmarks.bench_async_gpu --out benchmarks/results/async_gpu.json

The 1.03 GiB GPT-like state of :mod:`benchmarks.gpt_state`, on the GPU. The
reference is the time to copy it into pre-allocated pinned host buffers
(``copy_(non_blocking=True)`` for every tensor, then one synchronize); each
method's *stall* is the time until its call returns and training may go on.
Steady state = median of ``--repeat`` saves after one untimed warm-up (a job
checkpoints repeatedly; staging buffers are reused). The target is local files
under ``--dir`` (``/dev/shm`` by default), so storage is not what is measured.

Also measured:

* ``objckpt_lazy``: ``async_save(lazy=True)`` returns at once; ``ready`` is
  when ``wait_staged()`` returns.
* ``overlap``: a 8192³ bf16 matmul loop runs on the default stream while
  ``async_save`` stages on its side stream; how much longer the loop took than
  alone (the GPU-side cost of staging).
* DCP ``async_save`` with ``DefaultStager(StagingOptions())`` (pinned, shared,
  async staging, non-blocking copies) and with a cached blocking stager, to a
  ``FileSystemWriter`` under the same directory (``no_dist=True``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from typing import Any, Callable

import torch

from benchmarks.gpt_state import make_gpt_state, scaled_bytes


def _median(f: Callable[[], float], repeat: int) -> tuple[float, list[float]]:
    f()  # warm-up
    xs = [f() for _ in range(repeat)]
    return statistics.median(xs), xs


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/objckpt-bench-gpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import objckpt

    dev = torch.device("cuda")
    state = {k: v.to(dev) for k, v in make_gpt_state(scaled_bytes(args.scale)).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    torch.cuda.synchronize()
    rows: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "tensors": len(state), "bytes": nbytes}
    os.makedirs(args.dir, exist_ok=True)

    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}

    def d2h() -> float:
        t = time.perf_counter()
        for k, v in state.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    rows["pinned_d2h"] = _median(d2h, args.repeat)
    pageable = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}

    def d2h_pageable() -> float:
        t = time.perf_counter()
        for k, v in state.items():
            pageable[k].copy_(v)
        return time.perf_counter() - t

    rows["pageable_d2h"] = _median(d2h_pageable, args.repeat)
    n = [0]

    def objckpt_async(lazy: bool = False) -> Callable[[], float]:
        def run() -> float:
            n[0] += 1
            uri = os.path.join(args.dir, f"ock-{n[0]}")
            t = time.perf_counter()
            h = objckpt.async_save(state, uri, lazy=lazy)
            stall = time.perf_counter() - t
            h.wait_staged()
            ready.append(time.perf_counter() - t)
            h.result()
            done.append(time.perf_counter() - t)
            shutil.rmtree(uri, ignore_errors=True)
            return stall
        return run

    for name, lazy in (("objckpt_async", False), ("objckpt_lazy", True)):
        ready: list[float] = []
        done: list[float] = []
        rows[name] = _median(objckpt_async(lazy), args.repeat)
        rows[name + "_ready"] = statistics.median(ready[1:])
        rows[name + "_done"] = statistics.median(done[1:])

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def matmuls(k: int = 40) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(k):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t

    alone = _median(matmuls, args.repeat)[0]

    def with_save() -> float:
        n[0] += 1
        uri = os.path.join(args.dir, f"ock-{n[0]}")
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = objckpt.async_save(state, uri, lazy=True)  # stages on the side stream while the matmuls run
        for _ in range(40):
            a @ a
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        h.result()
        shutil.rmtree(uri, ignore_errors=True)
        return el

    rows["overlap"] = {"matmuls_alone": alone, "matmuls_with_lazy_save": _median(with_save, args.repeat)[0]}

    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

        def dcp_run(stager: Any) -> Callable[[], float]:
            def run() -> float:
                n[0] += 1
                path = os.path.join(args.dir, f"dcp-{n[0]}")
                t = time.perf_counter()
                r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True,
                                   async_stager=stager)
                stall = time.perf_counter() - t
                if hasattr(r, "upload_completion"):
                    r.staging_completion.result()
                    r.upload_completion.result()
                else:
                    r.result()
                shutil.rmtree(path, ignore_errors=True)
                return stall
            return run

        for name, mk in (("dcp_defaultstager", lambda: DefaultStager(StagingOptions())),
                         ("dcp_pinned_cached", lambda: BlockingAsyncStager(cache_staged_state_dict=True))):
            try:
                stager = mk()
                rows[name] = _median(dcp_run(stager), args.repeat)
                stager.close()
            except Exception as e:  # report, go on
                rows[name] = f"failed: {type(e).__name__}: {e}"
    except ImportError as e:
        rows["dcp"] = f"unavailable: {e}"

    ref = rows["pinned_d2h"][0]
    print(f"{rows['device']}, torch {rows['torch']}, {len(state)} tensors, {nbytes / 2**30:.3f} GiB; "
          f"median of {args.repeat} after a warm-up")
    for k, v in rows.items():
        if isinstance(v, tuple):
            print(f"  {k:<22} {v[0]:.4f} s  ({v[0] / ref:.2f}x pinned D2H)")
    for k in ("objckpt_async_ready", "objckpt_async_done", "objckpt_lazy_ready", "objckpt_lazy_done"):
        print(f"  {k:<22} {rows[k]:.4f} s")
    print(f"  overlap: {rows['overlap']}")
    for k, v in rows.items():
        if isinstance(v, str) and k != "device" and k != "torch":
            print(f"  {k}: {v}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
