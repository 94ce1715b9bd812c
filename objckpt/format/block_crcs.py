"""How a chunk's block crcs are stored (format v5): one base64 string of packed
little-endian uint32 values, not a JSON list of integers.

A state of many small tensors has one crc per 1 KiB block of every chunk: 204,800 of
them for 3,200 tensors of 64 KiB.  As JSON integers they were three quarters of the
manifest's text (2.2 of 2.9 MB), and encoding, sealing (twice: as written and
canonically) and parsing them was most of a save's commit and of a load's decode.  As
packed bytes they are 5.3 characters each instead of ~11, encoded and parsed in C
(``struct`` and ``binascii``), and a reader learns a chunk's count from the string's
length: the checks need no per-value step (every uint32 is a valid crc).

Older manifests (v1 to v4) and their rank indexes keep the list form; readers accept
both, the string only where the manifest's version allows it.
"""
from __future__ import annotations

import binascii
import struct
from typing import Any, Optional, Sequence

#: the first manifest version whose chunks (and rank index records) may store block crcs packed
PACKED_VERSION = 5


def pack(blocks: Sequence[int]) -> str:
    """The packed form of ``blocks`` (crc32c values below 2**32): base64, no newline."""
    return binascii.b2a_base64(struct.pack(f"<{len(blocks)}I", *blocks), newline=False).decode("ascii")


def unpack(value: Any, count: int) -> Optional[tuple[int, ...]]:
    """The ``count`` crcs of a packed string, or None when ``value`` is not exactly the
    canonical base64 of ``count`` little-endian uint32 values (a reader then reports the
    chunk malformed).  Canonical: a string that decodes to the right bytes but is not what
    :func:`pack` writes (whitespace, other padding bits) is refused, so that the manifest's
    canonical crc covers one spelling of each value."""
    if type(value) is not str or len(value) != 4 * -(-4 * count // 3):
        return None
    try:
        raw = binascii.a2b_base64(value)  # lenient (skips stray characters): the round trip below is the check
    except (binascii.Error, ValueError):
        return None
    if len(raw) != 4 * count or binascii.b2a_base64(raw, newline=False).decode("ascii") != value:
        return None
    return struct.unpack(f"<{count}I", raw)
