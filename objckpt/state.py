"""The caller's state: walking it, the Stateful objects in it, and the optimizer entries a load creates.

**Walking the state.**  Flat keys are the dotted paths of :mod:`objckpt.format.tree`,
so a template state dict and a stored one agree on names: :func:`collect` finds the
tensors to save (tied ones once), :func:`template_slots` the slots a load fills.

**Stateful values.**  Any value in the state with callable ``state_dict()`` and
``load_state_dict()`` (``nn.Module``, ``Optimizer``, ``LRScheduler``, ``GradScaler``,
a user's object) stands for its state dict, so ``save({"model": model, "optim": opt},
uri)`` stores exactly the keys ``save({"model": model.state_dict(), "optim":
opt.state_dict()}, uri)`` would.  On load objckpt takes the object's current
``state_dict()`` as the template, fills it, and hands it back to ``load_state_dict()``
(as torch.distributed.checkpoint does): values that are only copied out by
``state_dict()`` (an optimizer's ``param_groups``, a scheduler's counters) are
restored that way.  The user's own containers are never copied on load: the walk of
the template substitutes each object's state dict where the object sits, so plain
values beside it (``"step": 5``) are still replaced in the caller's dict.

Torch's own wrappers whose ``state_dict()`` puts a prefix before every key
(``torch.compile``'s ``OptimizedModule``: ``_orig_mod.``; ``DistributedDataParallel``
and ``DataParallel``: ``module.``; activation checkpointing's wrapper) stand for the
module they wrap, on save and on load: a compiled or DDP model saves the keys the
plain model has, and loads what the plain model saved.  (FSDP1 is not unwrapped: its
``state_dict()`` already leaves its own prefixes out and must run its hooks.)

**Optimizer entries a load creates.**  A freshly built optimizer has no
per-parameter state until its first step, so its ``state_dict()`` cannot serve as a
template for ``exp_avg`` and friends.  The checkpoint says which tensors exist, so
the load creates them (:func:`create_optimizer_state`; documented in README.md,
"Stateful values"):

* Entries are created only inside the state dict of a **Stateful value** whose state
  dict has the ``torch.optim.Optimizer`` shape (a ``state`` mapping and a
  ``param_groups`` list of groups with ``params``), and only **whole per-parameter
  entries** (``optim.state.<i>``) for a parameter id ``<i>`` that the template's
  ``param_groups`` list.  Anything else the checkpoint holds and the template lacks
  stays "unexpected" (an error with ``strict``), so a checkpoint of a bigger model,
  or a plain dict, is still refused.
* A created tensor gets the stored dtype and shape.  When its shape is the
  parameter's (``exp_avg``), it is allocated like the parameter
  (``torch.empty_like``: same device, and for a DTensor parameter, e.g. under FSDP2,
  the same mesh and placements, so each rank reads only its shard); otherwise
  (``step``) on the CPU.  ``Optimizer.load_state_dict`` then casts each value for its
  parameter, as it does for any loaded state.

After every tensor is filled, each Stateful value's ``load_state_dict()`` is called
with its filled state dict, inner values before outer ones, and the load checks that
the objects now hold what it read: :func:`objckpt.load.writeback.hand_back` (a load
step, so it lives in load/, beside the check it runs).

This module sits below layout/, save/ and load/: it knows the state and the format,
never storage.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

from .distributed.placements import Shard, is_dtensor
from .errors import UnsupportedValueError
from .format.dtypes import dtype_from_name, dtype_name, new_empty
from .format.manifest import Manifest
from .format.subtree import NOTHING, children, find
from .format.tree import _child_key, decode_tree, encode_tree, iter_leaves
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


#: leaf types the walk passes on at once: never Stateful, never a container (a model's thousands of tensors)
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, str, bool, type(None), bytes})


def expand_for_save(state: Any) -> Any:
    """``state`` with every Stateful value replaced by its ``state_dict()`` (recursively).

    Containers on the way to a Stateful value are copied; the others (and every
    tensor) are passed on as they are, so tied tensors and version counters stay
    the caller's."""
    return _expand(state)[0]


def _plain_key(k: Any) -> bool:
    """A dict key that flattens to itself: a non-empty str that is not a "$" tag of the tree."""
    return type(k) is str and k != "" and k[0] != "$"


def _is_container(x: Any) -> bool:
    return type(x) not in _LEAF_TYPES and (isinstance(x, (Mapping, list)) or
                                           (isinstance(x, tuple) and not hasattr(x, "_fields")))


