"""``objckpt info URI [--all] [--json] [--manifest]``: what a checkpoint holds, its whole tree.

A checkpoint is a tree (docs/format.md §7): tensors, and the plain values saved beside them
(a step counter, the scheduler's state, RNG states, a trainer's state).  ``info`` shows both,
one row per flat key (the dotted keys ``objckpt.read`` takes):

* by default a summary: a group of more than :data:`SHOW_TENSORS` tensors under one key is
  one row (how many, which dtypes, how many MB), every other tensor one row (dtype, shape,
  chunks or the tensor it is tied to), and every plain value one row with its type and
  its value cut to :data:`CUT` characters;
* ``--all``: every tensor on its own row and every plain value whole;
* ``--json``: one JSON document, schema :data:`SCHEMA` (docs/cli.md): the tree with each
  tensor as ``{"$tensor": {"key", "dtype", "shape", "bytes"[, "tied_to"]}}`` and each plain
  value as its JSON value (tuples as arrays; what JSON cannot hold tagged as in the
  manifest: ``$float``, ``$bytes``, ``$size``, ``$dtype``, ``$device``, ``$dict``, and
  ``{"$pickle": {"bytes": n}}`` for a pickled value, whose payload is never shown);
* ``--manifest``: the manifest itself, as stored.

Tensors are counted one way everywhere (:meth:`objckpt.format.manifest.Manifest.tensor_count`).
"""
from __future__ import annotations

import argparse
import base64
import binascii
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from ..format.dtypes import NAME_TO_DTYPE, itemsize
from ..format.manifest import Manifest, TensorCount
from ..format.tree import iter_leaves
from .options import add_command, storage_options

#: the ``schema`` field of ``info --json``; a change that drops or renames a field gets a new one
SCHEMA = "objckpt.info/1"
#: a group of more tensors than this under one key is summarized on one row (without ``--all``)
SHOW_TENSORS = 10
#: characters of a plain value shown in the summary (``--all``: whole)
CUT = 100


def tensor_bytes(m: Manifest, key: str) -> int:
    """The bytes of tensor ``key`` (its shape times its element size; a tied tensor's are its target's)."""
    t = m.tensors[key]
    dtype = NAME_TO_DTYPE.get(t.dtype)
    if dtype is None:  # a dtype this torch lacks: what its chunks hold
        return sum(c.length for c in m.tensors[t.alias_of or key].chunks)
    return t.numel * itemsize(dtype)


