"""Run a function in N real processes joined by a gloo process group."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, q: Any, backend: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            q.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_multiprocess(nproc: int, fn: Callable[..., Any], *args: Any, timeout: float = 180,
                     backend: str = "gloo") -> list[Any]:
    """``fn(rank, world, *args)`` on ``nproc`` ranks (gloo, or nccl with one GPU per
    rank); returns the per-rank results.

    Raises AssertionError with every failing rank's traceback; a hang is a
    failure after ``timeout`` seconds (processes are killed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, fn, args, q, backend), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(nproc):
            rank, status, value = q.get(timeout=timeout)
            results[rank] = (status, value)
    except Exception as e:
        raise AssertionError(f"ranks timed out or died: got {sorted(results)} of {nproc}: {e}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r][1] for r in range(nproc)]