def _expand(state: Any) -> tuple[Any, bool]:
    """:func:`expand_for_save`, and whether no two leaves of the expanded state can flatten
    to the same key (see :func:`collect`): every dict key is :func:`_plain_key`, and a dict
    with a key holding a "." (``"layers.0.weight"``: a model's state dict) holds no
    container.  Then two different paths never join to the same string: at the first level
    where they part, one key would have to be the other, a ".", and more, and the shorter
    one would have to go on into a container beside the dotted one.
    A child's key is joined only where it is used (a Stateful value, a container below)."""
    plain = [True]

    def walk(x: Any, parent: str, k: Any, depth: int) -> Any:
        if type(x) in _LEAF_TYPES:
            return x
        key = _child_key(parent, k) if depth else ""
        if depth > _MAX_DEPTH:
            return x  # encode_tree refuses it, naming the key
        if is_stateful(x):
            inner, wrappers = unwrap(x)
            if wrappers:
                log.debug("saving %r (%s) as the state of the module it wraps: keys without the wrapper's "
                          "prefix", key or "<root>", " around ".join(wrappers))
            return walk(state_of(key, inner), parent, k, depth + 1)  # (at the root: key "" again)
        if isinstance(x, Mapping):
            out = {}
            same, dotted, nested = True, False, False
            for ck, v in x.items():
                if plain[0]:
                    if not _plain_key(ck):
                        plain[0] = False
                    elif "." in ck:
                        dotted = True
                if type(v) in _LEAF_TYPES:  # walk's first line, without a call per tensor
                    out[ck] = v
                    continue
                nv = out[ck] = walk(v, key, ck, depth + 1)
                same = same and nv is v
                if plain[0] and not nested and _is_container(nv):
                    nested = True
            if dotted and nested:
                plain[0] = False
            return x if same else out
        if isinstance(x, list):
            new = [walk(v, key, i, depth + 1) for i, v in enumerate(x)]
            return x if all(a is b for a, b in zip(new, x)) else new
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            tup = tuple(walk(v, key, i, depth + 1) for i, v in enumerate(x))
            return x if all(a is b for a, b in zip(tup, x)) else tup
        return x

    return walk(state, "", "", 0), plain[0]


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
                walk(v, _child_key(key, k), depth + 1)
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, v in enumerate(x):
                walk(v, _child_key(key, i), depth + 1)

    walk(template, "", 0)
    return found


# -- walking the state: tensors to save, slots to fill ----------------------------------------

@dataclass
class Collected:
    tree: Any
    tensors: dict[str, Any]  # every tensor leaf (tensor, DTensor, Shard), by key
    alias_of: dict[str, str]  # key -> key of the first tensor with the same storage view
    #: each plain tensor's (device, shape, strides, dtype), read once by the walk's checks
    #: (what a save's plan cache keys on: objckpt.save.plan_cache)
    facts: dict[str, tuple] = field(default_factory=dict)


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
    """What makes two tensor leaves the same view of the same memory (tied weights): the
    address of the first element, then device, shape, strides and dtype; None for a sharded
    value or an empty tensor (never treated as tied) and where the memory cannot be asked for."""
    if not isinstance(t, torch.Tensor) or is_dtensor(t):
        return None  # sharded values are never treated as tied
    try:
        ptr = t.data_ptr()
    except Exception:
        return None
    if t.numel() == 0:
        return None
    return (ptr, (t.device, t.shape, t.stride(), t.dtype))


#: the tensor types checked and identified in one pass (:func:`_plain_facts`)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain_facts(key: str, t: torch.Tensor) -> tuple[tuple, Optional[tuple]]:
    """:func:`_check_tensor` and :func:`_identity` of a plain tensor (``type(t)`` is
    ``torch.Tensor`` or ``torch.nn.Parameter``), each attribute read once (a model's
    thousands of tensors are each checked at every save): its facts (device, shape,
    strides, dtype) and its identity (None: never tied)."""
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"tensor {key!r} has layout {t.layout}; only dense (strided) tensors are stored")
    if t.is_meta:  # (not ``t.device.type``: building the device's type string costs 5x this)
        raise UnsupportedValueError(f"tensor {key!r} is on the meta device and has no data to save")
    device = t.device
    if t.is_quantized:
        raise UnsupportedValueError(f"tensor {key!r} is quantized; dequantize it or store its int repr")
    dt = t.dtype
    dtype_name(dt, key)
    facts = (device, t.shape, t.stride(), dt)
    try:
        ptr = t.data_ptr()
    except Exception:
        return facts, None
    return facts, ((ptr, facts) if t.numel() else None)


