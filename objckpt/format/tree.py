"""Nested state <-> JSON tree with tensor placeholders.

A state dict is any nesting of dicts, lists and tuples whose leaves are tensors
or plain values.  The tree keeps the nesting and the plain values inline (JSON)
and replaces each tensor by ``{"$tensor": key}``, where ``key`` is the dotted
path (``"model.layers.0.weight"``, ``"optim.state.3.exp_avg"``) that the rest
of the API uses.  Types JSON lacks are tagged objects with one ``$``-key:

``$tuple`` ``$dict`` (non-string keys) ``$float`` (nan/inf) ``$size``
``$dtype`` ``$device`` ``$bytes`` ``$pickle`` (only with explicit opt-in).
"""
from __future__ import annotations

import base64
import math
import pickle
from collections.abc import Mapping
from typing import Any, Callable, Container

import torch

from ..errors import CorruptCheckpointError, UnsupportedValueError
from .dtypes import dtype_from_name, dtype_name

TensorSink = Callable[[str, Any], None]  # a torch.Tensor (DTensor included) or an objckpt.Shard
TensorSource = Callable[[str], Any]

_SCALARS = (str, int, bool, type(None))

#: deepest nesting of containers (dict, list, tuple) that save accepts: deeper state
#: cannot be read back portably (JSON parsers recurse), so it is refused up front
MAX_DEPTH = 100
#: deepest JSON nesting a manifest's tree may have: MAX_DEPTH containers, each tagged
#: value adding up to two JSON levels, plus slack
MAX_JSON_DEPTH = 2 * MAX_DEPTH + 8


def _child_key(prefix: str, k: Any) -> str:
    part = str(k)
    return f"{prefix}.{part}" if prefix else part


def _plain_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def encode_tree(obj: Any, on_tensor: TensorSink, *, allow_pickle: bool = False,
                is_tensor: Callable[[Any], bool] = _plain_tensor, plain: tuple[type, ...] = ()) -> Any:
    """Encode ``obj``; ``on_tensor(key, tensor)`` is called for every leaf
    ``is_tensor`` accepts (the caller's notion of a tensor: objckpt.Shard too).
    ``plain``: types whose values ``is_tensor`` accepts (``torch.Tensor`` exactly, say),
    encoded in the loop over their dict without a call per value: a model's state dict
    is thousands of them, and the call was a third of the walk."""
    seen_keys: set[str] = set()
    seen = seen_keys.add

    def enc(x: Any, key: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(
                f"value at key {key or '<root>'!r} is nested more than {MAX_DEPTH} containers deep, "
                "objckpt's limit (docs/format.md §7); flatten the state")
        if is_tensor(x):
            if key in seen_keys:
                raise UnsupportedValueError(f"two entries flatten to the same key {key!r}; rename one")
            seen(key)
            on_tensor(key, x)
            return {"$tensor": key}
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return float(x) if math.isfinite(x) else {"$float": repr(float(x))}
        if isinstance(x, torch.Size):
            return {"$size": [int(d) for d in x]}
        if isinstance(x, torch.dtype):
            return {"$dtype": dtype_name(x, key)}
        if isinstance(x, torch.device):
            return {"$device": str(x)}
        if isinstance(x, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(x)).decode()}
        if isinstance(x, Mapping):
            items = list(x.items())
            if all(isinstance(k, str) and not k.startswith("$") for k, _ in items):
                if not plain or depth >= MAX_DEPTH:
                    return {k: enc(v, _child_key(key, k), depth + 1) for k, v in items}
                out = {}
                for k, v in items:  # enc's tensor branch, inline (see ``plain``)
                    ck = f"{key}.{k}" if key else str(k)
                    if type(v) in plain:
                        if ck in seen_keys:
                            raise UnsupportedValueError(f"two entries flatten to the same key {ck!r}; rename one")
                        seen(ck)
                        on_tensor(ck, v)
                        out[k] = {"$tensor": ck}
                    else:
                        out[k] = enc(v, ck, depth + 1)
                return out
            for k, _ in items:
                if not isinstance(k, (str, int, bool, float, type(None))):
                    raise UnsupportedValueError(f"{key or '<root>'!r}: dict key {k!r} of type {type(k).__name__} is not supported")
            return {"$dict": [[enc(k, key, depth + 1), enc(v, _child_key(key, k), depth + 1)] for k, v in items]}
        if isinstance(x, list):
            return [enc(v, _child_key(key, i), depth + 1) for i, v in enumerate(x)]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return {"$tuple": [enc(v, _child_key(key, i), depth + 1) for i, v in enumerate(x)]}
        if allow_pickle:
            return {"$pickle": base64.b64encode(pickle.dumps(x)).decode()}
        raise UnsupportedValueError(
            f"value at key {key or '<root>'!r} has type {type(x).__module__}.{type(x).__qualname__}, which "
            "objckpt stores only as tensor, number, str, bool, None, bytes, dict, list, tuple, torch.Size, "
            "dtype or device; convert it, or pass allow_pickle=True to save (and to load) to pickle it"
        )

    return enc(obj, "")


