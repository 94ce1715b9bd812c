"""Training with CheckpointManager: periodic async saves, retention, resume after a crash.

Run::

    python examples/integrations/manager_loop.py --root s3://bucket/run-1 --steps 20
    python examples/integrations/manager_loop.py --root /tmp/run-1 --steps 20 --stop-at 9   # "crash" at 9
    python examples/integrations/manager_loop.py --root /tmp/run-1 --steps 20               # resumes at 9

The loop is deterministic (the batch of step ``s`` is drawn from seed ``s``), so a
run that stops and resumes ends with exactly the weights of a run that never stopped;
``tests/test_manager_recipe.py`` checks that bit for bit against moto S3.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Optional

import torch

import objckpt


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def materialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """AdamW creates its state on the first step; a load needs it present to fill in place.
    One step with lr=0 and zero grads creates it without changing a weight."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(root: str, total_steps: int, *, save_every: int = 2, stop_at: Optional[int] = None,
          storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train steps 1..total_steps, resuming from the latest checkpoint under ``root``."""
    model, opt = make_model()
    manager = objckpt.CheckpointManager(
        root, keep_last=2, keep_every=10,            # the 2 newest, plus every 10th step
        keep_best=1, best_key="loss", best_mode="min",  # plus the lowest loss so far
        async_save=True, storage_options=storage_options,
    )
    start = 1
    latest = manager.latest_step()                   # 1-2 GETs, no LIST
    if latest is not None:
        materialize_optimizer_state(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
        manager.load(state)                           # the latest step, in place
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])          # param_groups (lr...) from the checkpoint too
        start = state["step"] + 1
    loss = torch.tensor(0.0)
    for step in range(start, total_steps + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % save_every == 0 or step == total_steps:
            # returns once the state is staged; upload, commit, index and retention run in the background
            manager.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                         metadata={"loss": loss.item()})
        if step == stop_at:
            break
    manager.wait()                                   # every save committed (or its error raised)
    out = {"resumed_from": latest, "steps": manager.steps(), "model": model.state_dict()}
    manager.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stop-at", type=int)
    p.add_argument("--endpoint-url")
    a = p.parse_args()
    opts = {"endpoint_url": a.endpoint_url} if a.endpoint_url else None
    out = train(a.root, a.steps, stop_at=a.stop_at, storage_options=opts)
    print(json.dumps({"resumed_from": out["resumed_from"], "steps": out["steps"]}))


if __name__ == "__main__":
    main()
