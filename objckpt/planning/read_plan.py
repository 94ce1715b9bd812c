"""A load's read plan: from stored chunks to the byte ranges and copies each target needs (pure).

A target (a whole tensor, a DTensor's local shard, an ``objckpt.Shard``) is a
box of the global tensor.  Stored chunks are boxes too, each stored row-major.
For every chunk that overlaps the target (found through an index sorted by
dim-0 start, not a scan of all pairs) the intersection is read either as one
range over the rows it touches, or as one range per row (only the columns
needed), whichever a simple cost model prices lower: bytes moved plus a fixed
price per request.  Ranges are widened to whole crc blocks so every byte read
is verified.

:func:`plan_reads` turns a load's targets into a :class:`ReadPlan`: whole
chunks read straight into destination memory where it allows, the rest into
temporaries, in batches whose temporaries fit a :class:`~objckpt.runtime.memory.Budget`.
The plan is data: it can be printed and tested before a byte moves
(:mod:`objckpt.load.fill` executes it).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

from ..format.manifest import Chunk
from ..runtime.memory import Budget
from .boxes import Box, intersect

#: what one extra request costs, in bytes of transfer it is worth
REQUEST_COST_BYTES = 256 << 10


class Overlap(NamedTuple):
    """A stored chunk and the part of a wanted box it holds."""

    chunk: Chunk
    inter: Box


class ChunkIndex:
    """Chunks of one tensor sorted by dim-0 start, with a running max of dim-0
    ends, so the chunks overlapping a box are found without scanning them all."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        #: the box of the only chunk (most tensors of a single-process save): a box equal to it
        #: is answered without a search
        self.only: Optional[Box] = None
        if len(chunks) == 1:
            c = chunks[0]
            self.chunks, self.only = [c], ((c.offsets, c.shape) if all(c.shape) else None)  # (empty: overlaps nothing)
            self.starts = [c.offsets[0] if c.offsets else 0]
            self.max_end = [(c.offsets[0] + c.shape[0]) if c.offsets else 1]
            return
        self.chunks = sorted(chunks, key=lambda c: c.offsets[0] if c.offsets else 0)
        self.starts = [c.offsets[0] if c.offsets else 0 for c in self.chunks]
        ends = [(c.offsets[0] + c.shape[0]) if c.offsets else 1 for c in self.chunks]
        self.max_end = []
        m = -1
        for e in ends:
            m = max(m, e)
            self.max_end.append(m)

    def overlapping(self, box: Box) -> list[Overlap]:
        if box == self.only:
            return [Overlap(self.chunks[0], self.only)]
        offs, shape = box
        if not offs:  # 0-d
            return [Overlap(c, ((), ())) for c in self.chunks]
        a, b = offs[0], offs[0] + shape[0]
        i = bisect.bisect_left(self.starts, b)
        out = []
        j = i - 1
        while j >= 0 and self.max_end[j] > a:
            inter = intersect((self.chunks[j].offsets, self.chunks[j].shape), box)
            if inter is not None:
                out.append(Overlap(self.chunks[j], inter))
            j -= 1
        out.reverse()
        return out


@dataclass(frozen=True)
class PieceRead:
    """Bytes [lo, hi) of ``chunk`` (chunk-relative) land in a temporary; the
    wanted box is then an as_strided view of it.  ``ranges`` are the byte
    ranges (chunk-relative) actually fetched, each a union of whole crc blocks."""

    chunk: Chunk
    inter: Box  # global box wanted from this chunk
    lo: int
    hi: int
    ranges: tuple[tuple[int, int], ...]
    whole: bool  # the whole chunk is fetched (verified with its chunk crc)
    elem_offset: int  # element offset of inter's first element, relative to lo
    strides: tuple[int, ...]  # element strides of inter inside the temporary


def _row_major_strides(shape: Sequence[int]) -> list[int]:
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return list(reversed(st))


def _widen(ranges: list[tuple[int, int]], block: int, length: int) -> list[tuple[int, int]]:
    """Round each range out to whole crc blocks and merge what then touches."""
    if block <= 0:
        return ranges
    out: list[tuple[int, int]] = []
    for s, e in ranges:
        s2, e2 = s // block * block, min(length, -(-e // block) * block)
        if out and s2 <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e2))
        else:
            out.append((s2, e2))
    return out


