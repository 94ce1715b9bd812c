"""The state the tier's multi-rank tests save and restore: each rank's rows of one
``(ROWS, COLS)`` tensor (an :class:`objckpt.Shard`, unaligned row bytes), a replicated
plain tensor and the step, every value a function of the step (a restore is checked
bit-exact against the step it claims)."""
from __future__ import annotations

import math
from typing import Any

import torch

import objckpt

ROWS, COLS = 6, 1001  # unaligned row bytes


def state(rank: int, world: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s rows of a ``(ROWS, COLS)`` tensor and a replicated one, values per step."""
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step
    per = math.ceil(ROWS / world)
    lo, hi = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    return {"w": objckpt.Shard(full[lo:hi].clone(), (ROWS, COLS), (lo, 0)),
            "b": torch.arange(37, dtype=torch.float64) + step, "step": step}


def zeros(rank: int, world: int) -> dict[str, Any]:
    """A template of :func:`state`'s shape whose values no step has."""
    st = state(rank, world, 0)
    st["w"].local.zero_()
    st["b"].zero_()
    st["step"] = -1
    return st


def equal(st: dict[str, Any], rank: int, world: int, step: int) -> bool:
    """Whether ``st`` holds exactly step ``step``'s values for this rank."""
    want = state(rank, world, step)
    return (torch.equal(st["w"].local, want["w"].local) and torch.equal(st["b"], want["b"])
            and st["step"] == step)
