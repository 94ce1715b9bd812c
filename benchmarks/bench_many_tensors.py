"""A state of many small tensors restored from node-local files: where the metadata, not the
bytes, sets the time.

    python -m benchmarks.bench_many_tensors                          # 3,200 x 64 KiB, 4 rounds
    python -m benchmarks.bench_many_tensors --baseline 0c79fad       # and that commit's objckpt, alternated
    python -m benchmarks.bench_many_tensors --tensors 800 --kib 256 --rounds 2
    python -m benchmarks.bench_many_tensors --saves                  # only the saves

One state (``--tensors`` float32 tensors of about ``--kib`` KiB, unaligned sizes) is written
once, by this tree, under a temporary folder on ``--dir`` (default /dev/shm):

* ``objckpt``: ``objckpt.save`` of the state to a folder; **plain** is ``objckpt.load`` of it;
* a ``CheckpointManager`` root with a local tier holding two steps (``local_keep=2``,
  ``replicas=0``): **manager** is ``CheckpointManager.load`` of a new manager (the restore a
  restarting job makes), **latest_step** its ``latest_step()``;
* ``dcp``: ``torch.distributed.checkpoint.save`` of the same state (no process group);
  **dcp** is ``torch.distributed.checkpoint.load`` of it, in place;
* ``torch``: ``torch.save`` of the state to one file; **torch.load** is ``torch.load``
  (``weights_only=True``) then a copy into the destination tensors.

and the same state saved (``--saves``; every call into a new place under that folder):
**save** (``objckpt.save``), **manager.save** (a tiered ``CheckpointManager.save``,
synchronous: the local commit the training waits for; the work after it untimed),
**dcp.save**, **torch.save** and **copy** (a copy of every tensor into host tensors the first
call allocates and later calls reuse: the stall's reference, cold and warm); and the async saves, timed until they return (the
training's stall; their completion untimed): **async_save** (``objckpt.async_save``),
**manager.async_save** (tiered, ``async_save=True``) and **dcp.async_save**, each against
a copy of the same tensors into touched host tensors in the same process (the issue's
stall reference: 1.2x that copy).

Each (variant, operation) runs in a new process per round, in alternating order: torch is
imported untimed, the destination tensors are allocated fresh (``torch.empty``: no page
touched), then the first call is timed (**cold**: objckpt's threads, the first decode,
first-touch page faults, all of it; a save: its first plan) and the median of three more
into the same, now touched, tensors (**warm**; a save of the same structure: its plan
from objckpt's save plan cache, ``objckpt/save/plan_cache.py``), each with its CPU
seconds (all threads of the process).
Peak RSS is the process's ``VmHWM`` after the calls, less its RSS before the destinations
were allocated and less the state's bytes (the destination tensors themselves; not for
``latest_step``, which fills nothing): objckpt's (or the peer's) import is in it.  Medians (min-max) over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from . import harness as h

OPS = ("plain", "manager", "latest_step", "dcp", "torch.load", "save", "manager.save", "dcp.save", "torch.save",
       "async_save", "manager.async_save", "dcp.async_save", "copy")
#: the operations that run objckpt (the baselines run them too)
OBJCKPT_OPS = ("plain", "manager", "latest_step", "save", "manager.save", "async_save", "manager.async_save")
SAVES = ("save", "manager.save", "dcp.save", "torch.save", "async_save", "manager.async_save", "dcp.async_save",
         "copy")
#: saves timed until they return (the training's stall), their completion untimed
ASYNC = ("async_save", "manager.async_save", "dcp.async_save")


def shapes(tensors: int, kib: int) -> dict[str, int]:
    """Each tensor's name and element count (float32; unaligned sizes)."""
    return {f"layers.{i // 8}.w{i % 8}": kib * 1024 // 4 + i % 8 for i in range(tensors)}


def _tier(local: str) -> dict[str, Any]:
    """The manager's tier keywords: ``tier=TierSettings(...)``, or the former keywords for a
    baseline objckpt from before ``TierSettings``."""
    import objckpt

    kw: dict[str, Any] = {"local_dir": local, "replicas": 0, "persist_every": None, "local_keep": 2}
    return {"tier": objckpt.TierSettings(**kw)} if hasattr(objckpt, "TierSettings") else kw


def make_state(tensors: int, kib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(n, generator=g) for k, n in shapes(tensors, kib).items()}


def _cpu() -> float:
    return time.process_time()


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One new process: one operation, cold then warm (run with ``--one``)."""
    import torch

    if args.root:
        sys.path.insert(0, args.root)
    sizes = shapes(args.tensors, args.kib)
    state_bytes = 4 * sum(sizes.values())
    rss0 = h.proc_status("VmRSS") or 0
    dest = {k: torch.empty(n) for k, n in sizes.items()}  # fresh: no page touched yet
    base = os.path.join(args.data, "")
    op = args.op
    fn: Callable[[], Any]
    if op in SAVES:
        return _save_child(args, op, base, rss0, state_bytes)
    if op in ("plain", "manager", "latest_step"):
        import objckpt

        if args.root and not objckpt.__file__.startswith(args.root):
            raise RuntimeError("the baseline objckpt was not the one imported")
        if op == "plain":
            def fn() -> Any:
                return objckpt.load(dest, base + "objckpt")
        else:
            m = objckpt.CheckpointManager(base + "root", **_tier(base + "local"))

            def fn() -> Any:
                got = m.load(dest) if op == "manager" else m.latest_step()
                assert (got.step if op == "manager" else got) == 2
                return got
    elif op == "dcp":
        import torch.distributed.checkpoint as dcp

        def fn() -> Any:
            dcp.load(dest, checkpoint_id=base + "dcp")
    else:
        def fn() -> Any:
            loaded = torch.load(base + "state.pt", weights_only=True)
            for k, v in loaded.items():
                dest[k].copy_(v)
    cold, cold_cpu = _timed(fn)
    warm = [_timed(fn) for _ in range(3)]
    hwm = h.proc_status("VmHWM") or 0  # before the check below makes a second copy of the state
    if op != "latest_step":
        want = make_state(args.tensors, args.kib)
        bad = [k for k, v in want.items() if not torch.equal(dest[k], v)]
        if bad:
            raise RuntimeError(f"{op}: {len(bad)} tensors differ, e.g. {bad[:3]}")
    return {"cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": statistics.median(w for w, _ in warm),
            "warm_cpu_s": statistics.median(c for _, c in warm),
            "peak_rss_beyond_state_mib": max(0, hwm - rss0 - (state_bytes if op != "latest_step" else 0)) / h.MiB}


def _save_child(args: argparse.Namespace, op: str, base: str, rss0: int, state_bytes: int) -> dict[str, Any]:
    """A save's cold call (the first in the process) and warm ones (each into a new place);
    the state is made before the timing, so its bytes count as the destinations' do."""
    import torch

    state = make_state(args.tensors, args.kib)
    out = tempfile.mkdtemp(prefix="save-", dir=base)
    calls = iter(range(1, 100))
    m: Any = None
    pending: list[Any] = []  # an async save's handle, completed untimed
    if op in OBJCKPT_OPS:
        import objckpt

        if args.root and not objckpt.__file__.startswith(args.root):
            raise RuntimeError("the baseline objckpt was not the one imported")
        if op.startswith("manager."):
            m = objckpt.CheckpointManager(os.path.join(out, "root"), **_tier(os.path.join(out, "local")),
                                          async_save=op == "manager.async_save")

        def fn() -> Any:
            i = next(calls)
            if m is not None:
                return m.save(i, state)  # the stall: the local commit (or, async, the staging)
            if op == "async_save":
                return pending.append(objckpt.async_save(state, os.path.join(out, f"ck{i}")))
            return objckpt.save(state, os.path.join(out, f"ck{i}"))
    elif op in ("dcp.save", "dcp.async_save"):
        import torch.distributed.checkpoint as dcp

        def fn() -> Any:
            where = os.path.join(out, f"dcp{next(calls)}")
            if op == "dcp.async_save":
                return pending.append(dcp.async_save(state, checkpoint_id=where))
            dcp.save(state, checkpoint_id=where)
    elif op == "copy":  # the stall's reference: host tensors made by the first call, reused after
        hosts: dict[str, Any] = {}

        def fn() -> Any:
            if not hosts:
                hosts.update({k: torch.empty_like(v) for k, v in state.items()})  # no page touched yet
            for k, v in state.items():
                hosts[k].copy_(v)
    else:
        def fn() -> Any:
            torch.save(state, os.path.join(out, f"state{next(calls)}.pt"))

    def timed() -> tuple[float, float]:
        got = _timed(fn)
        if m is not None:
            m.wait()  # untimed: the background work after the commit
        while pending:
            pending.pop().result()
        return got

    cold, cold_cpu = timed()
    warm = [timed() for _ in range(3)]
    hwm = h.proc_status("VmHWM") or 0
    # the reference of a stall: a copy of every tensor into host tensors allocated and touched before
    into = {k: torch.empty_like(v).fill_(1) for k, v in state.items()}
    copies = [_timed(lambda: [into[k].copy_(v) for k, v in state.items()])[0] for _ in range(4)]
    if m is not None:
        m.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": statistics.median(w for w, _ in warm),
            "warm_cpu_s": statistics.median(c for _, c in warm), "copy_s": statistics.median(copies[1:]),
            "peak_rss_beyond_state_mib": max(0, hwm - rss0 - state_bytes) / h.MiB}


