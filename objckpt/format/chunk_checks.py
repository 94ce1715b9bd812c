"""The checks of a chunk as stored (manifest chunks and rank index records): the common
case in as few Python steps as the checks allow, since a state of many small tensors
has thousands of chunks and each is checked on every decode."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from typing_extensions import TypeGuard

from . import packed as _blocks
from .entries import Chunk


def crc_list(v: Any) -> "TypeGuard[list[int]]":
    """A list of crc32c values: JSON integers (not bools) in ``[0, 2**32)``.  Checked in C
    (the set of the items' types, then min and max): a manifest or rank index holds one per
    crc block, hundreds of thousands for a model of many small tensors, and a Python check
    per item cost more than parsing them (67 of a decode's 230 ms for 210,800 of them)."""
    return type(v) is list and (not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) < 1 << 32))


def block_list(value: Any, length: int, crc_block: int, packed: bool) -> Optional[Sequence[int]]:
    """A chunk's block crcs as stored (``value``; None: absent) for a chunk of ``length``
    bytes, checked: () when absent, else exactly ``ceil(length / crc_block)`` crcs, as a
    list of integers (every version) or packed (``packed``: v5 and later; kept packed,
    :class:`~objckpt.format.packed.PackedCrcs`).  None when malformed.  Shared by the
    manifest and the rank indexes."""
    if value is None or (type(value) is list and not value):
        return ()
    if crc_block <= 0:
        return None
    n = -(-length // crc_block)
    if type(value) is str:
        return _blocks.unpack_crcs(value, n) if packed else None
    return tuple(value) if crc_list(value) and len(value) == n else None


def plain_chunk(c: Any, shape: tuple[int, ...], sizes: list[int], isz: int, crc_block: int,
                 packed: bool) -> Optional[Chunk]:
    """The chunk ``c`` (of a tensor of ``shape`` and ``isz``-byte items, in blobs of
    ``sizes`` bytes) when it passes every check of the full path, in as few Python steps
    as the checks allow (a state of many small tensors has thousands); None sends it to the
    full checks, which name what is wrong."""
    if type(c) is not dict:
        return None
    o, s, b, off, ln, crc = (c.get("offsets"), c.get("shape"), c.get("blob"), c.get("offset"), c.get("length"),
                             c.get("crc32c"))
    if not (type(o) is list and type(s) is list and type(b) is int and type(off) is int and type(ln) is int
            and type(crc) is int and len(o) == len(s) == len(shape)):
        return None
    if not (0 <= b < len(sizes) and 0 <= off and 0 <= ln and off + ln <= sizes[b] and 0 <= crc < 1 << 32):
        return None  # sizes are below MAX_INT (checked), so are offset and length
    for x, n, d in zip(o, s, shape):
        if type(x) is not int or type(n) is not int or x < 0 or n < 0 or x + n > d:
            return None
    if isz and ln != math.prod(s) * isz:
        return None
    blocks = block_list(c.get("block_crc32c"), ln, crc_block, packed)
    return None if blocks is None else Chunk(tuple(o), tuple(s), b, off, ln, crc, blocks)


def chunk_blocks(c: dict, crc_block: int, packed: bool) -> Optional[tuple[int, ...]]:
    return block_list(c.get("block_crc32c"), c["length"], crc_block, packed)
