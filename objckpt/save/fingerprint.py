"""Cheap fingerprints of plain tensors, to find ones that differ between ranks.

A plain tensor (not a DTensor, not an :class:`objckpt.Shard`) counts as
replicated: one copy is stored, its rows written by several ranks.  When the
ranks hold different values under the same key (``torch.get_rng_state()``, a
per-rank counter) that would silently store a mix.  Every rank fingerprints
its plain tensors and the save's first exchange compares them:

* up to :data:`WHOLE_BYTES` (64 KiB): crc32c of all the bytes;
* larger: crc32c of :data:`SAMPLES` fixed, evenly strided 4 KiB windows
  (the first and the last included) plus the size.  A difference outside
  the windows goes unnoticed: a cheap check, not a proof.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

import torch

from ..checksum import crc32c

WHOLE_BYTES = 64 << 10
WINDOW = 4 << 10
SAMPLES = 8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


def fingerprint(t: torch.Tensor) -> int:
    """crc32c of the tensor's bytes, or of fixed samples of them when large;
    -1 (the same on every rank: not compared) for a tensor whose bytes cannot
    be viewed (the save itself reports such a tensor, if it cannot store it)."""
    try:
        return _fingerprint(t)
    except (RuntimeError, TypeError, ValueError):
        return -1


def _fingerprint(t: torch.Tensor) -> int:
    b = _bytes(t)
    n = b.numel()
    if n > WHOLE_BYTES:
        step = (n - WINDOW) // (SAMPLES - 1)
        b = torch.cat([b[i * step : i * step + WINDOW] for i in range(SAMPLES - 1)] + [b[n - WINDOW :]])
    data = b.cpu().numpy().tobytes()
    return crc32c(n.to_bytes(8, "little")) ^ crc32c(data) if n > WHOLE_BYTES else crc32c(data)


def digest(prints: dict[str, int]) -> bytes:
    """One short digest of every fingerprint (equal on all ranks when nothing differs)."""
    return hashlib.blake2b(repr(sorted(prints.items())).encode(), digest_size=16).digest()


def differing(everyone: Iterable[dict[str, int]]) -> list[str]:
    """The keys whose fingerprint is not the same on every rank that has them."""
    seen: dict[str, set[int]] = {}
    for prints in everyone:
        for k, v in prints.items():
            seen.setdefault(k, set()).add(v)
    return sorted(k for k, vs in seen.items() if len(vs) > 1)
