"""FSDP2 (``fully_shard``) training state saved with objckpt and resumed at another world size.

    python examples/integrations/fsdp2.py s3://my-bucket/runs/fsdp2      # or a local directory

Trains a small model with FSDP2 on 2 CPU ranks (gloo), saves the model and
optimizer as Stateful objects (each rank writes only its shards), trains on
(the reference), then restores into freshly built models and optimizers at
world size 2 (same layout: the next losses are equal bit for bit) and 3
(resharded: the state is equal bit for bit, the losses equal up to the order
of floating-point reductions).  With FSDP2 the model's and the optimizer's
``state_dict()`` hold DTensors with the usual parameter names, so nothing
FSDP-specific is needed: pass the module and the optimizer themselves.
S3 endpoint and credentials come from the AWS environment (``AWS_ENDPOINT_URL``...).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import objckpt

GLOBAL_BATCH = 6  # divisible by every world size used here: each rank gets an equal share


def build(mesh: Any, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2-sharded over ``mesh``; a plain module when ``mesh`` is None) and its optimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (the same global batch at any world size)."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, steps: int, rank: int,
          world: int) -> list[float]:
    """``steps`` steps from step ``first``; the global mean loss of each."""
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def save_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, uri: str,
               storage_options: Optional[dict] = None) -> None:
    """Every rank calls it: each writes its own shards, rank 0 commits."""
    objckpt.save({"model": model, "optim": opt, "step": step}, uri, storage_options=storage_options,
                 overwrite=True)


def load_state(model: torch.nn.Module, opt: torch.optim.Optimizer, uri: str,
               storage_options: Optional[dict] = None) -> int:
    """Every rank calls it; a fresh optimizer's state is created from the checkpoint. The step to go on from."""
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    objckpt.load(state, uri, storage_options=storage_options, no_dist=not dist.is_initialized())
    return int(state["step"])


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors, whole (a collective under FSDP2: every rank calls it)."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    out = {f"model.{k}": whole(v) for k, v in model.state_dict().items()}
    for pid, entry in opt.state_dict()["state"].items():
        out.update({f"optim.state.{pid}.{k}": whole(v) for k, v in entry.items()})
    return out


def resume_job(rank: int, world: int, mesh: Any, uri: str, storage_options: Optional[dict],
               train_first: bool) -> dict[str, Any]:
    """One rank: (``train_first``) train 3 steps, save, train 3 more: the reference; then restore
    into fresh objects and train 3 steps."""
    out: dict[str, Any] = {}
    if train_first:
        model, opt = build(mesh, seed=0)
        train(model, opt, 0, 3, rank, world)
        save_state(model, opt, 3, uri, storage_options)
        out["reference"] = train(model, opt, 3, 3, rank, world)
    model, opt = build(mesh, seed=rank + 1)  # other weights, empty optimizer state
    step = load_state(model, opt, uri, storage_options)
    restored = full_state(model, opt)
    out["resumed"] = train(model, opt, step, 3, rank, world)
    if rank == 0:  # as numpy arrays: tensors would cross the queue through shared memory
        out["restored"] = {k: v.numpy() for k, v in restored.items()}
    return out


def rank_main(rank: int, world: int, store_file: str, queue: Any, job: Callable[..., Any], args: tuple) -> None:
    """One rank's process: join the gloo group, build the 1-D mesh, run ``job(rank, world, mesh, *args)``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        queue.put((rank, job(rank, world, init_device_mesh("cpu", (world,)), *args)))
    except BaseException as e:
        queue.put((rank, e))
        raise
    finally:
        dist.destroy_process_group()


def spawn(world: int, job: Callable[..., Any], *args: Any) -> Any:
    """Run ``job`` on ``world`` CPU ranks; rank 0's result."""
    # forkserver: the ranks fork from one process that imported torch once, not 5 fresh interpreters
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp", "torch.distributed.device_mesh", "objckpt"])
    # a file rendezvous: no port to pick, so none to lose to another process in between
    with tempfile.NamedTemporaryFile(prefix="fsdp2-rdzv-", delete=False) as f:  # empty: a fresh store
        store_file = f.name
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, store_file, queue, job, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            rank, value = queue.get(timeout=300)
            if isinstance(value, BaseException):  # the others would wait for it: stop them
                raise RuntimeError(f"rank {rank} failed: {value!r}") from value
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 1)
            if p.is_alive():
                p.kill()
        if os.path.exists(store_file):
            os.unlink(store_file)
    return results[0]


def main(uri: str, storage_options: Optional[dict] = None) -> dict[str, Any]:
    """Train at world 2 and save; resume at world 2 and at world 3."""
    two = spawn(2, resume_job, uri, storage_options, True)
    three = spawn(3, resume_job, uri, storage_options, False)
    return {"reference": two["reference"], "world2": two["resumed"], "world3": three["resumed"],
            "restored2": _tensors(two["restored"]), "restored3": _tensors(three["restored"])}


def _tensors(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} URI")
    res = main(sys.argv[1])
    print(json.dumps({k: res[k] for k in ("reference", "world2", "world3")}, indent=1))
    assert res["world2"] == res["reference"], "same layout: bit for bit"
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res["world3"], res["reference"]))
