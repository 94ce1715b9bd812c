"""crc32c over buffers (hardware-accelerated, GIL released), and combining.

Chunks carry one crc32c over their bytes and, when larger than the crc block,
one per block (so a partial read can be verified).  The chunk crc is combined
from the block crcs instead of hashing the bytes twice: ``crc(A+B)`` follows
from ``crc(A)``, ``crc(B)`` and ``len(B)`` by multiplying with the GF(2)
operator that appends ``len(B)`` zero bytes (as zlib's ``crc32_combine``); the
operator for each length is computed once and cached.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import crc32c as _crc32c

_POLY = 0x82F63B78  # Castagnoli, reflected


def crc32c(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """crc32c of ``data`` continuing from ``value`` (0 to start)."""
    return _crc32c.crc32c(data, value)


def _times(mat: Sequence[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: Sequence[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


@lru_cache(maxsize=64)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The operator that appends ``nbytes`` zero bytes to a crc state."""
    op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):
        op = _square(op)  # 8 zero bits = one zero byte
    result = None
    n = nbytes
    while n:
        if n & 1:
            result = op if result is None else [_times(op, result[k]) for k in range(32)]
        n >>= 1
        if n:
            op = _square(op)
    return tuple(result if result is not None else [1 << k for k in range(32)])


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of A+B from crc32c(A), crc32c(B) and len(B)."""
    if len2 == 0:
        return crc1
    return _times(_zeros_operator(len2), crc1) ^ crc2


def block_crcs(data: memoryview, block: int) -> tuple[int, list[int]]:
    """(crc of all of ``data``, crc of each ``block``-byte block); no blocks if it fits in one."""
    n = len(data)
    if block <= 0 or n <= block:
        return crc32c(data), []
    blocks = [crc32c(data[i : i + block]) for i in range(0, n, block)]
    total = blocks[0]
    for i, c in enumerate(blocks[1:], 1):
        total = crc32c_combine(total, c, min(block, n - i * block))
    return total, blocks


def combine_blocks(blocks: Sequence[int], length: int, block: int) -> int:
    """The crc32c of ``length`` bytes from the crcs of its ``block``-byte blocks (the last one shorter)."""
    if not blocks:
        return 0
    total = blocks[0]
    for i, c in enumerate(blocks[1:], 1):
        total = crc32c_combine(total, c, min(block, length - i * block))
    return total
