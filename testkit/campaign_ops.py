"""Kill kinds of the fault campaign beyond a single-process save: SIGKILL during a
2-rank gloo save, and during ``objckpt cp``, ``rm`` and ``prune``.

Each trial commits what must survive, runs the operation in subprocesses
(:mod:`testkit.campaign_child`) whose store SIGKILLs the process just
before its N-th request (N random), then judges as :mod:`testkit.campaign`
does: every checkpoint reads as exactly one committed version or (where the
operation removes it) as none, never half; what was not the operation's target
is untouched; gc (grace 0) then leaves exactly what the manifests name.

* ``ranks``: an overwrite by 2 gloo ranks holding a row-sharded DTensor, one rank
  (chosen at random) killed; the survivor must end (a named error, or done), not hang.
* ``cp``: a copy over an existing checkpoint at DST (overwrite): DST reads as its
  old version or as SRC; SRC untouched.
* ``rm``: the checkpoint reads whole or not at all; its neighbour untouched.
* ``prune``: 4 manager steps, keep the last 2: every step the index lists reads
  bit-exact, the kept ones always; a second prune (not killed) and gc finish the job.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import torch

from .campaign import (FAILED, OK, Target, Trial, _after_crash, child_env, judge_error, last_json, make_state,
                       run_child, same, timed)

OPS = ["cp", "rm", "prune"]
#: kill points are drawn from 1..MAX_OPS[op] (about each operation's request count;
#: in a 2-rank save rank 0 makes about 6 requests, rank 1 about 3)
MAX_OPS = {"cp": 12, "rm": 4, "prune": 16, "ranks": 6}


def full_rank_state(seed: int) -> dict[str, Any]:
    """The whole state the ranks of a ``ranks`` trial save (what a read gives back)."""
    g = torch.Generator().manual_seed(seed)
    return {"grid": torch.randn(96, 48, generator=g), "rep": torch.randn(5000, generator=g), "step": seed}


def sharded_rank_state(seed: int, world: int) -> dict[str, Any]:
    """This rank's view of :func:`full_rank_state`: ``grid`` row-sharded over ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = full_rank_state(seed)
    mesh = init_device_mesh("cpu", (world,))
    return {"grid": distribute_tensor(full["grid"], mesh, [Shard(0)]), "rep": full["rep"], "step": full["step"]}