def _bad_tag(where: str, tag: str, v: Any, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest {where}: tree value {{{tag!r}: {str(v)[:80]!r}}} malformed ({e})")


def _decode_tag(tag: str, v: Any, where: str) -> Any:
    """The value of a leaf tag (not $tensor/$tuple/$dict/$pickle); a malformed payload is corrupt."""
    try:
        if tag == "$float":
            if not isinstance(v, str):
                raise TypeError("not a string")
            return float(v)
        if tag == "$size":
            if not isinstance(v, list) or not all(type(d) is int and 0 <= d < 1 << 63 for d in v):
                raise TypeError("not a list of sizes")
            return torch.Size(v)
        if tag == "$dtype":
            if not isinstance(v, str):
                raise TypeError("not a string")
            return dtype_from_name(v)
        if tag == "$device":
            if not isinstance(v, str):
                raise TypeError("not a string")
            return torch.device(v)
        if tag == "$bytes":
            if not isinstance(v, str):
                raise TypeError("not a string")
            return base64.b64decode(v, validate=True)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise _bad_tag(where, tag, v, e) from None
    raise CorruptCheckpointError(f"manifest {where}: unknown tree tag {tag!r}")


def _pairs(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
        raise _bad_tag(where, "$dict", v, TypeError("not a list of [key, value] pairs"))
    return v


def check_tree(tree: Any, tensor_keys: Container[str], where: str) -> None:
    """Validate an encoded tree as read from a manifest, without recursion: every tag's
    payload well formed, every ``$tensor`` naming a tensor of the manifest, dict keys
    hashable, nesting within :data:`MAX_JSON_DEPTH`.  Raises CorruptCheckpointError."""
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise CorruptCheckpointError(f"manifest {where}: tree nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)
            continue
        if not isinstance(x, dict):
            continue
        if len(x) == 1:
            (tag, v), = x.items()
            if tag == "$tensor":
                if not isinstance(v, str) or v not in tensor_keys:
                    raise CorruptCheckpointError(f"manifest {where}: tree names tensor {v!r}, which it does not list")
                continue
            if tag == "$tuple":
                if not isinstance(v, list):
                    raise _bad_tag(where, tag, v, TypeError("not a list"))
                stack.extend((e, depth + 2) for e in v)
                continue
            if tag == "$dict":
                for k, val in _pairs(v, where):
                    if isinstance(k, (list, dict)) and not (isinstance(k, dict) and len(k) == 1
                                                             and next(iter(k)) in ("$float", "$tuple")):
                        raise _bad_tag(where, tag, k, TypeError("unhashable key"))
                    stack.append((k, depth + 3))
                    stack.append((val, depth + 3))
                continue
            if tag == "$pickle":
                if not isinstance(v, str):
                    raise _bad_tag(where, tag, v, TypeError("not a string"))
                continue
            if tag.startswith("$"):
                _decode_tag(tag, v, where)
                continue
        stack.extend((v, depth + 1) for v in x.values())


def decode_tree(tree: Any, get_tensor: TensorSource, *, allow_pickle: bool = False, where: str = "") -> Any:
    """Rebuild the nested structure; ``get_tensor(key)`` supplies each tensor.

    Malformed tag payloads raise CorruptCheckpointError (the manifest decoder has already
    refused them with :func:`check_tree`; this guards trees from other sources)."""

    def dec(x: Any, depth: int) -> Any:
        if depth > MAX_JSON_DEPTH:
            raise CorruptCheckpointError(f"manifest {where}: tree nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(x, list):
            return [dec(v, depth + 1) for v in x]
        if not isinstance(x, dict):
            return x
        if len(x) == 1:
            (tag, v), = x.items()
            if tag == "$tensor":
                return get_tensor(v)
            if tag == "$tuple":
                if not isinstance(v, list):
                    raise _bad_tag(where, tag, v, TypeError("not a list"))
                return tuple(dec(e, depth + 2) for e in v)
            if tag == "$dict":
                try:
                    return {dec(k, depth + 3): dec(val, depth + 3) for k, val in _pairs(v, where)}
                except TypeError as e:
                    raise _bad_tag(where, tag, v, e) from None
            if tag == "$pickle":
                if not allow_pickle:
                    raise UnsupportedValueError(
                        f"checkpoint {where} holds a pickled value; pass allow_pickle=True to load it "
                        "(only for checkpoints you trust: unpickling runs code)"
                    )
                try:
                    raw = base64.b64decode(v, validate=True)
                except (TypeError, ValueError) as e:
                    raise _bad_tag(where, tag, v, e) from None
                return pickle.loads(raw)
            if tag.startswith("$"):
                return _decode_tag(tag, v, where)
        return {k: dec(v, depth + 1) for k, v in x.items()}

    return dec(tree, 0)


def has_tensor(tree: Any) -> bool:
    """Whether an encoded (sub)tree holds any tensor."""
    if isinstance(tree, list):
        return any(has_tensor(v) for v in tree)
    if isinstance(tree, dict):
        if "$tensor" in tree and len(tree) == 1:
            return True
        return any(has_tensor(v) for v in tree.values())
    return False


def iter_leaves(tree: Any, prefix: str = ""):
    """(key, encoded value) for every leaf of an encoded tree.

    Leaves are tensors (``{"$tensor": k}``) and maximal tensor-free subtrees
    (a step counter, a list of hyper-parameters), which load replaces whole.
    """
    if prefix and not has_tensor(tree):
        yield prefix, tree
        return
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from iter_leaves(v, _child_key(prefix, i))
        return
    if isinstance(tree, dict):
        if len(tree) == 1:
            (tag, v), = tree.items()
            if tag == "$tuple" and isinstance(v, list):
                for i, e in enumerate(v):
                    yield from iter_leaves(e, _child_key(prefix, i))
                return
            if tag == "$dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
                for k, val in v:
                    kk = k if not isinstance(k, dict) else decode_tree(k, lambda _: None)
                    yield from iter_leaves(val, _child_key(prefix, kk))
                return
            if tag.startswith("$"):  # a malformed $tuple/$dict too: decode_tree refuses it
                yield prefix, tree
                return
        for k, v in tree.items():
            yield from iter_leaves(v, _child_key(prefix, k))
        return
    yield prefix, tree
