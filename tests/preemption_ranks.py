"""Rank processes for the preemption tests: a training loop as the docs show it, real signals.

Each rank is a fork of testkit's forkserver (torch imported once), joins a gloo group over
a file rendezvous, runs :func:`train` or :func:`restart`, writes its result as JSON and
leaves as a user's script does: ``sys.exit(0)`` after ``mgr.wait()`` (multiprocessing turns
that into the process's exit code after Python's thread shutdown, as the interpreter
would).  A rank that fails writes its traceback and exits 1.

:func:`train` saves the state of :mod:`tier_state` every ``save_every`` steps and at the
step the ranks agree on; a rank signals itself (``os.kill(os.getpid(), SIGTERM)``) just
before its call of ``reached_preemption`` at the step ``signal_at[rank]`` names, so the
step the ranks agree on is known in advance: nothing depends on timing.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from testkit.procs import rank_context

import tier_state

#: the loop's last step: far past every step a test signals at (reaching it fails the test)
LAST_STEP = 60


def _manager(a: dict[str, Any], rank: int) -> Any:
    import objckpt

    kw: dict[str, Any] = dict(storage_options=a["opts"], save_every=a.get("save_every", 4),
                              preemption_check_every=a.get("check_every", 1))
    if "deadline" in a:
        kw["preemption_deadline_s"] = a["deadline"]
    if a.get("local"):
        kw["tier"] = objckpt.TierSettings(local_dir=a["local"], replicas=a.get("replicas", 1), persist_every=None)
        kw["node_override"] = f"n{rank * a.get('nodes', 2) // a['world']}"
    return objckpt.CheckpointManager(a["root"], **kw)


def train(a: dict[str, Any]) -> None:
    """The documented loop; ``signal_at``: {rank: step}; ``second_signal``: this rank sends
    itself another SIGTERM from inside the preemption save; ``user_handler``: a handler the
    script installed before the manager (its calls are counted)."""
    rank, world = a["rank"], a["world"]
    user_calls: list[int] = []
    if a.get("user_handler"):
        signal.signal(signal.SIGTERM, lambda s, f: user_calls.append(s))
    if a.get("second_signal"):
        _signal_inside_save()
    kill_hook = _kill_hook(a)
    m = _manager(a, rank)
    if kill_hook is not None:
        kill_hook.install_on_store(a["point"], m.index.store)
    at = {int(k): v for k, v in a.get("signal_at", {}).items()}.get(rank)
    for step in range(1, LAST_STEP + 1):
        if step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        if m.should_save(step) or m.reached_preemption(step):
            if kill_hook is not None:
                kill_hook.armed, kill_hook.step = m.preemption_step == step, step
            _SECOND[0] = m.preemption_step == step
            m.save(step, tier_state.state(rank, world, step))
        if m.preemption_step == step:
            m.wait()
            rec = m._preemption.record
            _result(a, {"preemption_step": step, "preempted": m.preempted, "signals": rec.count,
                        "user_calls": len(user_calls)})
            sys.exit(0)
    _result(a, {"preemption_step": None})
    sys.exit(0)


#: whether the save about to be made is the preemption save (the second signal's cue)
_SECOND = [False]


def _signal_inside_save() -> None:
    """A second SIGTERM from inside the preemption save's write of the step (after the first)."""
    from objckpt.manager import steps, tiers

    for mod in (steps, tiers):
        real = mod._save

        def again(*args: Any, _real: Callable[..., Any] = real, **kw: Any) -> Any:
            if _SECOND[0]:
                _SECOND[0] = False
                os.kill(os.getpid(), signal.SIGTERM)
            return _real(*args, **kw)
        mod._save = again  # type: ignore[assignment]


def _kill_hook(a: dict[str, Any]) -> Any:
    """testkit's kill hook (SIGKILL every victim at a point of the tier's code), armed by the
    loop for the preemption save only."""
    if not a.get("point"):
        return None
    from testkit.campaign_tier import KillHook

    hook = KillHook({"dir": a["dir"], "rank": a["rank"], "victims": a["victims"], "triggers": a["triggers"]})
    if a["point"] != "drain_commit":
        hook.install(a["point"])
    return hook


def restart(a: dict[str, Any]) -> None:
    """A new job: ``latest_step()``, then load it into zeros and say whether every value is that step's."""
    rank, world = a["rank"], a["world"]
    m = _manager(a, rank)
    latest = m.latest_step()
    st = tier_state.zeros(rank, world)
    res = m.load(st)
    out = {"latest": latest, "loaded": res.step, "exact": tier_state.equal(st, rank, world, res.step)}
    if a.get("save_after"):  # the next save and wait(): a step the cut drain left behind is drained too
        m.save(res.step + 1, tier_state.state(rank, world, res.step + 1), force=True)
        m.wait()
        out["object_steps"] = m.steps()
    m.close()
    _result(a, out)
    sys.exit(0)


def _result(a: dict[str, Any], out: dict[str, Any]) -> None:
    Path(a["dir"], f"result-{a['phase']}-{a['rank']}.json").write_text(json.dumps(out))


def _entry(fn: Callable[[dict[str, Any]], None], a: dict[str, Any]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "60"
    torch.set_num_threads(1)
    Path(a["dir"], f"pid{a['rank']}").write_text(str(os.getpid()))
    import logging

    import torch.distributed as dist

    handler = logging.FileHandler(Path(a["dir"], f"log-{fn.__name__}-{a['rank']}.txt"))
    logging.getLogger("objckpt").addHandler(handler)
    logging.getLogger("objckpt").setLevel(logging.INFO)

    try:
        dist.init_process_group("gloo", init_method=a["rdzv"], rank=a["rank"], world_size=a["world"],
                                timeout=datetime.timedelta(seconds=60))
        fn(a)
    except SystemExit:
        raise
    except BaseException:
        _result(a, {"error": traceback.format_exc()[-3000:]})
        sys.exit(1)


def run(fn: Callable[[dict[str, Any]], None], a: dict[str, Any], world: int,
        timeout: float = 120.0) -> tuple[list[Optional[int]], list[Optional[dict[str, Any]]]]:
    """``fn`` on ``world`` ranks (``a`` plus each one's rank): their exit codes and results
    (None: none written).  ``timeout`` only guards against a hang (its ranks are killed)."""
    phase = fn.__name__
    rd = tempfile.mkdtemp(prefix="objckpt-rdzv-", dir=a["dir"])
    args = {**a, "world": world, "phase": phase, "rdzv": "file://" + os.path.join(rd, "store")}
    ctx = rank_context()
    procs = [ctx.Process(target=_entry, args=(fn, {**args, "rank": r})) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    shutil.rmtree(rd, ignore_errors=True)
    results: list[Optional[dict[str, Any]]] = []
    for r in range(world):
        f = Path(a["dir"], f"result-{phase}-{r}.json")
        results.append(json.loads(f.read_text()) if f.exists() else None)
        f.unlink(missing_ok=True)
    return [p.exitcode for p in procs], results


def logs(a: dict[str, Any], fn: Callable[..., Any], rank: int) -> str:
    """What rank ``rank``'s objckpt loggers wrote in its last run of ``fn`` (INFO and up)."""
    f = Path(a["dir"], f"log-{fn.__name__}-{rank}.txt")
    return f.read_text() if f.exists() else ""
