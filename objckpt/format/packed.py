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
from typing import Any, Iterator, Optional, Sequence, Union, overload

#: the first manifest version that may store packed columns
PACKED_VERSION = 5
_CODES = {4: "I", 8: "Q"}


class PackedCrcs(Sequence[int]):
    """A chunk's block crcs as a v5 manifest or rank index stores them: the packed bytes,
    a value unpacked only when read.  A load reads most chunks whole and checks them by
    their whole crc32c, so a decode that made every block crc an int object (204,800 for
    3,200 tensors of 64 KiB) made them for nothing; a partial read unpacks the few blocks
    it widens to.  Equal to the tuple of its values (and hashes like it)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def __len__(self) -> int:
        return len(self._raw) >> 2

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[int, tuple[int, ...]]:
        if isinstance(i, slice):
            return self.values()[i]
        n = len(self._raw) >> 2
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"block crc {i} out of range ({n} blocks)")
        return struct.unpack_from("<I", self._raw, 4 * i)[0]

    def values(self) -> tuple[int, ...]:
        return struct.unpack(f"<{len(self._raw) >> 2}I", self._raw)

    def __iter__(self) -> Iterator[int]:
        return iter(self.values())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedCrcs):
            return self._raw == other._raw
        if isinstance(other, (tuple, list)):
            return self.values() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.values())

    def __repr__(self) -> str:
        return repr(self.values())


def pack(values: Sequence[int], width: int = 4) -> str:
    """The packed form of ``values`` (each below 2**(8*width)): base64, no newline."""
    if isinstance(values, PackedCrcs) and width == 4:
        return binascii.b2a_base64(values._raw, newline=False).decode("ascii")
    return binascii.b2a_base64(struct.pack(f"<{len(values)}{_CODES[width]}", *values),
                               newline=False).decode("ascii")


def unpack_crcs(value: Any, count: int) -> Optional[PackedCrcs]:
    """:func:`unpack` of ``count`` crcs, left packed (:class:`PackedCrcs`): the same checks."""
    raw = _checked_bytes(value, count, 4)
    return None if raw is None else PackedCrcs(raw)


def unpack(value: Any, count: Optional[int], width: int = 4) -> Optional[tuple[int, ...]]:
    """The values of a packed string (exactly ``count`` of them, or as many as it holds
    when ``count`` is None), or None when ``value`` is not the canonical base64 of whole
    ``width``-byte little-endian values (a reader then reports the field malformed).
    Canonical: a string that decodes to the right bytes but is not what :func:`pack`
    writes (whitespace, other padding bits) is refused, so that the manifest's canonical
    crc covers one spelling of each value."""
    raw = _checked_bytes(value, count, width)
    return None if raw is None else struct.unpack(f"<{len(raw) // width}{_CODES[width]}", raw)


def _checked_bytes(value: Any, count: Optional[int], width: int) -> Optional[bytes]:
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
    return raw
