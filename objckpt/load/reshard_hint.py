"""What to say when a plain template tensor has the shape of one rank's part of the stored tensor.

Why: a plain tensor in a template is loaded **whole** (its shape is the global shape).
A job that built its template from each rank's local shard (``dtensor.to_local()``, a
slice it cut itself) and restarts at another world size, or on one process to inspect
it, meets a bare "state dict has [4, 4], checkpoint has [8, 4]" and no way forward.
What reshards is a template that says its global shape: the full-shape tensor (one
process reads every rank's part into it), a DTensor, or an :class:`objckpt.Shard`
giving its global shape and offsets.  :func:`rank_local_hint` says so, with both
shapes and both world sizes, when the shapes fit that story: the template's is the
stored one divided by a whole factor along the dims that differ, and the stored tensor
was split among ranks, or this load runs at another world size than the save did (a
resized model at the same world size keeps the plain shape message).
"""
from __future__ import annotations

import math
from typing import Any, Optional

from ..distributed.placements import Shard, is_dtensor
from ..format.manifest import Manifest, TensorEntry


def _stored_split(e: TensorEntry) -> bool:
    """Whether the stored tensor was split among ranks (sharded placements, or several chunks)."""
    if e.layout is not None and any(p.startswith("S") for p in e.layout.placements):
        return True
    return len(e.chunks) > 1


def _factor(part: tuple[int, ...], stored: tuple[int, ...]) -> Optional[tuple[int, list[int]]]:
    """(how many parts of ``part``'s shape make ``stored``, the dims that differ), or None when
    ``part`` is not a whole fraction of ``stored`` along those dims."""
    if len(part) != len(stored) or part == stored:
        return None
    dims = [d for d, (a, b) in enumerate(zip(part, stored)) if a != b]
    if any(part[d] <= 0 or part[d] > stored[d] or stored[d] % part[d] for d in dims):
        return None
    return math.prod(stored[d] // part[d] for d in dims), dims


def rank_local_hint(key: str, value: Any, part_shape: tuple[int, ...], e: TensorEntry, m: Manifest,
                    world_size: Optional[int]) -> str:
    """A sentence for the shape mismatch of template tensor ``key`` (plain ``value`` of
    ``part_shape``) against stored entry ``e``: "" unless it looks like one rank's part."""
    if isinstance(value, Shard) or is_dtensor(value):
        return ""
    got = _factor(tuple(part_shape), tuple(e.shape))
    if got is None:
        return ""
    k, dims = got
    moved = world_size is not None and world_size != m.world_size
    if not (_stored_split(e) or moved):
        return ""
    if not any(w > 1 and w % k == 0 for w in (m.world_size, world_size or 0)):
        return ""
    now = f", loading on {world_size}" if world_size is not None else ""
    along = f"dim {dims[0]}" if len(dims) == 1 else f"dims {dims}"
    return (f". If the state dict's tensor is one rank's part of it ({k} such parts along {along} make the "
            f"stored global shape {list(e.shape)}; saved by {m.world_size} rank(s){now}): a plain tensor is "
            f"loaded whole, so a rank-local one does not reshard. Give the template the global shape "
            f"{list(e.shape)} (the whole tensor is read into it), or a DTensor, or an objckpt.Shard(local, "
            f"global_shape={tuple(e.shape)}, global_offsets=...) saying which part this rank holds: those load "
            "at any world size")
