"""FSDP2 x tensor parallel (torchtitan's 2-D layout): checkpoint with objckpt, resume on any mesh.

Tensor parallel on the "tp" dim of a ("dp", "tp") mesh, then FSDP2 over "dp":
the column-wise weights (and their AdamW moments) become DTensors with
``_StridedShard`` placements.  objckpt saves them as they are (each rank writes
its own shard, no gather) and loads them into any other mesh, each rank reading
only the bytes it needs.

Run (4 processes; gloo on CPU, NCCL works the same on GPUs)::

    torchrun --nproc-per-node 4 examples/integrations/fsdp2_tp.py file:///tmp/fsdp2-tp
    torchrun --nproc-per-node 4 examples/integrations/fsdp2_tp.py s3://bucket/run-1   # credentials from the env

It trains 2 steps on a 2x2 mesh, saves, then restores into a fresh model on a
1x4 mesh and trains on.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import objckpt

IN, HIDDEN = 6, 12


def build(shape: tuple[int, int]) -> tuple[DeviceMesh, torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP: tensor parallel over "tp" first, then FSDP2 over "dp" (torchtitan's order)."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, IN))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, n: int) -> list[float]:
    """``n`` steps from step ``first``; every rank sees the step's global batch."""
    losses = []
    for step in range(first, first + n):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, IN, generator=g), torch.randn(8, IN, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def save(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, uri: str,
         storage_options: Optional[dict[str, Any]] = None) -> None:
    """Every rank calls it; each writes its own shards, rank 0 commits the manifest."""
    model_sd, optim_sd = get_state_dict(model, opt)
    objckpt.save({"model": model_sd, "optim": optim_sd, "step": step}, uri, storage_options=storage_options)


def resume(shape: tuple[int, int], uri: str, storage_options: Optional[dict[str, Any]] = None
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """A fresh model and optimizer on a ``shape`` mesh, restored from ``uri`` (saved on any mesh)."""
    _, model, opt = build(shape)
    model_sd, optim_sd = get_state_dict(model, opt)  # the templates: this mesh's shards, AdamW state included
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": 0}
    objckpt.load(state, uri, storage_options=storage_options)  # fills the templates in place
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt, state["step"]


def main(uri: str, storage_options: Optional[dict[str, Any]] = None) -> list[float]:
    """Train and save on 2x2, resume on 1x4 and train on; returns the resumed losses."""
    _, model, opt = build((2, 2))
    train(model, opt, 0, 2)
    save(model, opt, 2, uri, storage_options)
    model, opt, step = resume((1, 4), uri, storage_options)
    return train(model, opt, step, 2)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses = main(sys.argv[1] if len(sys.argv) > 1 else "file:///tmp/objckpt-fsdp2-tp")
    if dist.get_rank() == 0:
        print("resumed on 1x4, losses:", losses)
    dist.destroy_process_group()
