"""Failed drains retried on a clock: with no save or wait(), a due step reaches object storage
once it is reachable again, on one rank and on two (real gloo processes, the same retries in
the same order), close() stops the clock, bad settings are refused before anything is
written, and a forked child inherits no clock.

Object storage is moto over HTTP behind a proxy that resets every request while "down";
temporary folders stand for nodes.  The waits poll for outcomes under generous deadlines;
nothing asserts how fast."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import objckpt
from mp import run_allowing_death, run_multiprocess
from objckpt.tier.backlog import DrainQueue, Undrained
from objckpt.tier.errors import DrainError, TierSettingsError
from objckpt.tier.retry_clock import OrderedJobs

DEADLINE = 60.0  # seconds: generous; the outcomes come far sooner


def _until(what: str, ok: Callable[[], Any], deadline: float = DEADLINE) -> Any:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        got = ok()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {deadline} s: {what}")


def _readable(uri: str, opts: dict[str, Any]) -> bool:
    try:
        objckpt.read(uri, storage_options=opts)
        return True
    except (objckpt.ObjckptError, OSError):
        return False


def _down(opts: dict[str, Any]) -> Any:
    from testkit.campaign_io import FaultProxy

    # every request through it is reset before it reaches the server: object storage is down
    return FaultProxy(opts["endpoint_url"], kind="reset", probability=1.0, max_offset=0, direction="up")


@contextlib.contextmanager
def _behind_down_endpoint(tmp_path: Path, root: str, opts: dict[str, Any],
                          retry_s: float) -> Iterator[tuple[objckpt.CheckpointManager, Any]]:
    """One rank's manager whose object storage is reached through a proxy (down until the
    test sets its ``probability`` to 0), draining every step, retrying on a ``retry_s``
    clock; the manager and the proxy, which is closed on the way out."""
    proxy = _down(opts)
    try:
        yield objckpt.CheckpointManager(root, storage_options={**opts, "endpoint_url": proxy.url},
                                        local_dir=str(tmp_path / "local"), persist_every=1, replicas=0,
                                        drain_retry_s=retry_s), proxy
    finally:
        proxy.close()


# -- the pieces ----------------------------------------------------------------------------------------

def test_the_backoff_doubles_per_failed_round_up_to_the_cap_and_starts_again_after_progress() -> None:
    q = DrainQueue(4)
    assert q.retry_in(1.0) is None  # nothing waits: no retry
    fail = DrainError("down", step=1)

    def attempt(u: Undrained) -> None:
        raise fail

    q.run(Undrained(1, {}, 0.0), attempt)
    now = q.last_round
    assert q.retry_in(1.0, cap=5.0, now=now) == 1.0
    for want in (2.0, 4.0, 5.0, 5.0):  # doubled per round that failed in a row, at most the cap
        q.run(None, attempt)
        assert q.retry_in(1.0, cap=5.0, now=q.last_round) == want
    assert q.retry_in(30.0, cap=5.0, now=q.last_round) == 30.0  # a first wait above the cap is kept
    drained: list[int] = []
    q.run(Undrained(2, {}, 0.0), lambda u: drained.append(u.step) if u.step == 1 else attempt(u))
    assert drained == [1] and q.steps == {2}
    assert q.retry_in(1.0, cap=5.0, now=q.last_round) == 1.0  # progress: from the first wait again


def test_a_retry_goes_after_the_agreed_job_and_saves_made_meanwhile_are_held_not_waited_for() -> None:
    order: list[str] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    gate = threading.Event()
    jobs = OrderedJobs(pool)
    first = jobs.submit(lambda: (gate.wait(10), order.append("save1")))
    assert jobs.freeze() == 1
    held = jobs.submit(order.append, "save2")  # returns at once: held while the ranks agree
    assert not held.done()
    jobs.place(2, lambda: order.append("retry"))  # another rank had handed over 2 jobs already
    late = jobs.submit(order.append, "save3")
    gate.set()
    concurrent.futures.wait([first, held, late, *jobs.retries])
    pool.shutdown()
    assert order == ["save1", "save2", "retry", "save3"]  # the same place on every rank
    assert jobs.take_error() is None  # the retry's outcome, looked at once

    # a rank behind the others: two retries agreed on after jobs it has not submitted yet
    order.clear()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    jobs = OrderedJobs(pool)
    jobs.submit(order.append, "save1")
    for after, name in ((3, "retry1"), (4, "retry2")):
        jobs.freeze()
        jobs.place(after, lambda name=name: order.append(name))
    assert jobs.retries == []  # placed when those jobs are submitted
    done = [jobs.submit(order.append, f"save{n}") for n in (2, 3, 4, 5)]
    concurrent.futures.wait([*done, *jobs.retries])
    pool.shutdown()
    assert order == ["save1", "save2", "save3", "retry1", "save4", "retry2", "save5"]


# -- one rank ------------------------------------------------------------------------------------------

def test_a_failed_drain_reaches_object_storage_with_no_further_save_or_wait(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with _behind_down_endpoint(tmp_path, root, opts, 0.2) as (m, proxy):
        m.save(1, {"x": torch.arange(10.0)}, metadata={"loss": 0.5})
        q = m._tiers._undrained
        _until("the save's own drain failed", lambda: q.failed_rounds >= 1)
        assert not _readable(f"{root}/step-0000000001", opts)
        proxy.probability = 0.0  # object storage is back; the training loop calls nothing
        got = _until("step 1 drained by the clock",
                     lambda: _readable(f"{root}/step-0000000001", opts) and not q.waiting)
        assert got and m._tiers._clock.retries >= 1
        assert torch.equal(objckpt.read(f"{root}/step-0000000001", storage_options=opts)["x"], torch.arange(10.0))
        m.close()  # nothing left to report
        assert m.steps() == [1] and m.entries().get(1).metadata == {"loss": 0.5}  # indexed too
        assert sorted(os.listdir(tmp_path / "local")) == ["step-0000000001"]  # no drain record left


def test_close_stops_the_clock_and_leaves_the_step_absent_never_half_drained(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with _behind_down_endpoint(tmp_path, root, opts, 0.3) as (m, proxy):
        m.save(1, {"x": torch.ones(8)})
        clock = m._tiers._clock
        _until("a retry of the clock failed too", lambda: clock.retries >= 1 and m._tiers._undrained.failed_rounds >= 2)
        with pytest.raises(DrainError, match=r"\[1\]"):  # still down: close() reports the step not drained
            m.close()
        assert not clock.running
        assert "objckpt-drain-clock" not in [t.name for t in threading.enumerate()]
        retries = clock.retries
        proxy.probability = 0.0  # object storage is back, but the manager is closed: no retry any more
        time.sleep(1.0)  # three times the first wait
        assert clock.retries == retries
        assert not _readable(f"{root}/step-0000000001", opts)  # absent (a manifest only once complete)
        # kept locally and recorded as due: the next run drains it
        assert sorted(os.listdir(tmp_path / "local")) == [".objckpt-drains", "step-0000000001"]


# -- bad settings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_a_bad_drain_retry_s_is_refused_before_anything_is_written(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(TierSettingsError, match="drain_retry_s must be a positive"):
        objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), drain_retry_s=bad)
    assert not (tmp_path / "local").exists() and not (tmp_path / "root").exists()


def _construct(rank: int, world: int, local: str, per_rank: dict[int, dict[str, Any]]) -> str:
    try:
        objckpt.CheckpointManager(local + "-root", local_dir=local, node_override=f"n{rank}", replicas=0,
                                  **per_rank.get(rank, {}))
    except TierSettingsError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_drain_retry_s_that_differs_between_ranks_is_refused_on_every_rank(tmp_path: Path) -> None:
    local = str(tmp_path / "{node}")
    got = run_multiprocess(2, _construct, local, {0: {"drain_retry_s": -2}, 1: {"drain_retry_s": -2}}, timeout=90)
    assert all("drain_retry_s must be a positive" in g and "rank 0" in g and "rank 1" in g for g in got), got
    got = run_multiprocess(2, _construct, local, {1: {"drain_retry_s": 5}}, timeout=90)
    assert all("drain_retry_s: 30.0 on rank(s) [0], 5 on rank(s) [1]" in g for g in got), got
    assert not any((tmp_path / n).exists() and os.listdir(tmp_path / n) for n in ("n0", "n1"))


# -- two ranks -----------------------------------------------------------------------------------------

def _two_ranks_while_s3_comes_back(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> Any:
    import torch.distributed as dist

    proxy = _down(opts) if rank == 0 else None
    url = [proxy.url if proxy is not None else None]
    dist.broadcast_object_list(url, 0)
    m = objckpt.CheckpointManager(root, storage_options={**opts, "endpoint_url": url[0]}, local_dir=local,
                                  node_override=f"n{rank}", replicas=1, persist_every=1, drain_retry_s=0.2)
    w = torch.arange(12.0) + rank
    m.save(1, {"w": objckpt.Shard(w, (24,), (12 * rank,))})
    q = m._tiers._undrained
    _until("the save's own drain failed", lambda: q.failed_rounds >= 1)
    dist.barrier()
    if proxy is not None:
        proxy.probability = 0.0  # object storage is back; neither rank saves or waits
    _until("step 1 drained by the clock", lambda: not q.waiting)
    seen = ([u.step for u in q.waiting], q.failed_rounds, m._tiers._clock.retries)

    def another(name: str) -> Any:
        return objckpt.CheckpointManager(root, storage_options=opts, local_dir=f"{local}-{name}",
                                         node_override=f"n{rank}", replicas=1, drain_retry_s=0.2)

    other = another("other")  # while m's clock runs on its group: none for this one (a warning)
    clocks = [other._tiers._clock is None]
    other.close()
    m.close()
    again = another("again")  # m closed on every rank: this one has the clock
    clocks.append(again._tiers._clock is not None)
    again.close()
    steps = m.steps()
    if proxy is not None:
        proxy.close()
    return seen, steps, clocks


def test_two_ranks_retry_alike_on_rank_0s_clock_and_end_with_equal_queues(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    got = run_multiprocess(2, _two_ranks_while_s3_comes_back, root, local, opts, timeout=120)
    (seen0, steps0, clocks0), (seen1, steps1, clocks1) = got
    assert clocks0 == clocks1 == [True, True]  # one clock per group at a time, decided alike
    assert seen0 == seen1 and seen0[0] == [] and seen0[1] == 0  # the same queue, the same backoff
    assert seen0[2] >= 1  # drained by the clock's retries, as many on each rank
    assert steps0 == steps1 == [1]
    st = {"w": torch.zeros(24)}
    objckpt.load(st, f"{root}/step-0000000001", storage_options=opts)
    assert torch.equal(st["w"], torch.cat([torch.arange(12.0), torch.arange(12.0) + 1]))


def _rank_1_dies(rank: int, world: int, base: str) -> str:
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "4"
    m = objckpt.CheckpointManager(os.path.join(base, "root"), local_dir=os.path.join(base, "{node}"),
                                  node_override=f"n{rank}", replicas=1, drain_retry_s=0.2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # while its clock listens for rank 0's word
    clock = m._tiers._clock
    _until("rank 0's clock noticed", lambda: clock.error is not None)
    try:
        m.wait()
        return "no error"
    except objckpt.CollectiveError as e:
        return f"{type(e).__name__}: {e}"




def test_a_rank_that_dies_stops_the_clock_with_a_clear_error_never_a_hang(tmp_path: Path) -> None:
    results, codes = run_allowing_death(2, _rank_1_dies, str(tmp_path), timeout=90)
    assert codes[1] == -signal.SIGKILL
    assert results[0].startswith("CollectiveError: the drain retry clock stopped on rank 0"), results
    assert "broadcast_object" in results[0]


# -- fork ----------------------------------------------------------------------------------------------

_FORK = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch, objckpt
    from objckpt.tier import retry_clock

    base = sys.argv[1]
    root = os.path.join(base, "root")
    open(root, "w").write("a file where the root's folder should be: every drain fails")
    m = objckpt.CheckpointManager(root, local_dir=os.path.join(base, "local"), persist_every=1, drain_retry_s=0.1)
    m.save(1, {"x": torch.ones(4)})
    clock = m._tiers._clock
    while clock.retries < 1:  # the clock runs and has retried at least once
        time.sleep(0.02)
    pid = os.fork()
    if pid == 0:
        time.sleep(0.5)  # five first waits: a clock running here would have retried
        report = {"running": clock.running, "threads": [t.name for t in threading.enumerate()],
                  "clocks": len(retry_clock._clocks)}
        clock.stop()  # returns at once: nothing to stop, no word sent
        with open(os.path.join(base, "child.json"), "w") as f:
            json.dump(report, f)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    os.unlink(root)  # object storage is back: the parent's clock still drains
    while True:
        try:
            objckpt.read(os.path.join(root, "step-0000000001"))
            break
        except (objckpt.ObjckptError, OSError):
            time.sleep(0.05)
    m.close()
    print("PARENT-DRAINED", m.steps(), flush=True)
    """
)


def test_a_forked_child_inherits_no_running_clock(tmp_path: Path) -> None:
    script = tmp_path / "fork.py"
    script.write_text(_FORK)
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PARENT-DRAINED [1]" in r.stdout, r.stdout + r.stderr[-2000:]
    import json

    child = json.loads((tmp_path / "child.json").read_text())
    assert child["running"] is False and child["clocks"] == 0
    assert "objckpt-drain-clock" not in child["threads"]
