"""DCP's flat keys and torch.save'd values <-> objckpt's tree.

torch.distributed.checkpoint flattens a state dict into dotted keys ("fqns")
and keeps, in its planner data, the path each key came from; its non-tensor
values travel as ``torch.save`` bytes.  objckpt keeps the nesting itself (the
manifest's ``tree``) and plain values inline as JSON.  This module translates
between the two, so that a checkpoint written through the DCP plugin reads
back with :func:`objckpt.read` as the nested state it was, and a checkpoint
written by :func:`objckpt.save` presents to DCP the same keys DCP's own
flattening would give.

A value that is not plain data (an arbitrary pickled object) stays the exact
``torch.save`` bytes DCP handed us, stored as ``$bytes``; its key is listed under
``metadata["objckpt.dcp"]["torch_save"]`` so a DCP load gets the original bytes
back and a user of :func:`objckpt.read` knows those bytes are a torch.save blob.
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..errors import UnsupportedFormatError, UnsupportedValueError
from ..format.tree import decode_tree, encode_tree

log = logging.getLogger("objckpt.dcp")

#: the manifest metadata key under which the DCP bridge records what it did
META_KEY = "objckpt.dcp"


@dataclass(frozen=True)
class TensorRef:
    """A tensor's place in a tree being built: its flat key (the DCP fqn)."""

    key: str


class _HasTensor(Exception):
    pass


def _refuse_tensor(key: str, _t: Any) -> None:
    raise _HasTensor(key)


def plain_value(raw: bytes) -> tuple[Any, bool]:
    """``(value, True)`` when ``raw`` (torch.save bytes) holds plain data objckpt stores
    as JSON (numbers, strings, lists, dicts, tuples, ...), else ``(raw, False)``.

    Loaded with ``weights_only=True``: a checkpoint's bytes never run code here."""
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception:
        return raw, False
    try:
        encode_tree(value, _refuse_tensor)
    except (UnsupportedValueError, _HasTensor):
        return raw, False
    return value, True


def torch_save_bytes(value: Any) -> bytes:
    """``value`` as torch.save bytes (what DCP's ``load_bytes`` expects)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _encode(obj: Any) -> Optional[Any]:
    """The encoded tree of ``obj`` (leaves TensorRef or plain values), or None when some
    tensor's key in the tree would differ from its fqn."""
    ok = [True]

    def on_tensor(key: str, ref: TensorRef) -> None:
        if key != ref.key:
            ok[0] = False

    tree = encode_tree(obj, on_tensor, is_tensor=lambda x: isinstance(x, TensorRef))
    return tree if ok[0] else None


def tree_from_flat(flat: dict[str, Any], mappings: Any) -> Any:
    """The encoded objckpt tree of DCP's flat state (fqn -> TensorRef or plain value).

    With DCP's flatten mappings (fqn -> path) the nesting is rebuilt, so
    ``objckpt.read`` returns ``{"model": {...}, "step": 3}``; every tensor's key in
    that tree equals its fqn (DCP and objckpt both join path parts with dots).
    Without usable mappings (a custom planner) the tree is the flat dict itself."""
    if isinstance(mappings, dict) and all(
            isinstance(mappings.get(k), tuple) and mappings[k] for k in flat):
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        try:
            tree = _encode(unflatten_state_dict(flat, mappings))
        except (TypeError, ValueError, IndexError, KeyError, UnsupportedValueError):
            tree = None
        if tree is not None:
            return tree
    tree = _encode(dict(flat))
    if tree is None:  # unreachable: a flat dict's keys are the fqns themselves
        raise UnsupportedValueError("cannot build the checkpoint tree from DCP's keys")
    return tree


@dataclass
class DcpView:
    """A checkpoint as DCP sees it: flat keys, each a tensor (by its stored key) or a value."""

    tensors: dict[str, tuple[str, torch.dtype, tuple[int, ...]]]  # fqn -> (objckpt key, dtype, shape)
    values: dict[str, Any]  # fqn -> decoded value (may hold tensor placeholders, see ``placeholders``)
    mappings: dict[str, tuple]  # fqn -> path, as DCP's flatten_state_dict gives it
    #: id of a placeholder (meta) tensor inside a value -> its objckpt key
    placeholders: dict[int, tuple[torch.Tensor, str]]
    #: fqns whose value is the exact torch.save bytes DCP wrote (not plain data)
    torch_save: set[str]
    #: the whole decoded state, tensors stood in for by meta tensors (keys in ``placeholders``)
    decoded: dict[str, Any]


def dcp_view(tree: Any, tensor_meta: Callable[[str], tuple[torch.dtype, tuple[int, ...]]],
             torch_save_keys: set[str], where: str, allow_pickle: bool = False) -> DcpView:
    """Flatten a decoded objckpt tree the way DCP flattens a state dict.

    Tensors are stood in for by meta tensors (no memory), so DCP's own traversal
    rules decide which lists are walked into and which values are leaves."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    refs: dict[int, tuple[torch.Tensor, str]] = {}

    def placeholder(key: str) -> torch.Tensor:
        dtype, shape = tensor_meta(key)
        t = torch.empty(shape, dtype=dtype, device="meta")
        refs[id(t)] = (t, key)
        return t

    decoded = decode_tree(tree, placeholder, allow_pickle=allow_pickle, where=where)
    if not isinstance(decoded, dict):
        raise UnsupportedFormatError(
            f"checkpoint {where}: its top level is a {type(decoded).__name__}; DCP loads only state dicts "
            "(a dict at the top level)")
    flat, mappings = flatten_state_dict(decoded)
    tensors: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
    values: dict[str, Any] = {}
    for fqn, v in flat.items():
        hit = refs.get(id(v)) if isinstance(v, torch.Tensor) else None
        if hit is not None:
            tensors[fqn] = (hit[1], v.dtype, tuple(v.shape))
        else:
            values[fqn] = v
    return DcpView(tensors, values, dict(mappings), refs, {k for k in torch_save_keys if k in values}, decoded)


def materialize(value: Any, view: DcpView, read: Callable[[str], torch.Tensor]) -> Any:
    """``value`` with its placeholder tensors replaced by the stored tensors (``read(key)``)."""
    if isinstance(value, torch.Tensor):
        hit = view.placeholders.get(id(value))
        return read(hit[1]) if hit is not None else value
    if isinstance(value, dict):
        return type(value)((k, materialize(v, view, read)) for k, v in value.items())
    if isinstance(value, list):
        return [materialize(v, view, read) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(materialize(v, view, read) for v in value)
    return value


def value_bytes(fqn: str, view: DcpView, read: Callable[[str], torch.Tensor]) -> bytes:
    """What DCP's ``load_bytes`` gets for ``fqn``: the original torch.save bytes, or the value re-saved."""
    v = view.values[fqn]
    if fqn in view.torch_save and isinstance(v, (bytes, bytearray)):
        return bytes(v)
    return torch_save_bytes(materialize(v, view, read))
