"""Walking the caller's state: tensors to save, and slots to load into.

Flat keys are the dotted paths of :mod:`objckpt.format.tree`, so a template
state dict and a stored one agree on names.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from .errors import UnsupportedValueError
from .format.dtypes import dtype_name
from .distributed.placements import Shard, is_dtensor
from .format.tree import _child_key, encode_tree, iter_leaves
from .stateful import StatefulValue, expand_for_save


@dataclass
class Collected:
    tree: Any
    tensors: dict[str, Any]  # every tensor leaf (tensor, DTensor, Shard), by key
    alias_of: dict[str, str]  # key -> key of the first tensor with the same storage view


def _check_tensor(key: str, value: Any) -> None:
    if isinstance(value, Shard):
        t = value.local
    elif is_dtensor(value):
        t = value.to_local()
    else:
        t = value
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise UnsupportedValueError(
                f"tensor {key!r} is a {type(t).__module__}.{type(t).__qualname__}; objckpt stores plain tensors, "
                "DTensors and objckpt.Shard"
            )
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"tensor {key!r} has layout {t.layout}; only dense (strided) tensors are stored")
    if t.is_meta:
        raise UnsupportedValueError(f"tensor {key!r} is on the meta device and has no data to save")
    if t.is_quantized:
        raise UnsupportedValueError(f"tensor {key!r} is quantized; dequantize it or store its int repr")
    dtype_name(t.dtype, key)


def _identity(t: Any) -> Optional[tuple]:
    if not isinstance(t, torch.Tensor) or is_dtensor(t):
        return None  # sharded values are never treated as tied
    try:
        ptr = t.untyped_storage().data_ptr()
    except Exception:
        return None
    if t.numel() == 0:
        return None
    return (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def collect(state: Any, *, allow_pickle: bool = False,
            on_new: Optional[Callable[[str, Any], None]] = None) -> Collected:
    """Encode ``state`` and find its tensors; tensors that are the same view of
    the same storage (tied weights) are recorded as aliases and stored once.
    Stateful values (:mod:`objckpt.stateful`) are saved as their ``state_dict()``."""
    state = expand_for_save(state)
    if not isinstance(state, (Mapping, list, tuple)):
        raise UnsupportedValueError(f"state must be a dict (or list/tuple), got {type(state).__name__}")
    tensors: dict[str, Any] = {}
    alias_of: dict[str, str] = {}
    first: dict[tuple, str] = {}

    def on_tensor(key: str, t: Any) -> None:
        _check_tensor(key, t)
        tensors[key] = t
        ident = _identity(t)
        if ident is not None and ident in first:
            alias_of[key] = first[ident]
            return
        if ident is not None:
            first[ident] = key
        if on_new is not None:
            on_new(key, t)

    tree = encode_tree(state, on_tensor, allow_pickle=allow_pickle, is_tensor=is_stored_leaf)
    seen: set[str] = set()
    for key, _ in iter_leaves(tree):
        if key in seen or key == "":
            raise UnsupportedValueError(
                f"two entries flatten to the same key {key!r} (e.g. 1 and '1', or 'a.b' and a/b)"
                if key else "an entry has an empty key; give it a name"
            )
        seen.add(key)
    return Collected(tree, tensors, alias_of)


def is_stored_leaf(x: Any) -> bool:
    """A tensor (DTensor included) or an :class:`objckpt.Shard`: what the state walk stores as bytes."""
    return isinstance(x, (torch.Tensor, Shard))


@dataclass
class Slot:
    """One leaf of a template: its value and where it sits (to replace non-tensors)."""

    key: str
    value: Any
    container: Any
    index: Any


def template_slots(state: Any, stateful: Optional[Mapping[str, StatefulValue]] = None) -> Iterator[Slot]:
    """Leaves of a template, keyed like :func:`objckpt.format.tree.iter_leaves`.

    ``stateful`` (from :func:`objckpt.stateful.find_stateful`): each Stateful value is
    walked as its state dict, whose containers the load then fills; a state dict that
    holds no tensor is one slot whose container is the value's holder."""
    found = stateful or {}

    def resolve(x: Any, key: str, container: Any, index: Any) -> tuple[Any, Any, Any]:
        sv = found.get(key)
        if sv is not None and sv.sits_in(x):
            return sv.state, sv.holder, "state"
        return x, container, index

    def has_tensor(x: Any, key: str) -> bool:
        """Whether the walk must descend into ``x``: it holds a tensor or a Stateful value."""
        if is_stored_leaf(x) or (key in found and found[key].sits_in(x)):
            return True
        if isinstance(x, Mapping):
            return any(has_tensor(v, _child_key(key, k)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return any(has_tensor(v, _child_key(key, i)) for i, v in enumerate(x))
        return False

    def walk(x: Any, key: str, container: Any, index: Any) -> Iterator[Slot]:
        x, container, index = resolve(x, key, container, index)
        if key and not has_tensor(x, key):
            yield Slot(key, x, container, index)
        elif is_stored_leaf(x):
            yield Slot(key, x, container, index)
        elif isinstance(x, Mapping):
            for k, v in x.items():
                yield from walk(v, _child_key(key, k), x, k)
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, v in enumerate(x):
                yield from walk(v, _child_key(key, i), x, i)
        else:
            yield Slot(key, x, container, index)

    yield from walk(state, "", None, None)
