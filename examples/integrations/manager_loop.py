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


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(root: str, total_steps: int, *, save_every: int = 2, stop_at: Optional[int] = None,
          storage_options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train steps 1..total_steps, resuming from the latest checkpoint under ``root``."""
    model, opt = make_model()
    # Stateful values: objckpt calls state_dict() on save and load_state_dict() on load, and
    # creates the optimizer's per-parameter state a fresh AdamW does not have yet
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    manager = objckpt.CheckpointManager(
        root, keep_last=2, keep_every=10,            # the 2 newest, plus every 10th step
        keep_best=1, best_key="loss", best_mode="min",  # plus the lowest loss so far
        save_every=save_every,                       # save() skips the steps in between
        async_save=True, storage_options=storage_options,
    )
    latest = manager.latest_step()                   # 1-2 GETs and a HEAD, no LIST
    if latest is not None:
        manager.load(state)                           # the latest step: model, optimizer and state["step"]
    loss = torch.tensor(0.0)
    for step in range(state["step"] + 1, total_steps + 1):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        state["step"] = step
        # every save_every steps (manager.should_save(step) says which), and the last step (force=True);
        # returns once the state is staged; upload, commit, index and retention run in the background
        manager.save(step, state, metadata={"loss": loss.item()}, force=step == total_steps)
        if step == stop_at:
            break
    manager.wait()                                   # every save committed (or its error raised)
    out = {"resumed_from": latest, "steps": manager.steps(), "best": manager.best_step(),
           "model": {k: v.clone() for k, v in model.state_dict().items()}}
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
