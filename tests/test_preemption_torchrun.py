"""Preemption under torchrun (torch.distributed.run: its elastic agent and 2 gloo workers), as a
user runs it: what the job's exit status is when SIGTERM reaches only a worker, and when it
reaches the agent (which forwards it to every worker, waits ``--shutdown-timeout`` for them,
then exits with an error whatever they did; docs/tiering.md, "Preemption")."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from objckpt.manager.preemption import DEFAULT_CHECK_EVERY

SCRIPT = r"""
import json, os, sys, time, torch, objckpt
work, root, opts, wait_signal = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1"
rank = int(os.environ["RANK"])
torch.distributed.init_process_group("gloo")
mgr = objckpt.CheckpointManager(root, storage_options=opts, save_every=100)
for step in range(1, 1000):
    if step == 3:  # the test signals once every rank is here, then lets them go on
        open(os.path.join(work, f"ready-{rank}"), "w").write(str(os.getpid()))
        while not os.path.exists(os.path.join(work, "go")) or (wait_signal or rank == 1) and not mgr.preempted:
            time.sleep(0.01)
    state = {"w": torch.full((8,), float(step * 10 + rank)), "step": step}
    if mgr.should_save(step) or mgr.reached_preemption(step):
        mgr.save(step, {"w": objckpt.Shard(state["w"], (16,), (8 * rank,)), "step": step})
    if mgr.preemption_step == step:
        mgr.wait()
        open(os.path.join(work, f"done-{rank}"), "w").write(json.dumps({"step": step, "preempted": mgr.preempted}))
        sys.exit(0)
sys.exit(3)
"""


@pytest.mark.parametrize("target", ["worker", "agent"])
def test_torchrun_job_preempted(target: str, tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "--monitor-interval", "0.1", str(script), str(tmp_path), root, json.dumps(opts),
                              "1" if target == "agent" else "0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
        end = time.monotonic() + 180  # a hang guard only
        while not all(f.exists() and f.read_text() for f in ready):
            assert agent.poll() is None and time.monotonic() < end, agent.communicate()[0][-3000:]
            time.sleep(0.05)
        # the agent forwards its SIGTERM to every worker; a worker's goes to that worker only
        os.kill(agent.pid if target == "agent" else int(ready[1].read_text()), signal.SIGTERM)
        (tmp_path / "go").write_text("")
        out = agent.communicate(timeout=180)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    done = [json.loads((tmp_path / f"done-{r}").read_text()) for r in range(2)]
    # reached_preemption checks at its calls 1, 1+k, 1+2k, ... (k: the default preemption_check_every):
    # the first check at step 3 or after is the step every rank saves
    k = DEFAULT_CHECK_EVERY
    step = next(1 + j * k for j in range(1000) if 1 + j * k >= 3)
    assert [d["step"] for d in done] == [step, step], out[-3000:]
    assert [d["preempted"] for d in done] == ([True, True] if target == "agent" else [False, True])
    if target == "worker":
        assert agent.returncode == 0, out[-3000:]  # both workers exited 0: torchrun reports success
    else:  # torchrun re-raises the SignalException its own handler raised: a failure, whatever the workers did
        assert agent.returncode != 0 and "SignalException" in out, out[-3000:]
    m = objckpt.CheckpointManager(root, storage_options=opts, preemption_signals=())
    assert m.latest_step() == step
    st = {"w": torch.zeros(16), "step": 0}
    m.load(st)
    assert torch.equal(st["w"], torch.tensor([step * 10.0] * 8 + [step * 10.0 + 1] * 8)) and st["step"] == step
    m.close()
