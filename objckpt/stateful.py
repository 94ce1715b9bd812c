"""Stateful values: objects saved and loaded through their own ``state_dict()``.

Any value in the state with callable ``state_dict()`` and ``load_state_dict()``
(``nn.Module``, ``Optimizer``, ``LRScheduler``, ``GradScaler``, a user's object)
stands for its state dict, so ``save({"model": model, "optim": opt}, uri)``
stores exactly the keys ``save({"model": model.state_dict(), "optim":
opt.state_dict()}, uri)`` would.  On load objckpt takes the object's current
``state_dict()`` as the template, fills it, and hands it back to
``load_state_dict()`` (as torch.distributed.checkpoint does): values that are
only copied out by ``state_dict()`` (an optimizer's ``param_groups``, a
scheduler's counters) are restored that way.

The user's own containers are never copied on load: the walk of the template
substitutes each object's state dict where the object sits, so plain values
beside it (``"step": 5``) are still replaced in the caller's dict.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import UnsupportedValueError

#: deepest nesting walked while looking for Stateful values (encode_tree refuses deeper state anyway)
_MAX_DEPTH = 200


def is_stateful(x: Any) -> bool:
    """Whether ``x`` is saved through ``state_dict()`` / loaded through ``load_state_dict()``."""
    if isinstance(x, (torch.Tensor, Mapping, list, tuple, str, bytes, type)):
        return False
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


def state_of(key: str, obj: Any) -> Any:
    """``obj.state_dict()``, or an UnsupportedValueError naming ``key`` when it fails or is not a container."""
    try:
        sd = obj.state_dict()
    except Exception as e:  # a user's object: any failure is theirs, named
        raise UnsupportedValueError(
            f"value at key {key or '<root>'!r} ({type(obj).__qualname__}) is Stateful but its state_dict() "
            f"raised {type(e).__name__}: {e}") from e
    if not isinstance(sd, (Mapping, list, tuple)):
        raise UnsupportedValueError(
            f"value at key {key or '<root>'!r} ({type(obj).__qualname__}): state_dict() returned a "
            f"{type(sd).__name__}, not a dict")
    return sd


def _child(prefix: str, k: Any) -> str:
    return f"{prefix}.{k}" if prefix else str(k)


def expand_for_save(state: Any) -> Any:
    """``state`` with every Stateful value replaced by its ``state_dict()`` (recursively).

    Containers on the way to a Stateful value are copied; the others (and every
    tensor) are passed on as they are, so tied tensors and version counters stay
    the caller's."""

    def walk(x: Any, key: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            return x  # encode_tree refuses it, naming the key
        if is_stateful(x):
            return walk(state_of(key, x), key, depth + 1)
        if isinstance(x, Mapping):
            out = {k: walk(v, _child(key, k), depth + 1) for k, v in x.items()}
            return x if all(out[k] is v for k, v in x.items()) else out
        if isinstance(x, list):
            new = [walk(v, _child(key, i), depth + 1) for i, v in enumerate(x)]
            return x if all(a is b for a, b in zip(new, x)) else new
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            tup = tuple(walk(v, _child(key, i), depth + 1) for i, v in enumerate(x))
            return x if all(a is b for a, b in zip(tup, x)) else tup
        return x

    return walk(state, "", 0)


@dataclass
class StatefulValue:
    """One Stateful value of a load template: where it sits, the object, and the
    state dict taken from it (``holder["state"]``: a load may replace it whole
    when it holds no tensor)."""

    key: str
    obj: Any
    holder: dict[str, Any] = field(default_factory=dict)

    @property
    def state(self) -> Any:
        return self.holder["state"]


def find_stateful(template: Any) -> dict[str, StatefulValue]:
    """Every Stateful value of ``template`` by key, its ``state_dict()`` taken once.

    Inner ones (a Stateful inside another's state dict) come before the outer
    one, the order their ``load_state_dict()`` must run in."""
    found: dict[str, StatefulValue] = {}

    def walk(x: Any, key: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            return
        if is_stateful(x):
            sv = StatefulValue(key, x, {"state": state_of(key, x)})
            walk(sv.state, key, depth + 1)
            found[key] = sv
            return
        if isinstance(x, Mapping):
            for k, v in x.items():
                walk(v, _child(key, k), depth + 1)
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, v in enumerate(x):
                walk(v, _child(key, i), depth + 1)

    walk(template, "", 0)
    return found
