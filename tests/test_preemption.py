"""Preemption in one process: the signal handler's installation, chaining and removal, the
settings' errors, what reached_preemption returns, and a user's script (a new process,
moto S3 over HTTP) that is sent SIGTERM and exits 0 with the step saved.  The multi-rank
cases are in test_preemption_ranks.py."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import objckpt
from objckpt.manager import preemption
from objckpt.manager.preemption import PreemptionSettingsError


@pytest.fixture
def user_handler() -> Iterator[list[int]]:
    """A SIGTERM handler of the test's own, installed first (so a stray signal never kills pytest)."""
    calls: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, before)


def _mgr(tmp_path: Path, **kw: Any) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(str(tmp_path / "run"), no_dist=True, **kw)


def test_no_signals_installs_nothing_and_never_reaches_a_preemption(tmp_path: Path, user_handler: list[int]) -> None:
    mine = signal.getsignal(signal.SIGTERM)
    m = _mgr(tmp_path, preemption_signals=())
    assert signal.getsignal(signal.SIGTERM) is mine
    os.kill(os.getpid(), signal.SIGTERM)
    assert user_handler == [signal.SIGTERM]
    assert not m.preempted and not m.reached_preemption(1) and m.preemption_step is None
    m.close()
    assert signal.getsignal(signal.SIGTERM) is mine


def test_the_handler_before_still_runs_and_close_puts_it_back(tmp_path: Path, user_handler: list[int]) -> None:
    mine = signal.getsignal(signal.SIGTERM)
    m = _mgr(tmp_path, save_every=10)
    assert signal.getsignal(signal.SIGTERM) is not mine
    assert not m.reached_preemption(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert user_handler == [signal.SIGTERM] and m.preempted
    assert m.reached_preemption(2) and m.preemption_step == 2
    assert m.reached_preemption(3) and m.preemption_step == 2  # later calls: still True, the step agreed stays
    m.save(2, {"w": torch.arange(4.0)})  # off save_every: saved, as the preemption step
    m.wait()
    assert m.steps() == [2]
    m.close()
    assert signal.getsignal(signal.SIGTERM) is mine


def test_a_manager_dropped_without_close_stops_listening_and_the_next_close_restores(
        tmp_path: Path, user_handler: list[int]) -> None:
    """A manager never closed (a script, a test) must not keep later managers from putting
    back the handler that was there before them: the handler holds managers weakly."""
    import gc

    a = _mgr(tmp_path / "a")
    record = a._preemption.record
    assert record is not None
    del a, record
    gc.collect()
    theirs = signal.getsignal(signal.SIGTERM)  # ours, installed by the manager that was dropped
    calls: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))  # a handler installed after it
    mine_now = signal.getsignal(signal.SIGTERM)
    b = _mgr(tmp_path / "b")
    os.kill(os.getpid(), signal.SIGTERM)
    assert b.preempted and calls == [signal.SIGTERM]
    b.close()
    assert signal.getsignal(signal.SIGTERM) is mine_now and theirs is not mine_now


def test_two_managers_share_the_handler_and_each_close_leaves_the_other_listening(
        tmp_path: Path, user_handler: list[int]) -> None:
    mine = signal.getsignal(signal.SIGTERM)
    a, b = _mgr(tmp_path / "a"), _mgr(tmp_path / "b")
    os.kill(os.getpid(), signal.SIGTERM)
    assert a.preempted and b.preempted and user_handler == [signal.SIGTERM]  # the user's handler ran once
    a.close()
    assert signal.getsignal(signal.SIGTERM) is not mine  # b still listens
    os.kill(os.getpid(), signal.SIGTERM)
    assert b._preemption.record is not None and b._preemption.record.count == 2
    assert a._preemption.record is not None and a._preemption.record.count == 1
    b.close()
    assert signal.getsignal(signal.SIGTERM) is mine and len(user_handler) == 2