# -- JSON ------------------------------------------------------------------------------------
def json_value(node: Any, m: Manifest) -> Any:
    """An encoded tree (docs/format.md §7) as ``info --json`` shows it."""
    if isinstance(node, list):
        return [json_value(v, m) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        (tag, v), = node.items()
        if tag == "$tensor" and isinstance(v, str) and v in m.tensors:
            return {"$tensor": _tensor_json(m, v)}
        if tag == "$tuple" and isinstance(v, list):
            return [json_value(e, m) for e in v]
        if tag == "$dict" and isinstance(v, list):
            return {"$dict": [[json_value(k, m), json_value(val, m)] for k, val in v]}
        if tag == "$pickle":
            return {"$pickle": {"bytes": _b64_len(v)}}
        if tag.startswith("$"):
            return {tag: v}
    return {k: json_value(v, m) for k, v in node.items()}


def _tensor_json(m: Manifest, key: str) -> dict[str, Any]:
    t = m.tensors[key]
    out: dict[str, Any] = {"key": key, "dtype": t.dtype, "shape": list(t.shape), "bytes": tensor_bytes(m, key)}
    if t.alias_of:
        out["tied_to"] = t.alias_of
    return out


def _b64_len(v: Any) -> Optional[int]:
    try:
        return len(base64.b64decode(v, validate=True))
    except (TypeError, ValueError, binascii.Error):
        return None


def info_document(uri: str, m: Manifest) -> dict[str, Any]:
    """``info --json``: the checkpoint summed up and its whole tree (schema :data:`SCHEMA`)."""
    count = m.tensor_count()
    return {
        "schema": SCHEMA,
        "uri": uri,
        "format_version": m.format_version,
        "writer": m.writer,
        "created": m.created,
        "metadata": m.metadata,
        "tensors": {"count": count.tensors, "tied": count.tied,
                    "bytes": sum(tensor_bytes(m, k) for k, t in m.tensors.items() if not t.alias_of)},
        "blobs": {"count": len(m.blobs), "bytes": m.total_blob_bytes},
        "tree": json_value(m.tree, m),
        "rank_trees": None if m.rank_trees is None else [json_value(t, m) for t in m.rank_trees],
    }


# -- text ------------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    """The type of an encoded plain value, as Python names it."""
    if v is None:
        return "None"
    if isinstance(v, (bool, int, float, str)):
        return type(v).__name__
    if isinstance(v, list):
        return f"list[{len(v)}]"
    if isinstance(v, dict) and len(v) == 1:
        (tag, p), = v.items()
        n = len(p) if isinstance(p, list) else 0
        named = {"$tuple": f"tuple[{n}]", "$dict": f"dict[{n}]", "$float": "float", "$size": "torch.Size",
                 "$dtype": "torch.dtype", "$device": "torch.device", "$pickle": "pickled"}
        if tag == "$bytes":
            return f"bytes[{_b64_len(p)}]"
        if tag in named:
            return named[tag]
    return f"dict[{len(v)}]" if isinstance(v, dict) else type(v).__name__


def _text(v: Any) -> str:
    """An encoded plain value written as Python would print it (roughly)."""
    if isinstance(v, list):
        return "[" + ", ".join(_text(e) for e in v) + "]"
    if isinstance(v, dict):
        if len(v) == 1:
            (tag, p), = v.items()
            if tag == "$tuple" and isinstance(p, list):
                return "(" + ", ".join(_text(e) for e in p) + ("," if len(p) == 1 else "") + ")"
            if tag == "$dict" and isinstance(p, list):
                return "{" + ", ".join(f"{_text(k)}: {_text(val)}" for k, val in p) + "}"
            if tag in ("$float", "$device"):
                return str(p)
            if tag == "$size":
                return f"torch.Size({p})"
            if tag == "$dtype":
                return f"torch.{p}"
            if tag in ("$bytes", "$pickle"):
                return f"<{_b64_len(p)} bytes>"
        return "{" + ", ".join(f"{json.dumps(k)}: {_text(val)}" for k, val in v.items()) + "}"
    if v is None or isinstance(v, bool):
        return str(v)
    return json.dumps(v)


@dataclass
class _Node:
    """One dotted key prefix of the flat keys: the leaves ending here, the segments below."""

    key: str
    entries: list[Any] = field(default_factory=list)  # (key, value) leaves and child _Nodes, in tree order
    children: dict[str, "_Node"] = field(default_factory=dict)
    tensors: int = 0
    plain: int = 0


def _is_tensor(m: Manifest, key: str, value: Any) -> bool:
    return key in m.tensors and value == {"$tensor": key}


def _trie(leaves: list[tuple[str, Any]], m: Manifest) -> _Node:
    """The leaves by the dotted segments of their keys, in tree order, each node counting its tensors."""
    root = _Node("")
    for key, value in leaves:
        node, tensor = root, _is_tensor(m, key, value)
        for part in key.split(".") if key else []:
            node.tensors += tensor
            node.plain += not tensor
            if part not in node.children:
                node.children[part] = _Node(f"{node.key}.{part}" if node.key else part)
                node.entries.append(node.children[part])
            node = node.children[part]
        node.tensors += tensor
        node.plain += not tensor
        node.entries.append((key, value))
    return root


def _leaves(node: _Node) -> Iterator[tuple[str, Any]]:
    for e in node.entries:
        if isinstance(e, _Node):
            yield from _leaves(e)
        else:
            yield e


class _Rows:
    """The rows of the text view: (key, type column, rest)."""

    def __init__(self, m: Manifest, every: bool) -> None:
        self.m, self.every = m, every
        self.rows: list[tuple[str, str, str]] = []

    def leaf(self, key: str, value: Any) -> None:
        t = self.m.tensors.get(key)
        if t is not None and _is_tensor(self.m, key, value):
            extra = f" -> {t.alias_of}" if t.alias_of else f" {len(t.chunks)} chunk(s)"
            self.rows.append((key, t.dtype, f"{str(list(t.shape)):<20}{extra}"))
            return
        text = _text(value)
        if not self.every and len(text) > CUT:
            text = text[:CUT - 3] + "..."
        self.rows.append((key or "<root>", _type_name(value), text))

    def node(self, node: _Node) -> None:
        """A key's subtree: whole, or its tensors summed up on one row when they are many
        (the plain values among them still one row each)."""
        if self.every or node.tensors <= SHOW_TENSORS:
            for key, value in _leaves(node):
                self.leaf(key, value)
            return
        summed: list[str] = []
        at = len(self.rows)
        for e in node.entries:
            if isinstance(e, _Node) and e.plain == 0:
                summed += [k for k, _ in _leaves(e)]
            elif isinstance(e, _Node):
                self.node(e)
            elif _is_tensor(self.m, *e):
                summed.append(e[0])
            else:
                self.leaf(*e)
        if summed:
            self.rows.insert(at, (node.key, "", self._summary(summed)))

    def _summary(self, keys: list[str]) -> str:
        entries = [self.m.tensors[k] for k in keys]
        count = TensorCount(len(entries), sum(1 for t in entries if t.alias_of))
        dtypes = Counter(t.dtype for t in entries)
        kinds = ", ".join(d if len(dtypes) == 1 else f"{d} ({n})" for d, n in dtypes.most_common())
        nbytes = sum(tensor_bytes(self.m, k) for k, t in zip(keys, entries) if not t.alias_of)
        return f"{count}: {kinds}, {nbytes / 1e6:.2f} MB"


def tree_rows(m: Manifest, every: bool) -> list[tuple[str, str, str]]:
    """The text view's rows: each key under the root summed up or listed (see the module docstring)."""
    rows = _Rows(m, every)
    for e in _trie(list(iter_leaves(m.tree)), m).entries:
        if isinstance(e, _Node):
            rows.node(e)
        else:
            rows.leaf(*e)
    return rows.rows


def cmd_info(args: argparse.Namespace) -> int:
    """A checkpoint's header and tree (``--all``: every row whole), or one JSON document."""
    from ..load.session import ReadSession

    session = ReadSession(args.uri, storage_options(args))
    if args.manifest:
        from ..format.manifest import to_json_obj

        print(json.dumps(to_json_obj(session.inspect(True)), indent=1))
        return 0
    if args.json:  # no chunks in it: a v2 checkpoint's rank indexes are not fetched
        print(json.dumps(info_document(args.uri, session.inspect(False)), indent=1))
        return 0
    m = session.inspect(True)
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m.created))
    print(f"{args.uri}\n  format v{m.format_version}, written by {m.writer or '?'} at {created}")
    print(f"  {m.tensor_count()}, {m.nbytes() / 1e6:.2f} MB in {len(m.blobs)} blob(s); "
          f"metadata {json.dumps(m.metadata)}")
    if m.rank_trees:
        print(f"  plain values differ across the {len(m.rank_trees)} ranks: rank 0's below (--json: every rank's)")
    rows = tree_rows(m, args.all)
    width = min(max((len(k) for k, _, _ in rows), default=10), 60)
    for key, kind, rest in rows:
        print(f"  {key:<{width}} {kind:<14} {rest}" if kind else f"  {key:<{width}} {rest}")
    return 0


def add_info(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "info", "show what a checkpoint holds: tensors and plain values", cmd_info)
    p.add_argument("uri")
    p.add_argument("--all", action="store_true",
                   help=f"every tensor on its own row and every value whole (default: groups of more than "
                        f"{SHOW_TENSORS} tensors summed up, values cut to {CUT} characters)")
    p.add_argument("--json", action="store_true", help=f"the whole tree as JSON (schema {SCHEMA}, docs/cli.md)")
    p.add_argument("--manifest", action="store_true", help="the manifest itself, as JSON")
