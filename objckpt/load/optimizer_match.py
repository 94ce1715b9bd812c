"""A checkpoint's optimizer state against the template's optimizer: another kind of optimizer is refused.

Why: torch's ``Optimizer.load_state_dict`` takes whatever param groups and state it
is given.  An AdamW checkpoint loaded into an SGD optimizer gives the SGD AdamW's
``lr``, ``betas``, ``eps``... and AdamW's ``exp_avg`` state, without a word: the SGD's
learning rate changes from the 0.1 it was built with to AdamW's 0.001.  objckpt holds
both sides before it reads a tensor byte, so it compares them (:func:`check_optimizers`,
called while the load is prepared, before anything is created in or loaded into the
template).

What is compared, for every optimizer state dict of the template (:func:`optimizer_templates`:
a Stateful optimizer's ``state_dict()``, a plain ``opt.state_dict()``, the one
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns, keyed by
parameter name, and its ``flatten_optimizer_state_dict=True`` form, whose keys are
``state.<param>.<name>`` and ``param_groups.<param>.<name>``) with what the checkpoint
holds under the same key:

* the hyperparameter names of each param group, group by group (per parameter in the
  flat form): ``lr``, ``betas``, ``momentum``...; not ``params``, nor the flags torch
  gives every optimizer and adds to them across versions (:data:`GENERIC_GROUP_KEYS`);
* the per-parameter state names (``exp_avg``, ``momentum_buffer``...) of each parameter
  for which the template **has** state.  A freshly built optimizer has none until its
  first step: that is the common resume, and only its groups are compared.

Two sides differ when **each has names the other lacks**.  A name on one side only is
what newer torch versions and LR schedulers add to a group (``initial_lr``, OneCycleLR's
``max_lr``) or a state entry of another setting of the same optimizer (``amsgrad``'s
``max_exp_avg_sq``, which the key match reports): those load as before.  Values never
count: the same optimizer built with another ``lr`` loads, and takes the stored one.

A difference raises :class:`~objckpt.errors.OptimizerMismatchError` naming the
optimizer's key, the group or parameter, and both sides' names;
``load(..., allow_optimizer_change=True)`` loads it anyway, as torch would (logged as a
warning): the optimizer takes the stored hyperparameters, and a Stateful optimizer's
per-parameter entries of the other kind are replaced whole by the stored ones (created as
for a fresh optimizer), so SGD with momentum buffers takes AdamW's moments.  A plain state
dict of the caller's is not changed: its entries of the other kind stay a key mismatch.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from ..errors import OptimizerMismatchError
from ..format.subtree import NOTHING, children, find
from ..format.tree import _child_key
from ..logs import get_logger
from ..state import StatefulValue, optimizer_shaped

log = get_logger("objckpt.load")

#: param-group entries that do not tell one optimizer from another: ``params``, the flags torch's
#: optimizers share (and gained across versions), and what LR schedulers add to every group
GENERIC_GROUP_KEYS = frozenset({"params", "foreach", "maximize", "capturable", "differentiable", "fused",
                                "decoupled_weight_decay", "initial_lr"})
#: how many differing groups / parameters an error lists (the rest are counted)
_SHOWN = 3
#: deepest nesting walked while looking for optimizer state dicts (as objckpt.state walks)
_MAX_DEPTH = 200
_FLAT_STATE, _FLAT_GROUPS = "state.", "param_groups."


@dataclass(frozen=True)
class OptimizerTemplate:
    """One optimizer state dict of the template: where it sits, what it is, which form."""

    key: str
    sd: Mapping
    #: the Stateful optimizer's class name, or "" for a plain dict
    kind: str = ""
    #: the ``flatten_optimizer_state_dict=True`` form
    flat: bool = False

    def describe(self) -> str:
        where = f"at key {self.key or '<root>'!r}"
        return f"the {self.kind} {where}" if self.kind else f"the optimizer state dict {where}"


@dataclass(frozen=True)
class NameDifference:
    """One param group (or one parameter's state) whose names differ on both sides."""

    place: str  # "param group", "the state of parameter", "the param group of", "the state of"
    ident: str  # which group or parameter: "0", "'fc.weight'"
    what: str  # "hyperparameters" or "state"
    stored: tuple[str, ...]
    template: tuple[str, ...]
    #: the stored and the template's ``lr``, when both sides have one
    lr: Optional[tuple[Any, Any]] = None
    #: (state) the parameter's id in the template's ``state`` (nested form)
    pid: Any = None

    def describe(self, idents: Optional[list[str]] = None) -> str:
        """Both sides' names; ``idents``: every group or parameter whose names are these."""
        only_c = sorted(set(self.stored) - set(self.template))
        only_t = sorted(set(self.template) - set(self.stored))
        shown = idents or [self.ident]
        more = f" and {len(shown) - _SHOWN} more" if len(shown) > _SHOWN else ""
        where = f"{self.place} {', '.join(shown[:_SHOWN])}{more}"
        return (f"{where}: the checkpoint's {self.what} {list(self.stored)}, the state dict's "
                f"{list(self.template)} (only in the checkpoint: {', '.join(only_c)}; only in the state dict: "
                f"{', '.join(only_t)})")


def _differ(stored: Iterable[str], template: Iterable[str]) -> bool:
    """Each side has a name the other lacks."""
    a, b = set(stored), set(template)
    return bool(a - b) and bool(b - a)


def _flat(sd: Mapping) -> bool:
    """Whether ``sd`` is ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``'s form."""
    return (bool(sd) and all(isinstance(k, str) and k.startswith((_FLAT_STATE, _FLAT_GROUPS)) for k in sd)
            and any(k.startswith(_FLAT_GROUPS) for k in sd))


def _may_hold(v: Any, stateful_ids: set[int]) -> bool:
    """Whether the walk descends into ``v``: a container, or a Stateful value (a tensor, the
    common leaf, is told apart first: ``isinstance`` against ``Mapping`` costs more)."""
    if isinstance(v, (dict, list, tuple)):
        return True
    return not isinstance(v, torch.Tensor) and (id(v) in stateful_ids or isinstance(v, Mapping))


def optimizer_templates(state: Any, stateful: Optional[Mapping[str, StatefulValue]] = None) -> list[OptimizerTemplate]:
    """Every optimizer state dict of the template (each Stateful value stands for its state dict)."""
    found = stateful or {}
    objs = {id(o) for sv in found.values() for o in (sv.obj, sv.given) if o is not None}
    out: list[OptimizerTemplate] = []

    def walk(x: Any, key: str, depth: int, kind: str) -> None:
        if depth > _MAX_DEPTH:
            return
        sv = found.get(key)
        if sv is not None and sv.sits_in(x):
            x, kind = sv.state, type(sv.obj).__qualname__
        if isinstance(x, Mapping):
            if optimizer_shaped(x) or _flat(x):
                out.append(OptimizerTemplate(key, x, kind, not optimizer_shaped(x)))
                return
            for k, v in x.items():
                if _may_hold(v, objs):
                    walk(v, _child_key(key, k), depth + 1, "")
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, v in enumerate(x):
                if _may_hold(v, objs):
                    walk(v, _child_key(key, i), depth + 1, "")

    walk(state, "", 0, "")
    return out


def _names(node: Any) -> list[Any]:
    return [k for k, _ in children(node) or ()]


def _hyper(names: Iterable[Any]) -> tuple[str, ...]:
    return tuple(sorted(str(n) for n in names if str(n) not in GENERIC_GROUP_KEYS))


def _stored_lr(group: Any) -> Any:
    for k, v in children(group) or ():
        if k == "lr":
            return v if isinstance(v, (int, float)) else None
    return None


def _nested_differences(t: OptimizerTemplate, node: Any) -> list[NameDifference]:
    kids = dict(children(node) or ())
    out: list[NameDifference] = []
    for i, (group, stored) in enumerate(zip(t.sd["param_groups"], [g for _, g in children(kids.get("param_groups"))
                                                                     or ()])):
        a, b = _hyper(_names(stored)), _hyper(group)
        if _differ(a, b):
            lr = (_stored_lr(stored), group["lr"]) if "lr" in a and "lr" in b else None
            out.append(NameDifference("param group", str(i), "hyperparameters", a, b, lr))
    stored_state = {str(pid): entry for pid, entry in children(kids.get("state")) or ()}
    for pid, entry in t.sd["state"].items():
        if not isinstance(entry, Mapping) or str(pid) not in stored_state:
            continue
        a, b = tuple(sorted(map(str, _names(stored_state[str(pid)])))), tuple(sorted(map(str, entry)))
        if _differ(a, b):
            out.append(NameDifference("the state of parameter", repr(pid), "state", a, b, pid=pid))
    return out


def _flat_names(keys: Iterable[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(parameter -> hyperparameter names, parameter -> state names) of a flat optimizer state dict."""
    groups: dict[str, set[str]] = {}
    states: list[str] = []
    for k in keys:
        if k.startswith(_FLAT_GROUPS) and "." in k[len(_FLAT_GROUPS):]:
            fqn, name = k[len(_FLAT_GROUPS):].rsplit(".", 1)
            groups.setdefault(fqn, set()).add(name)
        elif k.startswith(_FLAT_STATE):
            states.append(k[len(_FLAT_STATE):])
    state: dict[str, set[str]] = {}
    for rest in states:
        parts = rest.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest parameter name first
            if ".".join(parts[:i]) in groups:
                state.setdefault(".".join(parts[:i]), set()).add(parts[i])
                break
    return groups, state


def _flat_differences(t: OptimizerTemplate, node: Any) -> list[NameDifference]:
    c_groups, c_state = _flat_names(str(k) for k in _names(node))
    t_groups, t_state = _flat_names(t.sd)
    out: list[NameDifference] = []
    for fqn, names in t_groups.items():
        a, b = _hyper(c_groups.get(fqn, ())), _hyper(names)
        if fqn in c_groups and _differ(a, b):
            out.append(NameDifference("the param group of", repr(fqn), "hyperparameters", a, b))
    for fqn, names in t_state.items():
        if fqn in c_state and _differ(c_state[fqn], names):
            out.append(NameDifference("the state of", repr(fqn), "state", tuple(sorted(c_state[fqn])),
                                      tuple(sorted(names))))
    return out


def optimizer_differences(state: Any, stateful: Optional[Mapping[str, StatefulValue]],
                          tree: Any) -> list[tuple[OptimizerTemplate, list[NameDifference]]]:
    """Each optimizer of the template whose stored state (in the encoded ``tree``) is another
    kind of optimizer's, with what differs; [] when none."""
    out = []
    for t in optimizer_templates(state, stateful):
        node = find(tree, t.key) if t.key else tree
        if node is NOTHING or children(node) is None:
            continue  # not in the checkpoint: the key match reports it
        diffs = _flat_differences(t, node) if t.flat else _nested_differences(t, node)
        if diffs:
            out.append((t, diffs))
    return out


def describe_all(diffs: list[NameDifference]) -> str:
    """Each distinct difference once, with every group or parameter it concerns."""
    by: dict[tuple[str, str, tuple[str, ...], tuple[str, ...]], tuple[NameDifference, list[str]]] = {}
    for d in diffs:
        by.setdefault((d.place, d.what, d.stored, d.template), (d, []))[1].append(d.ident)
    return "; ".join(d.describe(idents) for d, idents in by.values())


def check_optimizers(state: Any, stateful: Optional[Mapping[str, StatefulValue]], tree: Any, uri: str,
                     allow: bool = False) -> None:
    """Raise :class:`OptimizerMismatchError` when an optimizer of the template would load another
    kind of optimizer's state (this module's rule); nothing when ``allow``."""
    found = optimizer_differences(state, stateful, tree)
    if not found:
        return
    if allow:
        for t, diffs in found:
            _take_stored_entries(t, diffs)
            log.warning("objckpt: loading %s into %s (allow_optimizer_change=True): %s", uri, t.describe(),
                        describe_all(diffs))
        return
    t, diffs = found[0]
    listed = describe_all(diffs)
    others = (f" The optimizer(s) at {', '.join(repr(o.key or '<root>') for o, _ in found[1:])} differ too."
              if len(found) > 1 else "")
    lr = next((d.lr for d in diffs if d.lr is not None and d.lr[0] != d.lr[1]), None)
    change = f" (its lr would change from {lr[1]} to {lr[0]})" if lr else ""
    raise OptimizerMismatchError(
        f"cannot load {uri!r} into {t.describe()}: the checkpoint holds another kind of optimizer's state. "
        f"{listed}.{others} Loaded, the optimizer would take the checkpoint's hyperparameters{change} and "
        "per-parameter state. Nothing was loaded. Build the optimizer the checkpoint was saved with, or pass "
        "allow_optimizer_change=True to load it anyway (as torch's load_state_dict would)")


def _take_stored_entries(t: OptimizerTemplate, diffs: list[NameDifference]) -> None:
    """With ``allow_optimizer_change``: a Stateful optimizer's per-parameter entries of the other
    kind leave its state dict (a copy ``state_dict()`` made), so the load creates them from the
    checkpoint (:func:`objckpt.state.create_optimizer_state`) and the optimizer takes the stored
    state whole, as torch's ``load_state_dict`` would.  A plain dict of the caller's is left as given."""
    if not t.kind or t.flat:
        return
    for d in diffs:
        if d.pid is not None:
            t.sd["state"].pop(d.pid, None)
