"""Run a function in N real processes joined by a gloo process group."""
from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

from testkit.procs import rank_context


def _entry(rank: int, world: int, rdzv: str, fn: Callable[..., Any], args: tuple, q: Any, backend: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch was imported by the forkserver before
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=rdzv, rank=rank, world_size=world)
        try:
            q.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def _context() -> Any:
    return rank_context()


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
    ctx = _context()
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
            try:
                rank, status, value = q.get(timeout=min(2.0, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise
                if any(not p.is_alive() for i, p in enumerate(procs) if i not in results):
                    _drain(q, results, nproc, 1.0)  # a rank may have reported just before exiting
                    dead = [i for i, p in enumerate(procs) if i not in results and not p.is_alive()]
                    if dead:
                        raise AssertionError(f"rank(s) {dead} died without reporting (exit codes "
                                             f"{[procs[i].exitcode for i in dead]})") from None
                continue
            results[rank] = (status, value)
            if status != "ok":
                # the others may wait for it in a collective: give them a moment to fail too, then stop
                _drain(q, results, nproc, min(20.0, max(deadline - time.monotonic(), 0.01)))
                break
    except AssertionError:
        raise
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


def run_allowing_death(nproc: int, fn: Any, *args: Any, timeout: float) -> tuple[dict[int, Any], list[Any]]:
    """Like :func:`run_multiprocess`, but a rank may die on purpose (a kill mid-copy or
    mid-drain): the results of the ranks that reported, and every rank's exit code."""
    ctx = _context()
    q = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="objckpt-rdzv-")
    rdzv = "file://" + os.path.join(tmp, "store")
    procs = [ctx.Process(target=_entry, args=(r, nproc, rdzv, fn, args, q, "gloo"), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                rank, status, value = q.get(timeout=0.5)
            except queue.Empty:
                if all(i in results or not p.is_alive() for i, p in enumerate(procs)):
                    break
                continue
            assert status == "ok", f"rank {rank}:\n{value}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    return results, [p.exitcode for p in procs]
