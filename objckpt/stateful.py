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

Torch's own wrappers whose ``state_dict()`` puts a prefix before every key
(``torch.compile``'s ``OptimizedModule``: ``_orig_mod.``; ``DistributedDataParallel``
and ``DataParallel``: ``module.``; activation checkpointing's wrapper) stand for the
module they wrap, on save and on load: a compiled or DDP model saves the keys the
plain model has, and loads what the plain model saved.  (FSDP1 is not unwrapped:
its ``state_dict()`` already leaves its own prefixes out and must run its hooks.)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sys

import torch

from .errors import UnsupportedValueError
from .logs import get_logger

log = get_logger("objckpt.stateful")

#: deepest nesting walked while looking for Stateful values (encode_tree refuses deeper state anyway)
_MAX_DEPTH = 200


def is_stateful(x: Any) -> bool:
    """Whether ``x`` is saved through ``state_dict()`` / loaded through ``load_state_dict()``."""
    if isinstance(x, (torch.Tensor, Mapping, list, tuple, str, bytes, type)):
        return False
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


#: torch's wrappers that stand for the module they hold: (module of the class, class, attribute
#: holding the wrapped module, the key component its state_dict() adds or None, what adds it)
_WRAPPERS: tuple[tuple[str, str, str, str], ...] = (
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod", "torch.compile"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module", "DistributedDataParallel"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module", "DataParallel"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper",
     "_checkpoint_wrapped_module", "activation checkpointing"),
)

#: the key components torch's wrappers add before a module's keys, and who adds each
#: (``_fsdp_wrapped_module``: FSDP1 keys taken without its state-dict hooks, e.g. from named_parameters())
WRAPPER_COMPONENTS: dict[str, str] = {
    "_orig_mod": "torch.compile",
    "module": "DistributedDataParallel / DataParallel",
    "_fsdp_wrapped_module": "FSDP1",
    "_checkpoint_wrapped_module": "activation checkpointing",
}


def unwrap(x: Any) -> tuple[Any, list[str]]:
    """The module inside torch's prefix-adding wrappers around ``x`` (``x`` itself when there
    are none), and what wrapped it, outermost first (``["torch.compile", "DistributedDataParallel"]``).

    A wrapper class is only looked for when its module is imported (no instance can exist
    otherwise), so this never imports torch._dynamo or torch.distributed."""
    found: list[str] = []
    for _ in range(8):
        for mod, cls, attr, what in _WRAPPERS:
            kind = getattr(sys.modules.get(mod), cls, None)
            if isinstance(kind, type) and isinstance(x, kind):
                inner = getattr(x, attr, None)
                if inner is None or not is_stateful(inner):
                    return x, found
                found.append(what)
                x = inner
                break
        else:
            return x, found
    return x, found


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
            inner, wrappers = unwrap(x)
            if wrappers:
                log.debug("saving %r (%s) as the state of the module it wraps: keys without the wrapper's "
                          "prefix", key or "<root>", " around ".join(wrappers))
            return walk(state_of(key, inner), key, depth + 1)
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
    when it holds no tensor).  ``obj`` is the module inside torch's wrappers
    (:func:`unwrap`); ``given`` is what the template holds (the wrapper, or ``obj``)."""

    key: str
    obj: Any
    holder: dict[str, Any] = field(default_factory=dict)
    given: Any = None

    @property
    def state(self) -> Any:
        return self.holder["state"]

    def sits_in(self, x: Any) -> bool:
        """Whether ``x`` (a value of the template) is this Stateful value."""
        return x is self.obj or (self.given is not None and x is self.given)


def find_stateful(template: Any) -> dict[str, StatefulValue]:
    """Every Stateful value of ``template`` by key, its ``state_dict()`` taken once.

    Inner ones (a Stateful inside another's state dict) come before the outer
    one, the order their ``load_state_dict()`` must run in."""
    found: dict[str, StatefulValue] = {}

    def walk(x: Any, key: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            return
        if is_stateful(x):
            inner, wrappers = unwrap(x)
            if wrappers:
                log.info("loading %r (%s) through the module it wraps: keys without the wrapper's prefix",
                         key or "<root>", " around ".join(wrappers))
            sv = StatefulValue(key, inner, {"state": state_of(key, inner)}, x)
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
