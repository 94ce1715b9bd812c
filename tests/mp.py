"""Run a function in N real processes joined by a gloo process group."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable


def _entry(rank: int, world: int, rdzv: str, fn: Callable[..., Any], args: tuple, q: Any, backend: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=rdzv, rank=rank, world_size=world)
        try:
            q.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _drain(q: Any, results: dict[int, tuple[str, Any]], nproc: int, seconds: float) -> None:
    """Collect what other ranks report within ``seconds`` (their errors explain the first one)."""
    end = time.monotonic() + seconds
    while len(results) < nproc and time.monotonic() < end:
        try:
            rank, status, value = q.get(timeout=max(end - time.monotonic(), 0.01))
        except Exception:
            return
        results[rank] = (status, value)


def run_multiprocess(nproc: int, fn: Callable[..., Any], *args: Any, timeout: float = 180,
                     backend: str = "gloo") -> list[Any]:
    """``fn(rank, world, *args)`` on ``nproc`` ranks (gloo, or nccl with one GPU per
    rank); returns the per-rank results.

    Raises AssertionError with every failing rank's traceback; a hang is a
    failure after ``timeout`` seconds (processes are killed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # a file rendezvous: a free TCP port picked here can be taken by another process
    # before rank 0 binds it (seen under load), which hangs the whole group
    tmp = tempfile.mkdtemp(prefix="objckpt-rdzv-")
    rdzv = "file://" + os.path.join(tmp, "store")
    procs = [ctx.Process(target=_entry, args=(r, nproc, rdzv, fn, args, q, backend), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < nproc:
            rank, status, value = q.get(timeout=max(deadline - time.monotonic(), 0.01))
            results[rank] = (status, value)
            if status != "ok":
                # the others may wait for it in a collective: give them a moment to fail too, then stop
                _drain(q, results, nproc, min(20.0, max(deadline - time.monotonic(), 0.01)))
                break
    except Exception as e:
        raise AssertionError(f"ranks timed out or died: got {sorted(results)} of {nproc}: {e}") from None
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == nproc else 0.5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    if errors:
        missing = sorted(set(range(nproc)) - set(results))
        if missing:
            errors.update({r: "(still running when another rank failed: stopped)" for r in missing})
        raise AssertionError("\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r][1] for r in range(nproc)]
