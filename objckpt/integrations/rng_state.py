"""A process's random number generators as plain values, for a checkpoint.

Training loops that resume bit for bit (the Hugging Face Trainer's dropout, its
shuffling, a user's augmentation) need every generator back as it was: Python's
``random``, numpy's global generator, torch's CPU generator and, where present,
the CUDA generators.  Their states differ from rank to rank, so they are kept
as *non-tensor* values (``bytes``, ints, tuples): objckpt stores non-tensor
values per rank when ranks differ (the manifest's ``rank_trees``) and a load in
a process group gives each rank its own back, where per-rank plain tensors would
be refused as replicas that disagree.

The layout follows what ``transformers.Trainer`` writes to ``rng_state.pth``
(``python``, ``numpy``, ``cpu``, ``cuda``), with numpy's array and torch's byte
tensors turned into ``bytes``.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..errors import StateDictMismatchError


def _torch_bytes(state: torch.Tensor) -> bytes:
    return bytes(state.contiguous().numpy().tobytes())


def _torch_state(b: Any, where: str) -> torch.Tensor:
    if not isinstance(b, (bytes, bytearray)):
        raise StateDictMismatchError(f"{where}: a torch generator state must be bytes, got {type(b).__name__}")
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()


def capture_rng(all_cuda_devices: bool = False) -> dict[str, Any]:
    """Every generator's state as plain values.  ``all_cuda_devices``: every visible
    device's CUDA generator (as the Trainer does in a distributed run), else the
    current device's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": bytes(np.ascontiguousarray(keys).tobytes()), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "cpu": _torch_bytes(torch.random.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if all_cuda_devices:
            out["cuda"] = [_torch_bytes(s) for s in torch.cuda.get_rng_state_all()]
        else:
            out["cuda"] = _torch_bytes(torch.cuda.get_rng_state())
    return out


def restore_rng(state: Any, where: str = "rng") -> None:
    """Set every generator from :func:`capture_rng`'s values (a CUDA state is restored
    only where CUDA is available; a missing one is left as it is)."""
    if not isinstance(state, dict) or not {"python", "numpy", "cpu"} <= set(state):
        shown = f" with keys {sorted(state)!r}" if isinstance(state, dict) else ""
        raise StateDictMismatchError(
            f"{where}: not a generator state saved by objckpt (expected a dict with 'python', 'numpy' and "
            f"'cpu', got {type(state).__name__}{shown})")
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    n = state["numpy"]
    keys = np.frombuffer(n["keys"], dtype=np.uint32).copy()
    np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))
    torch.random.set_rng_state(_torch_state(state["cpu"], f"{where}.cpu"))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, list):
            states = [_torch_state(b, f"{where}.cuda") for b in cuda]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
            else:  # another node shape: this process's device gets what its index had, as far as it goes
                i = torch.cuda.current_device()
                torch.cuda.set_rng_state(states[min(i, len(states) - 1)])
        else:
            torch.cuda.set_rng_state(_torch_state(cuda, f"{where}.cuda"))
