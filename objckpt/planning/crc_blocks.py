"""Choosing a save's crc block size (pure): small enough that resharded reads stay
near the bytes they need, large enough that the block crcs stay a small index.

A reader that needs only part of a chunk must fetch whole crc blocks to verify
what it reads, so every cut through a chunk (a rank of another world size
starting or ending inside it) costs up to one block of extra bytes.  With a
fixed 1 MiB block a tiny Llama's 32-128 KB shards were fetched whole: 2-3x the
bytes each rank needed.  The block is therefore chosen from the chunks a rank
stores: the largest power of two whose estimated waste, one block per chunk
(a whole chunk when it is shorter), is at most :data:`WASTE` of the bytes.
Chunks at or under :data:`MIN_BLOCK` carry only their whole crc (they are read
whole) and are left out of the estimate: a block crc per few hundred bytes
would cost more index than it saves.  The manifest records one block size
(``crc_block``), so the ranks agree on the smallest of their choices.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Iterable, Optional

MAX_BLOCK = 1 << 20
#: the chunk length the estimate assumes when a save leaves the part size to the endpoint
DEFAULT_PART = 16 << 20
MIN_BLOCK = 1 << 10
#: estimated widening waste allowed, as a fraction of the bytes stored: the share of gap bytes a merged
#: read may carry too (planning/ranges.GAP_SHARE).  It was 1/64: 3,200 tensors of 64 KiB then had 1 KiB
#: blocks, 204,800 block crcs a save, a fifth of its time (docs/benchmarks.md, "Many small tensors")
WASTE = 1 / 32


def chunk_lengths(box_bytes: int, part_size: int) -> list[int]:
    """Lengths of the chunks a box of ``box_bytes`` is stored as: runs of at most
    ``part_size`` bytes (an estimate: runs are whole rows)."""
    if box_bytes <= 0:
        return []
    n = -(-box_bytes // max(part_size, 1))
    return [box_bytes // n + (1 if i < box_bytes % n else 0) for i in range(n)]


def choose(lengths: Iterable[int], *, max_block: int = MAX_BLOCK, min_block: int = MIN_BLOCK,
           waste: float = WASTE) -> int:
    """The largest power-of-two block in [``min_block``, ``max_block``] whose waste
    estimate over the chunks of ``lengths`` longer than ``min_block``, the sum of
    min(block, length), is at most ``waste`` of their bytes (``min_block`` when none
    is; ``max_block`` when there are no such chunks)."""
    big = sorted(n for n in lengths if n > min_block)
    total = sum(big)
    prefix = list(itertools.accumulate(big, initial=0))  # prefix[i]: the i shortest chunks' bytes

    def cost(block: int) -> int:  # sum(min(block, n) for n in big), from the sorted lengths
        short = bisect.bisect_left(big, block)  # chunks shorter than a block: read whole
        return prefix[short] + block * (len(big) - short)

    block = 1 << max(max_block, 1).bit_length() - 1  # a power of two, not above max_block
    while block > min_block and cost(block) > waste * total:
        block >>= 1
    return max(block, min(min_block, max_block))


def for_boxes(box_bytes: Iterable[int], part_size: Optional[int]) -> int:
    """The block :func:`choose` picks for boxes of ``box_bytes`` bytes stored as chunks of
    at most ``part_size`` (16 MiB when the size is left to the endpoint's shape)."""
    step = part_size or DEFAULT_PART
    lengths: list[int] = []
    for b in box_bytes:
        if 0 < b <= step:  # one chunk (a small tensor: the common case)
            lengths.append(b)
        else:
            lengths.extend(chunk_lengths(b, step))
    return choose(lengths)
