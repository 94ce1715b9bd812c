"""Boxes of a global tensor: (global offsets, shape), and their intersection (pure).

A box is how every layer speaks of "part of a tensor": what a rank holds, what
a stored chunk covers, what a load target wants.  One definition for all of them.
"""
from __future__ import annotations

from typing import Optional, Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, shape)


def whole(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple(0 for _ in shape), tuple(int(d) for d in shape)


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common box of ``a`` and ``b``, None when they do not overlap."""
    (ao, ash), (bo, bsh) = a, b
    offs, shape = [], []
    for x0, xs, y0, ys in zip(ao, ash, bo, bsh):
        lo, hi = max(x0, y0), min(x0 + xs, y0 + ys)
        if hi <= lo:
            return None
        offs.append(lo)
        shape.append(hi - lo)
    return tuple(offs), tuple(shape)


def rows_of(box: Box, lo: int, hi: int) -> Box:
    """Rows [lo, hi) (dim 0, relative to ``box``) of ``box``; a 0-d box is itself."""
    off, shape = box
    if not shape:
        return box
    return (off[0] + lo,) + tuple(off[1:]), (hi - lo,) + tuple(shape[1:])
