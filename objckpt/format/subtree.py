"""Finding a dotted key inside an encoded tree: a leaf, a subtree, or a key prefix.

Flat keys join path parts with dots, and state-dict keys hold dots of their own
(``{"model": {"layers.0.weight": ...}}`` flattens to ``model.layers.0.weight``),
so a key is matched against the tree part by part, trying every child whose
name is a dotted prefix of what is left.  ``select(tree, "model.layers.0")``
then returns the entries under that prefix even though no single node of the
tree is named so: ``{"weight": ..., "bias": ...}``, the rest of each key as its
name.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

from .tree import decode_tree

#: what :func:`find` and :func:`select` return when the key is not in the tree
NOTHING: Any = type("Nothing", (), {"__repr__": lambda self: "NOTHING"})()


def children(node: Any) -> Optional[list[tuple[Any, Any]]]:
    """``(key, encoded child)`` of a container node (dict, list, ``$tuple``, ``$dict``),
    keys as saved (ints stay ints); None for a leaf."""
    if isinstance(node, list):
        return list(enumerate(node))
    if not isinstance(node, dict):
        return None
    if len(node) == 1:
        (tag, v), = node.items()
        if tag == "$tuple" and isinstance(v, list):
            return list(enumerate(v))
        if tag == "$dict" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
            return [(k if not isinstance(k, dict) else decode_tree(k, lambda _: None), val) for k, val in v]
        if tag.startswith("$"):
            return None
    return list(node.items())


def _candidates(node: Any, rest: str) -> Iterator[tuple[Optional[str], Any]]:
    """(what is left of ``rest`` after a child's name, None when nothing is; the child) for the
    children named by a dotted prefix of ``rest``."""
    for k, child in children(node) or ():
        name = str(k)
        if rest == name:
            yield None, child
        elif rest.startswith(name + "."):
            yield rest[len(name) + 1:], child


def find(tree: Any, key: str) -> Any:
    """The encoded node at exactly ``key`` ("" is the root), or :data:`NOTHING`."""
    stack: list[tuple[Optional[str], Any]] = [(key if key else None, tree)]
    while stack:
        rest, node = stack.pop()
        if rest is None:
            return node
        # the longest name first (an exact match before all): "b.0" names the key "b.0" rather than
        # item 0 of a value "b" when a state holds both
        found = sorted(_candidates(node, rest), key=lambda c: -1 if c[0] is None else len(c[0]))
        stack.extend(reversed(found))
    return NOTHING


def _under(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    """(rest of key, encoded node) for every node whose flat key starts with ``prefix + "."``
    and whose parent's key does not (the entries a prefix read returns)."""
    out: list[tuple[str, Any]] = []
    stack = [(prefix, tree)]
    while stack:
        rest, node = stack.pop()
        for k, child in children(node) or ():
            name = str(k)
            if name.startswith(rest + "."):
                out.append((name[len(rest) + 1:], child))
            elif rest.startswith(name + "."):
                stack.append((rest[len(name) + 1:], child))
    return out


def _encode_entries(entries: list[tuple[str, Any]]) -> Any:
    if any(k.startswith("$") for k, _ in entries):
        return {"$dict": [[k, v] for k, v in entries]}
    return dict(entries)


def select(tree: Any, key: str) -> Any:
    """What a read of ``key`` returns, encoded: the node at ``key``; or, when no node
    is named so, the nodes under the key prefix as one dict (``model.layers.0`` ->
    ``{"self_attn.q_proj.weight": ..., ...}``); :data:`NOTHING` when neither exists."""
    node = find(tree, key)
    partial = _under(tree, key) if key else []
    if node is NOTHING:
        return _encode_entries(partial) if partial else NOTHING
    if partial and isinstance(node, dict) and not any(k.startswith("$") for k in node):
        return {**node, **dict(partial)}
    return node


def tensor_keys(node: Any) -> list[str]:
    """The ``$tensor`` keys an encoded (sub)tree refers to."""
    out: list[str] = []
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            if len(x) == 1 and "$tensor" in x and isinstance(x["$tensor"], str):
                out.append(x["$tensor"])
            else:
                stack.extend(x.values())
    return out
