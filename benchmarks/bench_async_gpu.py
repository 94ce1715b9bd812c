"""Async save from GPU tensors: stall time against the pinned D2H copy of the state (needs CUDA).

    python -m benchmarks.bench_async_gpu --out benchmarks/results/async_gpu.json

The 1.03 GiB GPT-like state, on the GPU. The reference is the copy into pre-allocated pinned host
buffers (``copy_(non_blocking=True)`` per tensor, one synchronize); each method's *stall* is the
time until its call returns. Medians of ``--repeat`` after one untimed warm-up. The target is local
files under ``--dir`` (``/dev/shm``), so storage is not what is measured. Also: ``objckpt_lazy``
(``ready`` = ``wait_staged()``), ``overlap`` (40 bf16 8192³ matmuls alone and while a lazy
``async_save`` stages on its side stream) and DCP ``async_save`` with ``DefaultStager(StagingOptions())``
and with ``BlockingAsyncStager(cache_staged_state_dict=True)`` to a ``FileSystemWriter``.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import time
from typing import Any, Callable

import torch

from . import harness as h
from .gpt_state import make_gpt_state, scaled_bytes


def timed(f: Callable[[], Any], repeat: int) -> tuple[float, list[float]]:
    """Median of ``repeat`` runs after one warm-up; ``f`` returns its own seconds."""
    f()
    xs = [f() for _ in range(repeat)]
    return h.median(xs), xs  # type: ignore[return-value]


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm/objckpt-bench-gpu")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import objckpt

    state = {k: v.cuda() for k, v in make_gpt_state(scaled_bytes(args.scale)).items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    torch.cuda.synchronize()
    rows: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tensors": len(state),
                            "bytes": nbytes}
    os.makedirs(args.dir, exist_ok=True)
    n = itertools.count()

    def copy_into(dst: dict[str, torch.Tensor], pinned: bool) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            for k, v in state.items():
                dst[k].copy_(v, non_blocking=pinned)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        return run

    for name, pin in (("pinned_d2h", True), ("pageable_d2h", False)):
        dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in state.items()}
        rows[name] = timed(copy_into(dst, pin), args.repeat)

    def save(lazy: bool, ready: list[float], done: list[float]) -> float:
        uri = os.path.join(args.dir, f"ock-{next(n)}")
        t = time.perf_counter()
        hd = objckpt.async_save(state, uri, lazy=lazy)
        stall = time.perf_counter() - t
        hd.wait_staged()
        ready.append(time.perf_counter() - t)
        hd.result()
        done.append(time.perf_counter() - t)
        shutil.rmtree(uri, ignore_errors=True)
        return stall

    for name, lazy in (("objckpt_async", False), ("objckpt_lazy", True)):
        ready: list[float] = []
        done: list[float] = []
        rows[name] = timed(lambda: save(lazy, ready, done), args.repeat)
        rows[name + "_ready"], rows[name + "_done"] = h.median(ready[1:]), h.median(done[1:])

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls(with_save: bool) -> float:
        uri = os.path.join(args.dir, f"ock-{next(n)}")
        torch.cuda.synchronize()
        t = time.perf_counter()
        hd = objckpt.async_save(state, uri, lazy=True) if with_save else None  # stages on its side stream
        for _ in range(40):
            a @ a
        torch.cuda.synchronize()
        el = time.perf_counter() - t
        if hd is not None:
            hd.result()
        shutil.rmtree(uri, ignore_errors=True)
        return el

    rows["overlap"] = {"matmuls_alone": timed(lambda: matmuls(False), args.repeat)[0],
                       "matmuls_with_lazy_save": timed(lambda: matmuls(True), args.repeat)[0]}

    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

    from .methods import dcp

    def dcp_save(stager: Any) -> float:
        path = os.path.join(args.dir, f"dcp-{next(n)}")
        t = time.perf_counter()
        r = dcp().async_save(state, storage_writer=dcp().FileSystemWriter(path), no_dist=True, async_stager=stager)
        stall = time.perf_counter() - t
        for f in (r.staging_completion, r.upload_completion) if hasattr(r, "upload_completion") else (r,):
            f.result()
        shutil.rmtree(path, ignore_errors=True)
        return stall

    for name, make in (("dcp_defaultstager", lambda: DefaultStager(StagingOptions())),
                       ("dcp_pinned_cached", lambda: BlockingAsyncStager(cache_staged_state_dict=True))):
        try:
            stager = make()
            rows[name] = timed(lambda: dcp_save(stager), args.repeat)
            stager.close()
        except Exception as e:  # noqa: BLE001 - reported, the rest goes on
            rows[name] = f"failed: {type(e).__name__}: {e}"

    ref = rows["pinned_d2h"][0]
    print(f"{rows['device']}, torch {rows['torch']}, {len(state)} tensors, {nbytes / h.GiB:.3f} GiB; "
          f"median of {args.repeat} after a warm-up")
    for k, v in rows.items():
        if isinstance(v, tuple):
            print(f"  {k:<22} {v[0]:.4f} s  ({v[0] / ref:.2f}x pinned D2H)")
        elif k.endswith(("_ready", "_done")) or k == "overlap" or (isinstance(v, str) and v.startswith("failed")):
            print(f"  {k:<22} {v}")
    if args.out:
        h.write_results(args.out, rows)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
