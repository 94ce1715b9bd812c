"""docs/integrations.md "Hugging Face Trainer", preemption: a real SIGTERM to a Trainer job (one
process, or one of two torchrun workers over gloo) makes every rank save the same step, off the
save interval, to moto S3 over HTTP; ``train()`` returns, the job exits 0, and a fresh process
resumes from that step bit for bit (tests/hf_preemption_job.py is the job)."""
from __future__ import annotations

import pathlib
import signal
from typing import Any

import pytest
from preemption_jobs import job_env as _env, run_job

import objckpt
from objckpt.manager.preemption import DEFAULT_CHECK_EVERY, DEFAULT_DEADLINE_S, PreemptionSettingsError

TESTS = pathlib.Path(__file__).resolve().parent
JOB = TESTS / "hf_preemption_job.py"
MAX_STEPS = 6


def _run(args: dict[str, Any], env: dict[str, str], ranks: int = 1) -> list[dict[str, Any]]:
    return run_job(JOB, args, env, ranks)


def _committed(root: str, opts: dict[str, Any], step: int) -> None:
    mgr = objckpt.CheckpointManager(root, storage_options=opts, preemption_signals=())
    try:
        assert mgr.latest_step() == step
    finally:
        mgr.close()
    ts = objckpt.read(f"{root}/step-{step:010d}", "trainer_state", storage_options=opts)["trainer_state"]
    assert ts["global_step"] == step


def test_one_process_preempted_saves_off_interval_then_resumes_bit_for_bit(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, tmp_path: pathlib.Path) -> None:
    bucket, opts = moto_s3
    root, env = f"s3://{bucket}/run", _env(moto_endpoint, opts)
    base = {"opts": opts, "root": root, "out": str(tmp_path), "max_steps": MAX_STEPS, "check_every": 1}
    [pre] = _run({**base, "mode": "preempt", "signal_at": 3}, env)
    p = pre["preempted"]
    # SIGTERM during step 3 (save_steps=2): step 3 is saved anyway, training stops, train() returns
    assert p["preemption_step"] == 3 and p["global_step"] == 3 and p["steps"] == [2, 3] and p["latest"] == 3
    _committed(root, opts, 3)

    [res] = _run({**base, "mode": "resume"}, env)  # a fresh process: a straight run, then the resume
    straight, resumed = res["straight"], res["resumed"]
    assert resumed["start"] == p["after"]["3"]  # model, optimizer, scheduler as they were at step 3
    assert resumed["losses"] == straight["losses"] and len(straight["losses"]) == MAX_STEPS
    assert {s: resumed["after"][s] for s in ("4", "5", "6")} == {s: straight["after"][s] for s in ("4", "5", "6")}
    assert resumed["global_step"] == MAX_STEPS and resumed["preemption_step"] is None


def test_one_rank_of_two_signalled_every_rank_saves_the_same_step(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, tmp_path: pathlib.Path) -> None:
    bucket, opts = moto_s3
    root, env = f"s3://{bucket}/run", _env(moto_endpoint, opts)
    base = {"opts": opts, "root": root, "out": str(tmp_path), "max_steps": 8, "check_every": 2}
    # rank 1 only, during step 2; the ranks check at calls 1, 3, 5...: both stop at step 3
    ranks = _run({**base, "mode": "preempt", "signal_at": 2, "signal_rank": 1}, env, ranks=2)
    for r, out in enumerate(ranks):
        p = out["preempted"]
        assert (p["rank"], p["preemption_step"], p["global_step"], p["steps"]) == (r, 3, 3, [2, 3])
    _committed(root, opts, 3)
    # a fresh job of another world size (1) restores step 3 as rank 0 had it, and goes on
    [res] = _run({**base, "mode": "resume", "reference": False}, env)
    assert res["resumed"]["start"] == ranks[0]["preempted"]["after"]["3"]
    assert res["resumed"]["global_step"] == 8


def test_the_trainer_listens_during_train_only_with_its_keywords_and_empty_turns_it_off(
        tmp_path: pathlib.Path) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from objckpt.integrations.hf_preemption import ObjckptPreemptionCallback
    from objckpt.integrations.hf_trainer import ObjckptTrainer
    from recipes import load_recipe

    recipe = load_recipe("hf_trainer.py", "hf_trainer_recipe")
    args = TrainingArguments(output_dir=str(tmp_path / "logs"), max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    before = signal.getsignal(signal.SIGUSR1)
    seen: list[Any] = []

    class Look(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            p = trainer.checkpoint_manager._preemption.settings
            seen.append((signal.getsignal(signal.SIGUSR1) is not before, p.signals, p.deadline_s, p.check_every))

    def make(**kw: Any) -> Any:
        return ObjckptTrainer(model=recipe.model(), args=args, train_dataset=recipe.dataset(4, 1), callbacks=[Look()],
                              checkpoint_root=str(tmp_path / "run"), **kw)

    trainer = make(preemption_signals=(signal.SIGUSR1,), preemption_deadline_s=7, preemption_check_every=3)
    assert any(isinstance(cb, ObjckptPreemptionCallback) for cb in trainer.callback_handler.callbacks)
    assert trainer.checkpoint_manager.steps() == [] and signal.getsignal(signal.SIGUSR1) is before  # not in train
    trainer.train()
    # in train: the manager listens to what the trainer was given; after it, the handler is back
    assert seen == [(True, (signal.SIGUSR1,), 7.0, 3)] and trainer.preemption_step is None
    assert signal.getsignal(signal.SIGUSR1) is before

    seen.clear()
    trainer = make(preemption_signals=())
    assert trainer.preemption_callback is None
    assert not any(isinstance(cb, ObjckptPreemptionCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert seen == [(False, (), DEFAULT_DEADLINE_S, DEFAULT_CHECK_EVERY)]
    with pytest.raises(PreemptionSettingsError, match=r"ObjckptTrainer\(preemption_deadline_s=\.\.\.\)"):
        make(preemption_deadline_s=0)