def test_a_handler_installed_after_the_manager_is_left_in_place_by_close(tmp_path: Path,
                                                                         user_handler: list[int]) -> None:
    m = _mgr(tmp_path)
    later: list[int] = []

    def chained(s: int, f: Any, ours: Any = signal.getsignal(signal.SIGTERM)) -> None:
        later.append(s)
        ours(s, f)  # a handler that calls the one before it: ours, which calls the user's first one

    signal.signal(signal.SIGTERM, chained)
    os.kill(os.getpid(), signal.SIGTERM)
    assert later == [signal.SIGTERM] and user_handler == [signal.SIGTERM] and m.preempted
    m.close()
    assert signal.getsignal(signal.SIGTERM) is chained


def test_a_manager_made_off_the_main_thread_warns_once_and_installs_nothing(
        tmp_path: Path, user_handler: list[int], caplog: pytest.LogCaptureFixture) -> None:
    mine = signal.getsignal(signal.SIGTERM)
    made: list[objckpt.CheckpointManager] = []
    preemption._warned_thread[0] = False
    with caplog.at_level(logging.WARNING, logger="objckpt.manager"):
        for i in range(2):
            t = threading.Thread(target=lambda i=i: made.append(_mgr(tmp_path / str(i))))
            t.start()
            t.join()
    assert len(made) == 2 and signal.getsignal(signal.SIGTERM) is mine
    assert sum("created off the main thread" in r.getMessage() for r in caplog.records) == 1
    os.kill(os.getpid(), signal.SIGTERM)
    assert not made[0].preempted and not made[0].reached_preemption(1)
    for m in made:
        m.close()


@pytest.mark.parametrize("kw,words", [
    ({"preemption_signals": signal.SIGTERM}, "preemption_signals=.*tuple of signals"),
    ({"preemption_signals": ("SIGTERM",)}, "'SIGTERM' is not a signal"),
    ({"preemption_signals": (signal.SIGKILL,)}, "SIGKILL cannot be caught"),
    ({"preemption_deadline_s": 0}, "preemption_deadline_s=.*positive number of seconds"),
    ({"preemption_deadline_s": float("nan")}, "preemption_deadline_s"),
    ({"preemption_deadline_s": True}, "preemption_deadline_s"),
    ({"preemption_check_every": 0}, "preemption_check_every=.*positive int"),
    ({"preemption_check_every": 2.5}, "preemption_check_every"),
])
def test_bad_preemption_settings_are_named_and_install_nothing(tmp_path: Path, user_handler: list[int],
                                                               kw: dict[str, Any], words: str) -> None:
    mine = signal.getsignal(signal.SIGTERM)
    with pytest.raises(PreemptionSettingsError, match=words) as e:
        _mgr(tmp_path, **kw)
    assert isinstance(e.value, ValueError) and isinstance(e.value, objckpt.ObjckptError)
    assert signal.getsignal(signal.SIGTERM) is mine


SCRIPT = r"""
import json, os, signal, sys, torch, objckpt
root, opts = sys.argv[1], json.loads(sys.argv[2])
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # nothing of the script's own: the default, which kills
mgr = objckpt.CheckpointManager(root, storage_options=opts, save_every=5)
for step in range(1, 1000):
    if step == 7:
        os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
    state = {"w": torch.arange(1000, dtype=torch.float32) * step, "step": step}
    if mgr.should_save(step) or mgr.reached_preemption(step):
        mgr.save(step, state)
    if mgr.preemption_step == step:
        mgr.wait()
        print("preempted at", step, flush=True)
        sys.exit(0)
print("never preempted", flush=True)
sys.exit(3)
"""


def test_a_script_sent_sigterm_saves_the_step_and_exits_0(tmp_path: Path,
                                                          moto_s3: tuple[str, dict[str, Any]]) -> None:
    """The default SIGTERM action (SIG_DFL: die) is not called by the chain: the script lives
    to save step 7 (off its save_every=5 interval) to object storage and exits 0."""
    import json

    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    p = subprocess.run([sys.executable, "-c", SCRIPT, root, json.dumps(opts)], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "preempted at 7"
    m = objckpt.CheckpointManager(root, storage_options=opts, preemption_signals=())
    assert m.latest_step() == 7 and m.steps() == [5, 7]
    st = {"w": torch.zeros(1000), "step": 0}
    m.load(st)
    assert torch.equal(st["w"], torch.arange(1000, dtype=torch.float32) * 7) and st["step"] == 7
    m.close()
