"""A Hugging Face Trainer job with objckpt's preemption callback, as a user runs it (one process,
or one torchrun worker): ``python hf_preemption_job.py '<json arguments>'``.

The model and data are the recipe's (examples/integrations/hf_trainer.py: a tiny GPT-2, dropout
on, shuffled data), checkpoints every 2 steps.  ``mode``: ``"preempt"``: rank ``signal_rank``
sends itself SIGTERM at the start of the step that ends at ``signal_at``; ``"resume"``: a run
from scratch (the reference), then ``train(resume_from_checkpoint="latest")`` of ``root``.
Each rank writes what it saw to ``<out>/<mode>-<rank>.json`` and exits 0 as the docs say
(``sys.exit(0)`` once ``train`` returned with a preemption step).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import tempfile
from typing import Any

from transformers import TrainerCallback, TrainingArguments

from objckpt.integrations.hf_trainer import ObjckptTrainer
from preemption_jobs import state_digest
from recipes import load_recipe

RECIPE = load_recipe("hf_trainer.py", "hf_trainer_recipe")


def digest(*objs: Any) -> str:
    return state_digest([o.state_dict() for o in objs])


class Job(TrainerCallback):
    """Signals at the chosen step; records the model/optimizer/scheduler digest after each step and
    before the first step of a run (after a resume's loads)."""

    def __init__(self, trainer_ref: list[Any], signal_at: int, signal_rank: int) -> None:
        self.ref, self.signal_at, self.signal_rank = trainer_ref, signal_at, signal_rank
        self.after: dict[int, str] = {}
        self.start = ""

    def _digest(self) -> str:
        t = self.ref[0]
        return digest(t.model, t.optimizer, t.lr_scheduler)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self.start:
            self.start = self._digest()
        if state.global_step + 1 == self.signal_at and args.process_index == self.signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during the step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.after[state.global_step] = self._digest()


def train(a: dict[str, Any], root: str, resume: Any, signal_at: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as logs:
        args = TrainingArguments(
            output_dir=logs, max_steps=a["max_steps"], per_device_train_batch_size=4, learning_rate=3e-3,
            lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, report_to=[], use_cpu=True, seed=7,
            save_strategy="steps", save_steps=2, disable_tqdm=True)
        ref: list[Any] = []
        job = Job(ref, signal_at, a.get("signal_rank", 0))
        trainer = ObjckptTrainer(model=RECIPE.model(), args=args, train_dataset=RECIPE.dataset(32, 1), callbacks=[job],
                                 checkpoint_root=root, storage_options=a["opts"], async_save=True,
                                 preemption_check_every=a["check_every"])
        ref.append(trainer)
        trainer.train(resume_from_checkpoint=resume)
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        return {"losses": losses, "after": job.after, "start": job.start, "global_step": trainer.state.global_step,
                "preemption_step": trainer.preemption_step, "steps": trainer.checkpoint_manager.steps(),
                "latest": trainer.checkpoint_manager.latest_step(), "rank": args.process_index}


def main() -> None:
    a = json.loads(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))
    out: dict[str, Any] = {}
    if a["mode"] == "preempt":
        out["preempted"] = train(a, a["root"], None, a["signal_at"])
    else:
        if a.get("reference", True):
            out["straight"] = train(a, a["root"] + "-straight", None)
        out["resumed"] = train(a, a["root"], "latest")
    pathlib.Path(a["out"], f"{a['mode']}-{rank}.json").write_text(json.dumps(out))
    if out.get("preempted", {}).get("preemption_step") is not None:
        sys.exit(0)  # as the docs say: the job is being preempted


if __name__ == "__main__":
    main()
