"""Hugging Face Trainer: checkpoints on S3 through objckpt, rotation, best model, resume.

Run::

    python examples/integrations/hf_trainer.py s3://bucket/run-1 --stop-at 4     # saves steps 2 and 4, stops
    python examples/integrations/hf_trainer.py s3://bucket/run-1 --resume latest  # continues at 5
    python examples/integrations/hf_trainer.py s3://bucket/run-2 --resume s3://bucket/run-1/step-0000000002
    python examples/integrations/hf_trainer.py --from-pretrained s3://bucket/run-1/step-0000000006

The S3 endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...).  The model is a tiny GPT-2 built from a config
(random weights, dropout on), the data fixed and shuffled by the Trainer, so a
run that stops and resumes logs exactly the losses of a run that never stopped;
``tests/test_hf_trainer.py`` checks that against moto S3, in fresh processes.
``--from-pretrained`` builds the model from a step in one call
(``objckpt.integrations.hf_pretrained.from_pretrained``, no export first);
``tests/test_hf_pretrained.py`` runs it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from objckpt.integrations.hf_pretrained import from_pretrained, training_arguments
from objckpt.integrations.hf_trainer import ObjckptTrainer

MAX_STEPS = 6


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # dropout 0.1 (the default)
    m = GPT2LMHeadModel(config)
    m.generation_config.update(max_new_tokens=8, do_sample=True, top_k=4)  # stored with each step
    return m


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 12), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def digest(m: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(m.state_dict().items()):
        h.update(k.encode() + v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Record(TrainerCallback):
    """The model's weights (a digest) after each optimizer step, before any save or best-model load."""

    def __init__(self) -> None:
        self.weights: dict[int, str] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        self.weights[state.global_step] = digest(model)


class StopAt(TrainerCallback):
    """Stops training after ``step`` (the Trainer saves that step first when it is a save step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def train(root: str, *, resume: Optional[str] = None, stop_at: Optional[int] = None,
          storage_options: Optional[dict[str, Any]] = None, async_save: bool = True,
          use_cpu: bool = True) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as logs:  # the Trainer's own output_dir: logs only, no checkpoint
        args = TrainingArguments(
            output_dir=logs, max_steps=MAX_STEPS, per_device_train_batch_size=4, learning_rate=3e-3,
            lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, report_to=[], use_cpu=use_cpu, seed=7,
            save_strategy="steps", save_steps=2, save_total_limit=2,            # rotation: the 2 newest...
            eval_strategy="steps", eval_steps=2, metric_for_best_model="loss",  # ... plus the best
            greater_is_better=False, load_best_model_at_end=True, disable_tqdm=True,
        )
        record = Record()
        trainer = ObjckptTrainer(
            model=model(), args=args, train_dataset=dataset(32, 1), eval_dataset=dataset(8, 2),
            callbacks=[record] + ([StopAt(stop_at)] if stop_at else []),
            checkpoint_root=root, storage_options=storage_options, async_save=async_save,
        )
        trainer.train(resume_from_checkpoint=resume)  # "latest", an objckpt URI, or None
        losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        return {"losses": losses, "weights": record.weights, "global_step": trainer.state.global_step,
                "best": trainer.state.best_model_checkpoint, "steps": trainer.checkpoint_manager.steps(),
                "args": args.to_dict()}


def pretrained(step_uri: str, storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The model of a step, built by ``from_pretrained`` in one call, and the run's arguments."""
    m = from_pretrained(AutoModelForCausalLM, step_uri, storage_options=storage_options)
    args = training_arguments(step_uri, storage_options=storage_options)
    return {"class": type(m).__name__, "weights": digest(m), "generation_config": m.generation_config.to_dict(),
            "tied": m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr(),
            "args": args.to_dict(), "name_or_path": m.name_or_path}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", help="checkpoint root, e.g. s3://bucket/run-1")
    p.add_argument("--from-pretrained", metavar="STEP_URI", default=None,
                   help="build the model of a step with from_pretrained and print what it holds")
    p.add_argument("--resume", default=None, help='"latest" or a checkpoint URI')
    p.add_argument("--stop-at", type=int, default=None)
    a = p.parse_args()
    if a.from_pretrained:
        print(json.dumps(pretrained(a.from_pretrained)))
    elif a.root:
        print(json.dumps(train(a.root, resume=a.resume, stop_at=a.stop_at)))
    else:
        p.error("give a checkpoint root, or --from-pretrained STEP_URI")


if __name__ == "__main__":
    main()