def _prepare(args: argparse.Namespace, data: str) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    import objckpt

    state = make_state(args.tensors, args.kib)
    objckpt.save(state, os.path.join(data, "objckpt"))
    with objckpt.CheckpointManager(os.path.join(data, "root"), **_tier(os.path.join(data, "local"))) as m:
        m.save(1, state)
        m.save(2, state)
        m.wait()
    dcp.save(state, checkpoint_id=os.path.join(data, "dcp"))
    torch.save(state, os.path.join(data, "state.pt"))
    return sum(v.numel() * 4 for v in state.values())


def _fmt(xs: list[float], spec: str = "{:.3f}") -> str:
    if not xs:
        return "–"
    return f"{spec.format(statistics.median(xs))} ({spec.format(min(xs))}–{spec.format(max(xs))})"


def drive(args: argparse.Namespace) -> int:
    roots = {"this tree": ""}
    for ref in (r for r in (args.baseline or "").split(",") if r):
        roots[ref] = h.export_objckpt(ref)
    data = tempfile.mkdtemp(prefix="objckpt-bench-many-", dir=args.dir)
    try:
        sys.path.insert(0, h.REPO_ROOT)
        nbytes = _prepare(args, data)
        ops = [op for op in OPS if (op in SAVES) == args.saves or args.saves is None]
        runs = [(v, op) for op in ops for v in (roots if op in OBJCKPT_OPS else ["peer"])]
        results: dict[str, list[dict[str, Any]]] = {f"{op} [{v}]": [] for v, op in runs}
        for rnd in range(args.rounds):
            for v, op in (runs if rnd % 2 == 0 else runs[::-1]):
                r = h.run_json(["-m", "benchmarks.bench_many_tensors", "--one", "--op", op, "--root",
                                roots.get(v, ""), "--data", data, "--tensors", str(args.tensors), "--kib",
                                str(args.kib)], 600)
                if "cold_s" not in r:
                    h.log(f"round {rnd} {op} [{v}]: {r.get('error')}")
                    continue
                results[f"{op} [{v}]"].append(r)
                h.log(f"round {rnd} {op} [{v}]: cold {r['cold_s']:.3f} s, warm {r['warm_s']:.3f} s")
    finally:
        shutil.rmtree(data, ignore_errors=True)
        for root in roots.values():
            if root:
                shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"\n{args.tensors} tensors, {nbytes / h.MiB:.0f} MiB, files on {args.dir}; {args.rounds} new processes "
          "per row; median (min–max):\n")
    rows = []
    for name, rs in results.items():
        per_gb = (lambda key: [r[key] / gb for r in rs]) if "latest_step" not in name else (lambda key: [])
        rows.append([name, _fmt([r["cold_s"] for r in rs]), _fmt(per_gb("cold_cpu_s"), "{:.2f}"),
                     _fmt([r["warm_s"] for r in rs]), _fmt(per_gb("warm_cpu_s"), "{:.2f}"),
                     _fmt([r["peak_rss_beyond_state_mib"] for r in rs], "{:.0f}")])
    print(h.md_table(["operation", "cold s", "cold CPU s/GB", "warm s", "warm CPU s/GB",
                      "peak RSS beyond the state, MiB"], rows))
    stalls = [[name, _fmt([r["warm_s"] for r in rs]), _fmt([r["copy_s"] for r in rs]),
               _fmt([r["warm_s"] / r["copy_s"] for r in rs], "{:.2f}x")]
              for name, rs in results.items() if rs and name.split(" [")[0] in ASYNC]
    if stalls:
        print("\nasync saves: the warm stall against a copy of the same tensors into touched host tensors "
              "(same process):\n")
        print(h.md_table(["operation", "warm stall s", "copy s", "stall / copy"], stalls))
    copies = results.get("copy [peer]") or []
    cold_copy = statistics.median(r["cold_s"] for r in copies) if copies else 0.0
    cold = [[name, _fmt([r["cold_s"] for r in rs]), f"{cold_copy:.3f}",
             _fmt([r["cold_s"] / cold_copy for r in rs], "{:.2f}x")]
            for name, rs in results.items() if rs and cold_copy and name.split(" [")[0] in ASYNC]
    if cold:
        print("\nasync saves: the cold stall (the first call in a new process) against the first copy of the "
              "same tensors into host tensors made for it (the **copy** row's cold median):\n")
        print(h.md_table(["operation", "cold stall s", "cold copy s", "stall / cold copy"], cold))
    if args.name:
        path = h.write_results(h.result_path(args.name), {"name": args.name, "config": vars(args),
                                                          "state_bytes": nbytes, "results": results,
                                                          "environment": h.environment()})
        print(f"\nresults: {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=3200)
    ap.add_argument("--kib", type=int, default=64, help="each tensor's size (KiB, plus a few bytes)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm", help="where the files are written")
    ap.add_argument("--baseline", default=None, metavar="REFS",
                    help="also run the objckpt of these git refs (comma-separated), alternated")
    ap.add_argument("--name", default=None, help="benchmarks/results/<name>.json")
    ap.add_argument("--saves", default=None, action=argparse.BooleanOptionalAction,
                    help="only the saves (--saves) or only the restores (--no-saves); both by default")
    ap.add_argument("--one", action="store_true", help="internal: one new process")
    ap.add_argument("--op", choices=OPS, default="plain", help="internal: the operation of this process")
    ap.add_argument("--root", default="", help="internal: the objckpt source to import first")
    ap.add_argument("--data", default="", help="internal: the prepared folder")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(child(args)), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
