"""Do boxes tile a box exactly: every box inside it, no two overlapping, no gap (pure).

A manifest's chunks are only trusted to hold a tensor if they tile it: an
element count alone accepts a chunk moved by one row (one gap, one overlap,
every crc still valid), and the load then returns rows never written.

Inside + pairwise disjoint + volumes summing to the whole  <=>  exact tiling.
Disjointness is checked by a sweep along dim 0 (boxes sorted by offsets): a
box is compared only with the *active* boxes (those whose dim-0 range holds
its dim-0 start).  All active boxes contain that dim-0 coordinate, so, once
known disjoint, their projections onto dims 1.. are disjoint too; they are
kept sorted by dim-1 start, and a new box is compared with those whose dim-1
start lies within the longest dim-1 extent before its own.  For row-split,
column-split and grid layouts that is a handful of comparisons per box:
O(n log n) overall.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .boxes import Box


@dataclass(frozen=True)
class TilingDefect:
    """Why boxes do not tile a box: ``kind`` is "rank", "outside", "overlap" or "gap"."""

    kind: str
    #: the offending boxes (one for "rank"/"outside", two for "overlap", none for "gap")
    boxes: tuple[Box, ...] = ()
    #: elements the boxes hold, and elements the bounds hold ("gap")
    held: int = 0
    wanted: int = 0


def _overlap_from(a: Box, b: Box, dim: int) -> bool:
    """Whether ``a`` and ``b`` overlap in every dim from ``dim`` on."""
    return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a[0][dim:], a[1][dim:], b[0][dim:], b[1][dim:]))


def find_overlap(boxes: Sequence[Box]) -> Optional[tuple[Box, Box]]:
    """Two of ``boxes`` (all of one rank, positive volume) that overlap, or None."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0], boxes[1]
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0])
    ending: list[tuple[int, int]] = []  # heap of (dim-0 end, index) of active boxes
    if ndim == 1:
        for i in order:
            (o0,), (n0,) = boxes[i]
            while ending and ending[0][0] <= o0:
                heapq.heappop(ending)
            if ending:
                return boxes[ending[0][1]], boxes[i]
            heapq.heappush(ending, (o0 + n0, i))
        return None
    longest1 = max(b[1][1] for b in boxes)
    starts: list[tuple[int, int]] = []  # active boxes by (dim-1 start, index)
    dead: set[int] = set()
    for i in order:
        b = boxes[i]
        while ending and ending[0][0] <= b[0][0]:
            dead.add(heapq.heappop(ending)[1])
        if len(dead) > 64 and 2 * len(dead) > len(starts):  # amortised compaction
            starts = [s for s in starts if s[1] not in dead]
            dead.clear()
        s1, e1 = b[0][1], b[0][1] + b[1][1]
        j = bisect.bisect_left(starts, (e1, -1)) - 1
        while j >= 0 and starts[j][0] + longest1 > s1:
            k = starts[j][1]
            if k not in dead and _overlap_from(boxes[k], b, 1):
                return boxes[k], b
            j -= 1
        bisect.insort(starts, (s1, i))
        heapq.heappush(ending, (b[0][0] + b[1][0], i))
    return None


def tiling_defect(boxes: Sequence[Box], bounds: Box) -> Optional[TilingDefect]:
    """None when ``boxes`` tile ``bounds`` exactly, else the first defect found."""
    lo, extent = bounds
    ndim = len(extent)
    held = 0
    solid: list[Box] = []
    for b in boxes:
        offs, shape = b
        if len(offs) != ndim or len(shape) != ndim:
            return TilingDefect("rank", (b,))
        if not all(0 <= n and lo_d <= o and o + n <= lo_d + e_d
                   for o, n, lo_d, e_d in zip(offs, shape, lo, extent)):
            return TilingDefect("outside", (b,))
        v = math.prod(shape)
        if v:
            held += v
            solid.append(b)
    pair = find_overlap(solid)
    if pair is not None:
        return TilingDefect("overlap", pair)
    wanted = math.prod(extent)
    if held != wanted or (ndim == 0 and len(boxes) != 1):
        return TilingDefect("gap", (), held, wanted)
    return None


def describe(defect: TilingDefect) -> str:
    """The defect in words, naming the offending boxes by offsets and shape."""
    named = " and ".join(f"the chunk at {list(o)} of shape {list(n)}" for o, n in defect.boxes)
    if defect.kind == "rank":
        return f"{named} has the wrong number of dimensions"
    if defect.kind == "outside":
        return f"{named} lies outside it"
    if defect.kind == "overlap":
        return f"{named} overlap"
    return f"its chunks hold {defect.held} elements of {defect.wanted} (a gap)"