@contextlib.contextmanager
def gloo_rank(a: dict[str, Any]) -> Iterator[None]:
    """A trial rank's gloo process group (``a``: its ``rank``, ``world`` and file
    rendezvous ``rdzv``), destroyed afterwards whatever happened (a peer may be dead)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=a["rdzv"], rank=a["rank"], world_size=a["world"])
    try:
        yield
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(command: str, args: dict[str, Any], world: int,
              timeout: float) -> tuple[list[subprocess.Popen], list[str], list[int]]:
    """``world`` ranks of ``python -m testkit.campaign_child <command>`` (``args`` plus each
    one's ``rank``), waited for: (processes, outputs, ranks still running after ``timeout``
    seconds, which are killed: a hang guard, nothing is judged by time)."""
    procs = [subprocess.Popen([sys.executable, "-m", "testkit.campaign_child", command,
                               json.dumps({**args, "rank": r})], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs: list[str] = []
    hung: list[int] = []
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
            hung.append(r)
    return procs, outs, hung


def rank_kill_trial(target: Target, seed: int, *, world: int = 2, max_ops: int = MAX_OPS["ranks"],
                    timeout: float = 120.0) -> Trial:
    """Overwrite version ``seed`` with ``seed + 1`` from ``world`` gloo ranks; SIGKILL one."""
    import objckpt

    rng = random.Random(seed)
    kill_rank = rng.randrange(world)
    kill_at = rng.randint(1, max_ops if kill_rank == 0 else max(max_ops // 2, 1))
    params = {"target": target.kind, "seed": seed, "kill_rank": kill_rank, "kill_at_request": kill_at}

    def body() -> Trial:
        uri = target.uri(f"ranks-{seed}-{os.getpid()}-{time.time_ns()}")
        old, new = full_rank_state(seed), full_rank_state(seed + 1)
        objckpt.save(old, uri, storage_options=target.storage_options)
        with tempfile.TemporaryDirectory(prefix="objckpt-rdzv-") as rd:
            args = {"world": world, "rdzv": "file://" + os.path.join(rd, "store"), "uri": uri,
                    "opts": target.storage_options, "seed": seed + 1, "kill_rank": kill_rank, "kill_at": kill_at}
            procs, outs, hung = run_ranks("rank_save", args, world, timeout)
        if hung:
            return Trial("ranks", params, FAILED, f"rank(s) {hung} hung after a peer was killed: {outs[hung[0]][-400:]}")
        killed = procs[kill_rank].returncode == -signal.SIGKILL
        for r, (p, out) in enumerate(zip(procs, outs)):
            if r == kill_rank and killed:
                continue
            res = last_json(out)
            if res is None or p.returncode != 0:
                return Trial("ranks", params, FAILED, f"rank {r} exited {p.returncode}: {out[-600:]}")
            if not res.get("saved") and not res.get("objckpt_error"):
                return Trial("ranks", params, FAILED, f"rank {r}: a built-in error after its peer died: {res['error']}")
        outcome, detail, figures = _after_crash(uri, target.storage_options, {seed: old, seed + 1: new})
        return Trial("ranks", params, outcome, f"{'killed' if killed else 'completed'}; {detail}",
                     faults=int(killed), extra=figures)

    return timed("ranks", params, body)


def op_kill_trial(target: Target, seed: int, op: str, *, timeout: float = 120.0) -> Trial:
    """``op`` (cp / rm / prune) SIGKILLed before its N-th request; see the module docstring."""
    rng = random.Random(seed)
    kill_at = rng.randint(1, MAX_OPS[op])
    params = {"target": target.kind, "seed": seed, "op": op, "kill_at_request": kill_at}

    def body() -> Trial:
        base = target.uri(f"{op}-{seed}-{os.getpid()}-{time.time_ns()}")
        fn = {"cp": _cp, "rm": _rm, "prune": _prune}[op]
        return fn(params, base, target.storage_options, seed, kill_at, timeout)

    return timed(f"kill-{op}", params, body)


def _child(params: dict[str, Any], args: dict[str, Any], timeout: float) -> tuple[bool, str]:
    """Run the op; (killed, problem or "")."""
    code, out = run_child("op", args, timeout)
    if code is None:
        return False, f"the {args['op']} subprocess hung ({timeout:.0f} s): {out[-400:]}"
    killed = code == -signal.SIGKILL
    res = last_json(out)
    if not killed and (code != 0 or res is None or not res.get("done")):
        return False, f"{args['op']} failed by itself (exit {code}): {out[-600:]}"
    return killed, ""


def _cp(params: dict[str, Any], base: str, opts: dict[str, Any], seed: int, kill_at: int, timeout: float) -> Trial:
    import objckpt

    src, dst = base + "-src", base + "-dst"
    src_v, dst_v = make_state(seed), make_state(seed + 1)
    objckpt.save(src_v, src, storage_options=opts)
    objckpt.save(dst_v, dst, storage_options=opts)
    killed, problem = _child(params, {"op": "cp", "src": src, "dst": dst, "opts": opts, "kill_at": kill_at}, timeout)
    if problem:
        return Trial("kill-cp", params, FAILED, problem)
    if not same(src_v, objckpt.read(src, storage_options=opts)):
        return Trial("kill-cp", params, FAILED, "the source changed", faults=int(killed))
    outcome, detail, figures = _after_crash(dst, opts, {seed + 1: dst_v, seed: src_v})
    return Trial("kill-cp", params, outcome, f"{'killed' if killed else 'completed'}; {detail}",
                 faults=int(killed), extra=figures)


def _rm(params: dict[str, Any], base: str, opts: dict[str, Any], seed: int, kill_at: int, timeout: float) -> Trial:
    import objckpt

    uri, neighbour = base + "-a", base + "-b"
    v, w = make_state(seed), make_state(seed + 1)
    objckpt.save(v, uri, storage_options=opts)
    objckpt.save(w, neighbour, storage_options=opts)
    killed, problem = _child(params, {"op": "rm", "uri": uri, "opts": opts, "kill_at": kill_at}, timeout)
    if problem:
        return Trial("kill-rm", params, FAILED, problem)
    if not same(w, objckpt.read(neighbour, storage_options=opts)):
        return Trial("kill-rm", params, FAILED, "the neighbouring checkpoint changed", faults=int(killed))
    # whole (killed before the manifest went) or gone, with nothing left after gc
    outcome, detail, figures = _after_crash(uri, opts, {seed: v}, fresh=True)
    return Trial("kill-rm", params, outcome, f"{'killed' if killed else 'completed'}; {detail}",
                 faults=int(killed), extra=figures)


def _prune(params: dict[str, Any], base: str, opts: dict[str, Any], seed: int, kill_at: int,
           timeout: float) -> Trial:
    import objckpt
    from objckpt.runtime import loop as _runtime
    from objckpt.errors import NotFoundError
    from objckpt.ops.gc import collect_garbage
    from objckpt.manager.index import StepIndex
    from objckpt.manager.retention import RetentionPolicy
    from objckpt.manager.worker import apply_retention
    from objckpt.storage import open_store

    states = {s: make_state(seed + s) for s in (1, 2, 3, 4)}
    with objckpt.CheckpointManager(base, storage_options=opts) as m:
        for s, v in states.items():
            m.save(s, v)
    killed, problem = _child(params, {"op": "prune", "uri": base, "opts": opts, "kill_at": kill_at,
                                      "keep_last": 2}, timeout)
    if problem:
        return Trial("kill-prune", params, FAILED, problem)

    def step_uri(s: int) -> str:
        return f"{base}/step-{s:010d}"

    listed = objckpt.CheckpointManager(base, storage_options=opts).steps()
    for s in (1, 2, 3, 4):
        try:
            got = objckpt.read(step_uri(s), storage_options=opts)
        except NotFoundError:
            if s in listed or s > 2:
                return Trial("kill-prune", params, FAILED, f"step {s} is gone (listed: {listed})", faults=int(killed))
            continue
        except Exception as e:  # noqa: BLE001
            return Trial("kill-prune", params, FAILED, f"step {s} is half: {judge_error(e)[1]}", faults=int(killed))
        if not same(states[s], got):
            return Trial("kill-prune", params, FAILED, f"step {s} does not read bit-exact", faults=int(killed))
    st, prefix = open_store(base, opts)  # finish: prune again, then gc of the pruned steps
    apply_retention(StepIndex(st, prefix), RetentionPolicy(keep_last=2), base, adopt=True)
    for s in (1, 2):
        _runtime.run(collect_garbage(st, f"{prefix}/step-{s:010d}", grace=0))
        left = _runtime.run(st.list(f"{prefix}/step-{s:010d}/"))
        if left:
            return Trial("kill-prune", params, FAILED, f"step {s}: {len(left)} object(s) left after prune and gc")
    for s in (3, 4):
        if not same(states[s], objckpt.read(step_uri(s), storage_options=opts)):
            return Trial("kill-prune", params, FAILED, f"kept step {s} damaged", faults=int(killed))
    if objckpt.CheckpointManager(base, storage_options=opts).steps() != [3, 4]:
        return Trial("kill-prune", params, FAILED, "the index does not list exactly the kept steps")
    return Trial("kill-prune", params, OK, f"{'killed' if killed else 'completed'}; listed {listed} after the kill, "
                 "each whole", faults=int(killed))
