"""docs/integrations.md "PyTorch Lightning", preemption: with ``ObjckptPreemption`` a real SIGTERM
to a Lightning job (one process, or one of two torchrun workers over gloo) makes every rank save
the same step through the plugin to moto S3 over HTTP; Lightning then stops as it does on SIGTERM
(``SIGTERMException``, status 0), and a fresh process resumes from ``ckpt_path="last"`` bit for
bit (tests/lightning_preemption_job.py is the job).  Without the callback, Lightning 2.6 alone
hung both ranks of the same two-rank job until they were killed (its handler runs a collective on
the signalled rank; seen once by hand, not a test: it hangs), which is why the callback defers
Lightning's SIGTERM notifier."""
from __future__ import annotations

import pathlib
import signal
from typing import Any

import pytest
from preemption_jobs import job_env as _env, run_job

from objckpt.lightning import ObjckptCheckpointIO, ObjckptPreemption
from objckpt.manager.preemption import PreemptionSettingsError

TESTS = pathlib.Path(__file__).resolve().parent
JOB = TESTS / "lightning_preemption_job.py"


def _run(args: dict[str, Any], env: dict[str, str], ranks: int = 1) -> list[dict[str, Any]]:
    return run_job(JOB, args, env, ranks)


def _saved_step(path: str, opts: dict[str, Any]) -> int:
    return int(ObjckptCheckpointIO(opts).load_checkpoint(path)["global_step"])


def test_one_process_preempted_saves_then_resumes_from_last_bit_for_bit(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, tmp_path: pathlib.Path) -> None:
    bucket, opts = moto_s3
    root, env = f"s3://{bucket}/run", _env(moto_endpoint, opts)
    base = {"opts": opts, "root": root, "out": str(tmp_path), "max_steps": 8, "check_every": 1}
    [pre] = _run({**base, "mode": "preempt", "signal_at": 3, "user_handler": True}, env)
    p = pre["preempted"]
    # SIGTERM during step 3 (ModelCheckpoint every 2 steps): step 3 saved to last.ckpt, then Lightning's
    # own SIGTERM exit: fit raised SIGTERMException (status 0); the handler there before fit ran too
    assert (p["saved_step"], p["global_step"], p["signalled"]) == (3, 3, [0])
    assert p["fit"] == "SystemExit(None) SIGTERMException" and p["received_sigterm"] is True
    assert p["checkpoint_path"] == f"{root}/checkpoints/last.ckpt" and _saved_step(p["checkpoint_path"], opts) == 3
    assert p["user_calls"] == [int(signal.SIGTERM)] and p["handler_after"] == "user"

    [res] = _run({**base, "mode": "resume"}, env)  # a fresh process: a straight run, then the resume
    straight, resumed = res["straight"], res["resumed"]
    assert resumed["start"] == p["after"]["3"]  # model, optimizer, scheduler as they were at step 3
    assert straight["losses"][:3] == p["losses"] and resumed["losses"] == straight["losses"][3:]
    assert resumed["after"]["8"] == straight["after"]["8"]
    assert resumed["fit"] == "returned" and resumed["saved_step"] is None


def test_one_rank_of_two_signalled_every_rank_saves_the_same_step(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, tmp_path: pathlib.Path) -> None:
    bucket, opts = moto_s3
    root, env = f"s3://{bucket}/run", _env(moto_endpoint, opts)
    base = {"opts": opts, "root": root, "out": str(tmp_path), "max_steps": 12, "check_every": 2}
    # rank 1 only, during step 2; the ranks check at calls 1, 3, 5...: both save step 3 and stop
    ranks = _run({**base, "mode": "preempt", "signal_at": 2, "signal_rank": 1}, env, ranks=2)
    for out in ranks:
        p = out["preempted"]
        assert (p["saved_step"], p["global_step"], p["signalled"], p["fit"]) == (
            3, 3, [1], "SystemExit(None) SIGTERMException")
    assert _saved_step(ranks[0]["preempted"]["checkpoint_path"], opts) == 3
    # a fresh job of another world size (1) restores step 3 as rank 0 had it, and goes on
    [res] = _run({**base, "mode": "resume", "reference": False}, env)
    assert res["resumed"]["start"] == ranks[0]["preempted"]["after"]["3"]
    assert res["resumed"]["global_step"] == 12


def test_bad_settings_are_named() -> None:
    with pytest.raises(PreemptionSettingsError, match=r"ObjckptPreemption\(deadline_s=\.\.\.\)"):
        ObjckptPreemption(deadline_s=-1)
    with pytest.raises(PreemptionSettingsError, match=r"ObjckptPreemption\(signals=\.\.\.\)"):
        ObjckptPreemption(signals=(signal.SIGKILL,))
    with pytest.raises(PreemptionSettingsError, match=r"leave the callback out"):
        ObjckptPreemption(signals=())