def plan_piece(chunk: Chunk, inter: Box, itemsize: int, block: int, verify: bool = True) -> PieceRead:
    """How to fetch ``inter`` (a sub-box of ``chunk``) with the fewest bytes + requests."""
    c_off, c_shape = chunk.offsets, chunk.shape
    i_off, i_shape = inter
    if not c_shape:  # 0-d
        return PieceRead(chunk, inter, 0, chunk.length, ((0, chunk.length),), True, 0, ())
    rel = [o - co for o, co in zip(i_off, c_off)]
    st = _row_major_strides(c_shape)
    row_elems = st[0] if len(c_shape) > 1 else 1
    a, b = rel[0], rel[0] + i_shape[0]
    first = sum(r * s for r, s in zip(rel[1:], st[1:]))
    last = sum((r + n - 1) * s for r, n, s in zip(rel[1:], i_shape[1:], st[1:])) + 1
    run = last - first
    isz = itemsize
    if tuple(i_shape) == tuple(c_shape):
        return PieceRead(chunk, inter, 0, chunk.length, ((0, chunk.length),), True, 0, tuple(st))
    blk = block if verify else 0
    rows_range = [(a * row_elems * isz, b * row_elems * isz)]
    per_row = [((r * row_elems + first) * isz, (r * row_elems + first + run) * isz) for r in range(a, b)]
    options = [_widen(rows_range, blk, chunk.length)]
    if run < row_elems:
        options.append(_widen(per_row, blk, chunk.length))
    best = min(options, key=lambda rs: sum(e - s for s, e in rs) + REQUEST_COST_BYTES * len(rs))
    if verify and blk <= 0:  # no block crcs stored: only the whole chunk can be verified
        best = [(0, chunk.length)]
    lo, hi = best[0][0], best[-1][1]
    whole = lo == 0 and hi == chunk.length and len(best) == 1
    elem_offset = (a * row_elems + first) - lo // isz
    return PieceRead(chunk, inter, lo, hi, tuple(best), whole, elem_offset, tuple(st))


class ReadTarget(NamedTuple):
    """A box of a stored tensor that one destination wants.  (This and the reads below are
    named tuples, not frozen dataclasses: a load of many small tensors makes one of each per
    tensor, and a frozen dataclass costs ~2.5x as much to make.)"""

    key: str  # stored key (aliases resolved)
    box: Box
    itemsize: int
    #: the destination receives stored bytes as they are (contiguous memory, same dtype)
    in_place: bool


class DirectRead(NamedTuple):
    """A whole chunk read straight into target ``target``'s memory at byte ``dest_offset``."""

    target: int
    chunk: Chunk
    dest_offset: int


class StagedRead(NamedTuple):
    """Bytes ``piece.ranges`` of a chunk read into a temporary of ``piece.hi - piece.lo``
    bytes, then copied into the box ``piece.inter`` of target ``target``."""

    target: int
    piece: PieceRead

    @property
    def temp_bytes(self) -> int:
        return self.piece.hi - self.piece.lo


@dataclass
class ReadBatch:
    """Reads whose temporaries are held at the same time (then copied out and freed)."""

    direct: list[DirectRead]
    staged: list[StagedRead]

    @property
    def temp_bytes(self) -> int:
        return sum(r.temp_bytes for r in self.staged)


@dataclass
class ReadPlan:
    targets: list[ReadTarget]
    batches: list[ReadBatch]

    @property
    def fetched_bytes(self) -> int:
        """Bytes the plan fetches from storage (before merging requests)."""
        return sum(r.chunk.length for b in self.batches for r in b.direct) + sum(
            e - s for b in self.batches for r in b.staged for s, e in r.piece.ranges)

    def __str__(self) -> str:
        lines = [f"ReadPlan: {len(self.targets)} target(s), {len(self.batches)} batch(es), "
                 f"{self.fetched_bytes} bytes"]
        for n, b in enumerate(self.batches):
            lines.append(f"  batch {n}: {len(b.direct)} in place, {len(b.staged)} staged, "
                         f"{b.temp_bytes} bytes of temporaries")
        return "\n".join(lines)


Overlapping = Callable[[str, Box], "list[Overlap]"]


def plan_reads(targets: Sequence[ReadTarget], overlapping: Overlapping, crc_block: int, budget: Budget,
               verify: bool = True) -> ReadPlan:
    """How to fill every target: ``overlapping(key, box)`` lists the stored chunks
    that overlap a box (with the intersection).  A chunk that lies wholly inside
    its target and spans the target's full rows is read in place when the target
    allows; every other piece goes through a temporary."""
    reads: list[DirectRead | StagedRead] = []
    staged = False
    for i, (key, box, isz, in_place) in enumerate(targets):
        d_off, d_shape = box
        d_shape = tuple(d_shape)
        for chunk, inter in overlapping(key, box):
            i_off, i_shape = inter
            if in_place and tuple(i_shape) == tuple(chunk.shape) and tuple(i_shape[1:]) == d_shape[1:]:  # inside
                at = (i_off[0] - d_off[0]) * math.prod(d_shape[1:]) * isz if d_shape else 0
                reads.append(DirectRead(i, chunk, at))
            else:
                reads.append(StagedRead(i, plan_piece(chunk, inter, isz, crc_block, verify)))
                staged = True
    if not staged:  # nothing held: one batch
        return ReadPlan(list(targets), [ReadBatch(reads, [])] if reads else [])  # type: ignore[arg-type]
    sizes = [r.temp_bytes if isinstance(r, StagedRead) else 0 for r in reads]
    batches = []
    for run in budget.batches(sizes):
        part = [reads[j] for j in run]
        batches.append(ReadBatch([r for r in part if isinstance(r, DirectRead)],
                                 [r for r in part if isinstance(r, StagedRead)]))
    return ReadPlan(list(targets), batches)
