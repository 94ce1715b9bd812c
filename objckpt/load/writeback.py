"""The hand-back to Stateful values, and its check: did the loaded tensors reach the object?

:func:`hand_back` calls each Stateful value's ``load_state_dict()`` with its filled
state dict (:mod:`objckpt.state`), then runs the check below.

A load fills the tensors of each object's ``state_dict()`` in place.  For most
objects those tensors *are* the object's state (an ``nn.Module``'s parameters and
buffers, detached views of them), so the fill alone restores it, and the
``load_state_dict()`` call that follows copies each tensor onto itself.  But a
state-dict hook may hand out *fresh* tensors: torchtitan's models split a fused
q/k/v weight into three, quantized or wrapped modules convert their weights.
Filling those fills copies; only ``load_state_dict()`` can carry the values back,
through a matching load hook.  When it does not, the object keeps its old (often
freshly initialised) values and training resumes from wrong weights without a word.

So, after the hand-back, each object's ``state_dict()`` is taken once more and
its tensors compared, bit for bit, with the tensors the load filled.  A tensor
that still *is* the filled one (same storage, shape and strides: the common case,
parameters and buffers) costs nothing.  A fresh one is compared after converting
the loaded value to its dtype and device, as ``Optimizer.load_state_dict`` does.
Tensors that cannot be compared without a collective (DTensors of different
placements) or that changed shape are skipped: the check reports only what it
can prove.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import StateDictMismatchError
from ..format.tree import _child_key
from ..state import StatefulValue, is_stateful

#: how many keys an error names before it counts the rest
_NAMED = 12

#: same-width integer dtypes, to compare floating tensors bit for bit (NaN == NaN, -0.0 != 0.0)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class NotWrittenBack:
    """What the check found for one Stateful value: the keys whose loaded values did not reach it."""

    key: str
    cls: str
    keys: list[str]


def tensor_leaves(sd: Any, key: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every tensor of a state dict, keyed as the checkpoint keys them.
    A Stateful value nested inside is skipped: it is checked on its own."""
    if depth > 200 or is_stateful(sd):
        return
    if isinstance(sd, torch.Tensor):
        yield key, sd
    elif isinstance(sd, Mapping):
        for k, v in sd.items():
            yield from tensor_leaves(v, _child_key(key, k), depth + 1)
    elif isinstance(sd, (list, tuple)) and not hasattr(sd, "_fields"):
        for i, v in enumerate(sd):
            yield from tensor_leaves(v, _child_key(key, i), depth + 1)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The tensor's local part, and the placements it is one part of (None for a plain tensor)."""
    if hasattr(t, "to_local") and hasattr(t, "placements"):
        return t.to_local(), (tuple(t.placements), t.device_mesh)  # type: ignore[attr-defined]
    return t, None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and tuple(a.shape) == tuple(b.shape) and tuple(a.stride()) == tuple(b.stride()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() and t.element_size() in _BITS:
        return t.view(_BITS[t.element_size()])
    return t


def holds(current: torch.Tensor, loaded: torch.Tensor) -> bool:
    """Whether ``current`` (from the object's state dict after the hand-back) holds the
    ``loaded`` values; True when the two cannot be compared locally."""
    if current is loaded:
        return True
    cur, cur_place = _local(current)
    ld, ld_place = _local(loaded)
    if (cur_place is None) != (ld_place is None) or (cur_place is not None and cur_place != ld_place):
        return True  # other placements: comparing would need a collective
    if cur.is_meta or ld.is_meta or tuple(cur.shape) != tuple(ld.shape) or cur.is_sparse or ld.is_sparse:
        return True
    if _same_view(cur, ld):
        return True
    with torch.no_grad():
        if ld.dtype != cur.dtype or ld.device != cur.device:
            ld = ld.to(dtype=cur.dtype, device=cur.device)
        try:
            return bool(torch.equal(_bits(cur), _bits(ld)))
        except (RuntimeError, TypeError):  # a tensor subclass without equal(): nothing to prove
            return True


def snapshot(sv: StatefulValue) -> dict[str, torch.Tensor]:
    """The tensors the load filled for ``sv``, taken before its ``load_state_dict()``
    (which may pop or replace entries of the dict it is given)."""
    return dict(tensor_leaves(sv.state, sv.key))


def find_not_written_back(sv: StatefulValue, loaded: Mapping[str, torch.Tensor]) -> NotWrittenBack | None:
    """Compare the object's ``state_dict()`` now with ``loaded``; the keys that differ, or None."""
    if not loaded:
        return None
    try:
        now = sv.obj.state_dict()
    except Exception:  # its state_dict() worked a moment ago; a failure now is not ours to report
        return None
    bad = [k for k, cur in tensor_leaves(now, sv.key) if k in loaded and not holds(cur, loaded[k])]
    return NotWrittenBack(sv.key, type(sv.obj).__qualname__, bad) if bad else None


def raise_not_written_back(found: NotWrittenBack, uri: str) -> None:
    """The error for :func:`find_not_written_back`'s finding, naming the keys and the way out."""
    named = ", ".join(repr(k) for k in found.keys[:_NAMED])
    more = f" and {len(found.keys) - _NAMED} more" if len(found.keys) > _NAMED else ""
    raise StateDictMismatchError(
        f"cannot load {uri!r}: after {found.cls}.load_state_dict() at key {found.key or '<root>'!r}, its "
        f"state_dict() still does not hold the loaded values of {len(found.keys)} tensor(s): {named}{more}. "
        "Its state_dict() hands out fresh tensors (a state-dict hook, e.g. one that splits a fused weight), "
        "the load filled those, and load_state_dict() did not carry them back to the object, which keeps "
        "its old values. Give the object a load_state_dict() (or a load_state_dict pre-hook) that applies "
        "the state dict it is given. If it changes the values on purpose (e.g. it quantizes them), load "
        "sd = obj.state_dict() as a plain dict and call obj.load_state_dict(sd) yourself")


def check_written_back(sv: StatefulValue, loaded: Mapping[str, torch.Tensor], uri: str) -> None:
    """Raise a :class:`StateDictMismatchError` naming the keys when ``sv``'s object does
    not hold what the load gave it (see the module docstring)."""
    found = find_not_written_back(sv, loaded)
    if found is not None:
        raise_not_written_back(found, uri)


def hand_back(stateful: Mapping[str, StatefulValue], uri: str) -> None:
    """Call each Stateful value's ``load_state_dict()`` with its filled state dict, then check
    that each object now holds the loaded tensors (this module's docstring)."""
    loaded = {key: snapshot(sv) for key, sv in stateful.items()}
    for sv in stateful.values():
        try:
            sv.obj.load_state_dict(sv.state)
        except Exception as e:  # the object's own check: named, typed, chained
            raise StateDictMismatchError(
                f"cannot load {uri!r}: {type(sv.obj).__qualname__}.load_state_dict() at key "
                f"{sv.key or '<root>'!r} refused the checkpoint's state ({type(e).__name__}: {e}); "
                "its tensors are filled, its other state may be unchanged") from e
    for key, sv in stateful.items():
        check_written_back(sv, loaded[key], uri)
