"""A deterministic GPT-like fp32 state dict for benchmarks.

At ``scale=1`` the state is ~1.03 GiB in 195 tensors: a ~180 MiB token
embedding, 12 layers of 16 tensors (q/k/v/o projections of ~3 MiB each, a fused
gate+up MLP weight of ~40 MiB and a down projection of ~20 MiB, plus tiny
layer norms and biases) and a final layer norm.  ``scale`` shrinks every big
tensor by about the same factor (all model dimensions by ``sqrt(scale)``) and
keeps the tensor count, so ``scale=0.05`` gives ~53 MiB for quick runs.

Every tensor is generated from its own seed (``seed`` and its index), so any
single tensor can be rebuilt without the rest: see :func:`make_tensor`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

GiB = 1 << 30
MiB = 1 << 20

#: Size of the full (scale 1) state in bytes.
FULL_BYTES = int(1.03 * GiB)

_N_LAYERS = 12
_BASE_D = 896  # model width at scale 1: the (d, d) projections are 3.06 MiB
_BASE_VOCAB = 52_672  # 52672 * 896 * 4 B = 180 MiB


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and kind of one tensor in the state."""

    key: str
    shape: tuple[int, ...]
    kind: str  # "weight" (randn * 0.02), "norm" (around 1) or "bias" (around 0)
    index: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4


def _round(x: float, mult: int) -> int:
    return max(mult, int(round(x / mult)) * mult)


def gpt_specs(total_bytes: int = FULL_BYTES) -> list[TensorSpec]:
    """Shapes of the ~195 tensors, sized so they add up to about ``total_bytes``."""
    f = math.sqrt(total_bytes / FULL_BYTES)
    d = _round(_BASE_D * f, 8)
    vocab = _round(_BASE_VOCAB * f, 64)
    # Solve for the MLP width h that makes the total come out right:
    # total = 4*(vocab*d + L*(4*d*d + h*(3*d + 2))) + small terms.
    small = 4 * (2 * d + _N_LAYERS * 9 * d)  # norms and d-sized biases
    rest = total_bytes - 4 * vocab * d - 4 * _N_LAYERS * 4 * d * d - small
    h = _round(max(rest, 0) / (4 * _N_LAYERS * (3 * d + 2)), 8)

    out: list[tuple[str, tuple[int, ...], str]] = [("transformer.wte.weight", (vocab, d), "weight")]
    for i in range(_N_LAYERS):
        p = f"transformer.h.{i}."
        out += [
            (p + "ln_1.weight", (d,), "norm"),
            (p + "ln_1.bias", (d,), "bias"),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out += [
                (p + f"attn.{proj}.weight", (d, d), "weight"),
                (p + f"attn.{proj}.bias", (d,), "bias"),
            ]
        out += [
            (p + "ln_2.weight", (d,), "norm"),
            (p + "ln_2.bias", (d,), "bias"),
            (p + "mlp.gate_up.weight", (2 * h, d), "weight"),
            (p + "mlp.gate_up.bias", (2 * h,), "bias"),
            (p + "mlp.down.weight", (d, h), "weight"),
            (p + "mlp.down.bias", (d,), "bias"),
        ]
    out += [("transformer.ln_f.weight", (d,), "norm"), ("transformer.ln_f.bias", (d,), "bias")]
    return [TensorSpec(k, s, kind, i) for i, (k, s, kind) in enumerate(out)]


def partial_read_key(total_bytes: int = FULL_BYTES) -> str:
    """The one tensor the "read one tensor" benchmark fetches (~3 MiB at scale 1)."""
    return f"transformer.h.{_N_LAYERS // 2}.attn.o_proj.weight"


def make_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Deterministically generate one tensor from ``seed`` and its index."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + spec.index)
    t = torch.randn(spec.shape, generator=g, dtype=torch.float32)
    if spec.kind == "weight":
        t.mul_(0.02)
    elif spec.kind == "norm":
        t.mul_(0.01).add_(1.0)
    else:
        t.mul_(0.01)
    return t


def iter_gpt_state(total_bytes: int = FULL_BYTES, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` one at a time (keeps peak memory to one tensor)."""
    for spec in gpt_specs(total_bytes):
        yield spec.key, make_tensor(spec, seed)


def make_gpt_state(total_bytes: int = FULL_BYTES, seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole state dict (~``total_bytes`` of fp32 tensors)."""
    return dict(iter_gpt_state(total_bytes, seed))


def scaled_bytes(scale: float) -> int:
    """State size for a ``--scale`` value."""
    return int(FULL_BYTES * scale)
