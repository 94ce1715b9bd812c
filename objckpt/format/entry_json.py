"""A manifest's tensor entries as canonical JSON text, written directly (pure).

Sealing a manifest encodes every tensor entry twice, once in the text as stored and
once canonically for the seal's crc (:mod:`objckpt.format.sealed_json`); a state of
3,200 small tensors spent ~50 ms of each save there, building a dict per entry and
chunk and encoding them.  Each entry is now written once, straight from its record, as
its canonical JSON (keys sorted, no spaces, ASCII only), and the seal joins those
texts in both orders (:class:`~objckpt.format.sealed_json.EncodedDict`).  What
``json`` would write is the reference: a value this writer does not know to be plain
(an int that is not exactly ``int``, a string with a character JSON escapes) is left
to ``json`` itself, and tests compare the two on generated entries.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

from .entries import Chunk, TensorEntry
from .packed import pack
from .sealed_json import encode_canonical

#: strings JSON writes as they are: printable ASCII but for the quote and the backslash
_PLAIN = re.compile(r'[ !#-\[\]-~]*\Z')


def json_str(s: str) -> str:
    """``json.dumps(s)`` (ASCII only), without the encoder for a plain string."""
    return f'"{s}"' if _PLAIN.match(s) else json.dumps(s)


def _ints(values: Sequence[int]) -> str:
    return ",".join(map(str, values))


def _all_int(values: Sequence[Any]) -> bool:
    return all(type(v) is int for v in values)


def chunk_dict(c: Chunk) -> dict[str, Any]:
    """A chunk's JSON object (the reference :func:`chunk_text` is checked against)."""
    d = {
        "offsets": list(c.offsets),
        "shape": list(c.shape),
        "blob": c.blob,
        "offset": c.offset,
        "length": c.length,
        "crc32c": c.crc32c,
    }
    if c.block_crc32c:
        d["block_crc32c"] = pack(c.block_crc32c)
    return d


def entry_dict(t: TensorEntry) -> dict[str, Any]:
    """A tensor entry's JSON object (the reference :func:`entry_text` is checked against)."""
    d: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape)}
    if t.alias_of is not None:
        d["alias_of"] = t.alias_of
    elif t.layout is not None:
        lay = t.layout
        d["layout"] = {"mesh": lay.mesh, "placements": list(lay.placements), "split": lay.split, "rot": lay.rot}
    else:
        d["chunks"] = [chunk_dict(c) for c in t.chunks]
    return d


def chunk_text(c: Chunk) -> str:
    """``encode_canonical(chunk_dict(c))``, written directly where every field is plain."""
    if not (type(c.blob) is int and type(c.offset) is int and type(c.length) is int and type(c.crc32c) is int
            and _all_int(c.offsets) and _all_int(c.shape)):
        return encode_canonical(chunk_dict(c))
    blocks = f',"block_crc32c":"{pack(c.block_crc32c)}"' if c.block_crc32c else ""  # (base64: plain)
    return (f'{{"blob":{c.blob}{blocks},"crc32c":{c.crc32c},"length":{c.length},"offset":{c.offset},'
            f'"offsets":[{_ints(c.offsets)}],"shape":[{_ints(c.shape)}]}}')


def entry_text(t: TensorEntry) -> str:
    """``encode_canonical(entry_dict(t))``: the entry's canonical JSON (keys in sorted
    order: ``alias_of``, ``chunks``, ``dtype``, ``layout``, ``shape``)."""
    if not _all_int(t.shape) or type(t.dtype) is not str:
        return encode_canonical(entry_dict(t))
    shape = f'"shape":[{_ints(t.shape)}]}}'
    tail = f'"dtype":{json_str(t.dtype)},{shape}'
    if t.alias_of is not None:
        return f'{{"alias_of":{json_str(t.alias_of)},{tail}' if type(t.alias_of) is str else \
            encode_canonical(entry_dict(t))
    lay = t.layout
    if lay is not None:  # (a symbolic save: every tensor; the chunks are in the rank indexes)
        if not (type(lay.mesh) is int and type(lay.split) is int and type(lay.rot) is int
                and all(type(p) is str for p in lay.placements)):
            return encode_canonical(entry_dict(t))
        places = ",".join([json_str(p) for p in lay.placements])
        return (f'{{"dtype":{json_str(t.dtype)},"layout":{{"mesh":{lay.mesh},"placements":[{places}],'
                f'"rot":{lay.rot},"split":{lay.split}}},{shape}')
    return '{"chunks":[' + ",".join([chunk_text(c) for c in t.chunks]) + "]," + tail


def entry_texts(tensors: dict[str, TensorEntry], text: Callable[[TensorEntry], str] = entry_text
                ) -> list[tuple[str, str, str]]:
    """(key, its JSON string, the entry's canonical JSON) of each tensor, in order: the items
    of the manifest's ``tensors`` as an :class:`~objckpt.format.sealed_json.EncodedDict`."""
    return [(k, json_str(k), text(t)) for k, t in tensors.items()]
