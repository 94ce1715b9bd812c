"""Packed integer columns (format v5): one base64 string of little-endian unsigned
integers, instead of a JSON list of numbers.

Two things of a manifest are long runs of integers that no reader looks at one by one:

* a chunk's block crcs (uint32): one per 1 KiB block of every chunk for a state of many
  small tensors, 204,800 for 3,200 tensors of 64 KiB, three quarters of the manifest's
  text (2.2 of 2.9 MB) as JSON numbers;
* the blob and rank-index tables (sizes as uint64, ranks and crcs as uint32): two entries
  per rank, 131,072 at 65,536 ranks, most of a 14 MB manifest as JSON objects.

Packed they cost 5.3 characters per uint32 (10.7 per uint64) instead of ~11, are encoded
and parsed in C (``struct``, ``binascii``), and are checked without a Python step per
value: a reader learns the count from the length, and every uint32 is a valid crc.
Older manifests (v1 to v4) keep the list forms; readers accept both, the strings only
where the manifest's version allows them.
"""
from __future__ import annotations

import binascii
import struct
from typing import Any, Optional, Sequence

#: the first manifest version that may store packed columns
PACKED_VERSION = 5
_CODES = {4: "I", 8: "Q"}


def pack(values: Sequence[int], width: int = 4) -> str:
    """The packed form of ``values`` (each below 2**(8*width)): base64, no newline."""
    return binascii.b2a_base64(struct.pack(f"<{len(values)}{_CODES[width]}", *values),
                               newline=False).decode("ascii")


def unpack(value: Any, count: Optional[int], width: int = 4) -> Optional[tuple[int, ...]]:
    """The values of a packed string (exactly ``count`` of them, or as many as it holds
    when ``count`` is None), or None when ``value`` is not the canonical base64 of whole
    ``width``-byte little-endian values (a reader then reports the field malformed).
    Canonical: a string that decodes to the right bytes but is not what :func:`pack`
    writes (whitespace, other padding bits) is refused, so that the manifest's canonical
    crc covers one spelling of each value."""
    if type(value) is not str:
        return None
    if count is not None and len(value) != 4 * -(-width * count // 3):
        return None
    try:
        raw = binascii.a2b_base64(value)  # lenient (skips stray characters): the round trip below is the check
    except (binascii.Error, ValueError):
        return None
    n = len(raw) // width
    if len(raw) != n * width or (count is not None and n != count):
        return None
    if binascii.b2a_base64(raw, newline=False).decode("ascii") != value:
        return None
    return struct.unpack(f"<{n}{_CODES[width]}", raw)
