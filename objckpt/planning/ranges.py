"""Turning wanted byte spans into ranged GETs (pure).

Spans of one object are sorted and merged when the gap between them is small
(one request instead of two costs less than the wasted bytes), but merged
requests never exceed ``max_request``; a single span larger than
``split_above`` is split into pieces fetched concurrently.  Each request
records which spans it serves, so the engine can read straight into the
destination when a request serves exactly one span.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, NamedTuple


@dataclass(frozen=True)
class Span:
    """``length`` bytes at ``offset`` of object ``obj``, wanted for ``target``."""

    obj: Hashable
    offset: int
    length: int
    target: Hashable


class RequestPiece(NamedTuple):
    """Bytes of one span that one request carries."""

    span: Span
    at: int  # where the piece starts inside the request
    in_span: int  # where it starts inside the span
    nbytes: int


@dataclass
class Request:
    obj: Hashable
    offset: int
    length: int
    pieces: list[RequestPiece] = field(default_factory=list)

    @property
    def direct(self) -> bool:
        """True when the request's bytes all belong, in order, to one span."""
        return len(self.pieces) == 1 and self.pieces[0][1] == 0 and self.pieces[0][3] == self.length


def plan_requests(spans: Iterable[Span], *, merge_gap: int = 256 << 10, max_request: int = 32 << 20,
                  split_above: int = 32 << 20, split_into: int = 16 << 20) -> list[Request]:
    """Requests covering ``spans`` (each span's bytes fetched exactly once)."""
    by_obj: dict[Hashable, list[Span]] = {}
    for s in spans:
        if s.length > 0:
            by_obj.setdefault(s.obj, []).append(s)
    out: list[Request] = []
    for obj, group in by_obj.items():
        group.sort(key=lambda s: (s.offset, s.length))
        cur: Request | None = None
        for s in group:
            if s.length > split_above:
                if cur is not None:
                    out.append(cur)
                    cur = None
                pos = 0
                while pos < s.length:
                    n = min(split_into, s.length - pos)
                    out.append(Request(obj, s.offset + pos, n, [RequestPiece(s, 0, pos, n)]))
                    pos += n
                continue
            end = s.offset + s.length
            if (
                cur is not None
                and s.offset - (cur.offset + cur.length) <= merge_gap
                and max(end, cur.offset + cur.length) - cur.offset <= max_request
                and s.offset >= cur.offset
            ):
                cur.length = max(cur.length, end - cur.offset)
                cur.pieces.append(RequestPiece(s, s.offset - cur.offset, 0, s.length))
            else:
                if cur is not None:
                    out.append(cur)
                cur = Request(obj, s.offset, s.length, [RequestPiece(s, 0, 0, s.length)])
        if cur is not None:
            out.append(cur)
    return out
