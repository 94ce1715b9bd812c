"""What ``read(uri, keys=...)`` selects: leaves, subtrees, key prefixes and glob patterns.

Resolved against the manifest alone, before any tensor byte moves, so a read fetches
exactly the tensors its keys select.  A key is, in this order: a leaf (``"model.w"``);
a glob pattern when it holds ``*``, ``?`` or ``[`` (``fnmatch`` rules, case-sensitive,
``*`` crossing dots: ``"model.*lora*"`` selects every leaf whose key matches, each
returned under its own key); else a subtree or key prefix (``"optim"``,
``"model.layers.0"``), returned as the nested subtree under it.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Optional, Sequence

from ..errors import MissingKeyError
from ..format.manifest import Manifest
from ..format.subtree import NOTHING, select, tensor_keys
from ..format.tree import iter_leaves

#: the characters that make a key a glob pattern
PATTERN_CHARS = "*?["


def is_pattern(key: str) -> bool:
    return any(c in key for c in PATTERN_CHARS)


@dataclass(frozen=True)
class ReadSelection:
    """The encoded values a read returns (``nodes``, by the key each is returned under;
    None: the whole tree) and the tensor keys whose bytes it fetches."""

    nodes: Optional[dict[str, Any]]
    tensors: list[str]


def select_keys(m: Manifest, keys: Optional[Sequence[str]], uri: str) -> ReadSelection:
    """Resolve ``keys`` (the rules in this module's docstring); a key or pattern that
    selects nothing is a :class:`MissingKeyError` naming it."""
    if keys is None:
        return ReadSelection(None, list(m.tensors))
    leaves = dict(iter_leaves(m.tree))
    nodes: dict[str, Any] = {}
    missing: list[str] = []
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"read(keys=...) takes str keys, got {type(k).__name__} {k!r}")
        if k in leaves:
            nodes[k] = leaves[k]
        elif is_pattern(k):
            hits = [lk for lk in leaves if fnmatchcase(lk, k)]
            nodes.update((lk, leaves[lk]) for lk in hits)
            if not hits:
                missing.append(k)
        else:
            node = select(m.tree, k)
            if node is NOTHING:
                missing.append(k)
            else:
                nodes[k] = node
    if missing:
        plain = [k for k in missing if not is_pattern(k)]
        patterns = [k for k in missing if is_pattern(k)]
        what = "; ".join(
            ([f"key(s) {plain[:10]} not in checkpoint {uri!r}, neither as a key nor as a key prefix"] if plain else [])
            + ([f"glob pattern(s) {patterns[:10]} match no key of checkpoint {uri!r}"] if patterns else []))
        raise MissingKeyError(f"{what} (it has {len(leaves)} keys, e.g. {list(leaves)[:5]})")
    return ReadSelection(nodes, list(dict.fromkeys(t for n in nodes.values() for t in tensor_keys(n))))
