"""Plain PyTorch: save the module, optimizer, scheduler, GradScaler and your own objects as they are.

    python examples/integrations/stateful.py s3://my-bucket/runs/stateful   # or a local directory

Anything with ``state_dict()`` and ``load_state_dict()`` is a Stateful value:
objckpt saves its ``state_dict()`` (the stored keys are ``model.<param>``,
``optim.state.0.exp_avg``... exactly as if you had passed the state dicts) and on
load fills the object's current ``state_dict()`` and hands it back to
``load_state_dict()``.  A freshly built optimizer, whose state is still empty,
gets its per-parameter state created from the checkpoint.  The script trains,
saves, trains on (the reference), then builds everything again from scratch as a
restarted job would, loads, and checks that the next losses are the same bit for bit.
S3 endpoint and credentials come from the AWS environment (``AWS_ENDPOINT_URL``...).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F

import objckpt


class Progress:
    """Your own training state: any object with ``state_dict()`` / ``load_state_dict()``."""

    def __init__(self) -> None:
        self.step = 0
        self.samples_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples_seen = sd["step"], sd["samples_seen"]


def build(seed: int) -> dict[str, Any]:
    """Everything a training job builds at start-up; the dict is what gets checkpointed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=1e-2, total_steps=100)
    scaler = torch.amp.GradScaler("cpu")
    return {"model": model, "optim": optim, "sched": sched, "scaler": scaler, "progress": Progress()}


def train(state: dict[str, Any], steps: int) -> list[float]:
    model, optim, sched, scaler, progress = (state[k] for k in ("model", "optim", "sched", "scaler", "progress"))
    losses = []
    for _ in range(steps):
        g = torch.Generator().manual_seed(progress.step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        sched.step()
        optim.zero_grad()
        progress.step += 1
        progress.samples_seen += len(x)
        losses.append(loss.item())
    return losses


def main(uri: str, storage_options: Optional[dict] = None) -> dict[str, Any]:
    state = build(seed=0)
    train(state, 5)
    objckpt.save(state, uri, storage_options=storage_options, overwrite=True)  # the objects themselves
    reference = train(state, 5)

    restarted = build(seed=1)  # a new job: other random weights, empty optimizer state
    objckpt.load(restarted, uri, storage_options=storage_options)
    resumed = train(restarted, 5)
    assert resumed == reference, (resumed, reference)
    return {"reference": reference, "resumed": resumed, "step": restarted["progress"].step,
            "keys": sorted(objckpt.inspect(uri, storage_options=storage_options).tensors)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} URI")
    print(json.dumps(main(sys.argv[1]), indent=1))
