"""Loading into Stateful values: the entries a fresh optimizer lacks, and the hand-back.

A freshly built optimizer has no per-parameter state until its first step, so
its ``state_dict()`` cannot serve as a template for ``exp_avg`` and friends.
The checkpoint says which tensors exist, so the load creates them.  The rule
(documented in README.md, "Stateful values"):

* Entries are created only inside the state dict of a **Stateful value** whose
  state dict has the ``torch.optim.Optimizer`` shape (a ``state`` mapping and a
  ``param_groups`` list of groups with ``params``), and only **whole
  per-parameter entries** (``optim.state.<i>``) for a parameter id ``<i>`` that
  the template's ``param_groups`` list.  Anything else the checkpoint holds and
  the template lacks stays "unexpected" (an error with ``strict``), so a
  checkpoint of a bigger model, or a plain dict, is still refused.
* A created tensor gets the stored dtype and shape.  When its shape is the
  parameter's (``exp_avg``), it is allocated like the parameter
  (``torch.empty_like``: same device, and for a DTensor parameter, e.g. under
  FSDP2, the same mesh and placements, so each rank reads only its shard);
  otherwise (``step``) on the CPU.  ``Optimizer.load_state_dict`` then casts
  each value for its parameter, as it does for any loaded state.

After every tensor is filled, each Stateful value's ``load_state_dict()`` is
called with its filled state dict, inner values before outer ones; a refusal
is a :class:`StateDictMismatchError` naming the key.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from ..errors import StateDictMismatchError
from ..format.dtypes import dtype_from_name, new_empty
from ..format.manifest import Manifest
from ..format.subtree import NOTHING, children, find
from ..format.tree import _child_key, decode_tree
from ..stateful import StatefulValue
from .writeback import check_written_back, snapshot


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


def hand_back(stateful: Mapping[str, StatefulValue], uri: str) -> None:
    """Call each Stateful value's ``load_state_dict()`` with its filled state dict, then check
    that each object now holds the loaded tensors (:mod:`objckpt.load.writeback`)."""
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