def collect(state: Any, *, allow_pickle: bool = False,
            on_new: Optional[Callable[[str, Any], None]] = None) -> Collected:
    """Encode ``state`` and find its tensors; tensors that are the same view of
    the same storage (tied weights) are recorded as aliases and stored once.
    Stateful values (above) are saved as their ``state_dict()``.

    Two leaves must not flatten to the same key (``1`` and ``"1"``, ``"a.b"`` and
    ``a/b``): the flattened keys are listed and compared, unless the walk found that
    no two can meet (:func:`_expand`: the common case, a model's state dict)."""
    state, plain_keys = _expand(state)
    if not isinstance(state, (Mapping, list, tuple)):
        raise UnsupportedValueError(f"state must be a dict (or list/tuple), got {type(state).__name__}")
    tensors: dict[str, Any] = {}
    alias_of: dict[str, str] = {}
    # the first key of each identity, by the identity's address: an int hashes at once where
    # the whole identity (device, shape, strides, dtype) took ~0.4 us a tensor; tensors that
    # share an address but differ in the rest (a view of a prefix) are kept side by side
    first: dict[int, list[tuple[tuple, str]]] = {}
    facts: dict[str, tuple] = {}

    def on_tensor(key: str, t: Any) -> None:
        if type(t) in _PLAIN_TENSORS:
            facts[key], ident = _plain_facts(key, t)
        else:
            _check_tensor(key, t)
            ident = _identity(t)
        tensors[key] = t
        if ident is not None:
            ptr, rest = ident
            same = first.get(ptr)
            if same is None:
                first[ptr] = [(rest, key)]
            else:
                for r, k in same:
                    if r == rest:
                        alias_of[key] = k
                        return
                same.append((rest, key))
        if on_new is not None:
            on_new(key, t)

    tree = encode_tree(state, on_tensor, allow_pickle=allow_pickle, is_tensor=is_stored_leaf, plain=_PLAIN_TENSORS)
    if not plain_keys:
        _refuse_same_keys(tree)
    return Collected(tree, tensors, alias_of, facts)


def _refuse_same_keys(tree: Any) -> None:
    seen: set[str] = set()
    for key, _ in iter_leaves(tree):
        if key in seen or key == "":
            raise UnsupportedValueError(
                f"two entries flatten to the same key {key!r} (e.g. 1 and '1', or 'a.b' and a/b)"
                if key else "an entry has an empty key; give it a name"
            )
        seen.add(key)


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

    ``stateful`` (from :func:`find_stateful`): each Stateful value is
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
                ck = _child_key(key, k)
                if is_stored_leaf(v) and ck not in found:
                    yield Slot(ck, v, x, k)  # a tensor leaf (most of them): what walk() would yield, in one step
                else:
                    yield from walk(v, ck, x, k)
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, v in enumerate(x):
                yield from walk(v, _child_key(key, i), x, i)
        else:
            yield Slot(key, x, container, index)

    yield from walk(state, "", None, None)


# -- the optimizer entries a load creates -----------------------------------------------------

def optimizer_shaped(sd: Any) -> bool:
    """Whether ``sd`` looks like ``torch.optim.Optimizer.state_dict()``."""
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), MutableMapping):
        return False
    groups = sd.get("param_groups")
    return isinstance(groups, list) and all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                            for g in groups)


def _params_by_id(sv: StatefulValue) -> dict[Any, Any]:
    """Parameter id (as in the state dict) -> the optimizer's parameter tensor, when the object
    shows its ``param_groups`` in the same order (torch numbers them group by group)."""
    ids = [i for g in sv.state["param_groups"] for i in g["params"]]
    try:
        params = [p for g in sv.obj.param_groups for p in g["params"]]
    except (AttributeError, KeyError, TypeError):
        return {}
    return dict(zip(ids, params)) if len(params) == len(ids) else {}


def create_optimizer_state(stateful: Mapping[str, StatefulValue], tree: Any, m: Manifest,
                           allow_pickle: bool, where: str) -> list[str]:
    """Create the per-parameter optimizer entries the checkpoint holds and the templates
    lack (the rule in this module's docstring); returns their keys."""
    created: list[str] = []
    for sv in stateful.values():
        sd = sv.state
        if not optimizer_shaped(sd):
            continue
        state_key = _child_key(sv.key, "state")
        node = find(tree, state_key)
        entries = children(node) if node is not NOTHING else None
        if not entries:
            continue
        ids = {i for g in sd["param_groups"] for i in g["params"] if isinstance(i, (int, str))}
        params = _params_by_id(sv)
        for pid, encoded in entries:
            if not isinstance(pid, (int, str)) or pid in sd["state"] or pid not in ids:
                continue
            sd["state"][pid] = decode_tree(encoded, _allocator(m, params.get(pid)), allow_pickle=allow_pickle,
                                           where=where)
            created.append(_child_key(state_key, pid))
    return created


def _allocator(m: Manifest, param: Any) -> Any:
    def alloc(key: str) -> torch.Tensor:
        e = m.tensors[key]
        dt = dtype_from_name(e.dtype, key)
        if isinstance(param, torch.Tensor) and tuple(param.shape) == tuple(e.shape) and not param.is_meta:
            return torch.empty_like(param, dtype=dt, requires_grad=False)
        return new_empty(tuple(e.shape), dt)

    return alloc
