"""Turning wanted byte spans into ranged GETs (pure).

Spans of one object are sorted and merged when the gap between them is small
(one request instead of two costs less than the wasted bytes), but merged
requests never exceed ``max_request``.  A gap is small when it is at most
``merge_gap`` *and* the gap bytes of the merged request stay within
``gap_share`` of its wanted bytes (gaps up to ``free_gap``, chunk alignment
padding, always merge): a resharded read's gaps are other ranks' rows, and
merging every gap under a fixed 256 KiB made a tiny Llama's ranks fetch whole
blobs, 2-3x their share.  A single span larger than
``split_above`` is split into pieces fetched concurrently.  Each request
records which spans it serves, so the engine can read straight into the
destination when a request serves exactly one span.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, NamedTuple


class Span(NamedTuple):
    """``length`` bytes at ``offset`` of object ``obj``, wanted for ``target``.  A named tuple,
    not a frozen dataclass: a load of many small tensors makes one per tensor, and a frozen
    dataclass's construction costs ~2.5x as much."""

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


#: gaps merged whatever their share: the padding that aligns chunks to 64 bytes
FREE_GAP = 64
#: gap bytes a merged request may carry, as a share of the span bytes it carries
GAP_SHARE = 1 / 32


def plan_requests(spans: Iterable[Span], *, merge_gap: int = 256 << 10, max_request: int = 32 << 20,
                  split_above: int = 32 << 20, split_into: int = 16 << 20, gap_share: float = GAP_SHARE,
                  free_gap: int = FREE_GAP) -> list[Request]:
    """Requests covering ``spans`` (each span's bytes fetched exactly once); the
    gap bytes fetched are at most ``free_gap`` per span plus ``gap_share`` of the span bytes."""
    by_obj: dict[Hashable, list[Span]] = {}
    for s in spans:
        if s.length > 0:
            by_obj.setdefault(s.obj, []).append(s)
    out: list[Request] = []
    for obj, group in by_obj.items():
        group.sort(key=lambda s: (s.offset, s.length))
        cur: Request | None = None
        cur_off = cur_end = 0  # cur's bytes: [cur_off, cur_end)
        cur_gaps = 0  # bytes of cur that no span wants
        for s in group:
            off, length = s.offset, s.length
            if length > split_above:
                if cur is not None:
                    cur.length = cur_end - cur_off
                    out.append(cur)
                    cur = None
                pos = 0
                while pos < length:
                    n = min(split_into, length - pos)
                    out.append(Request(obj, off + pos, n, [RequestPiece(s, 0, pos, n)]))
                    pos += n
                continue
            end = off + length
            if cur is not None:
                gap = off - cur_end
                merged = max(end, cur_end) - cur_off
                if (gap <= merge_gap and (gap <= free_gap or cur_gaps + gap <= gap_share * (merged - cur_gaps - gap))
                        and merged <= max_request and off >= cur_off):
                    cur_gaps += max(gap, 0)
                    cur_end = max(cur_end, end)
                    cur.pieces.append(RequestPiece(s, off - cur_off, 0, length))
                    continue
                cur.length = cur_end - cur_off
                out.append(cur)
            cur = Request(obj, off, length, [RequestPiece(s, 0, 0, length)])
            cur_off, cur_end, cur_gaps = off, end, 0
        if cur is not None:
            cur.length = cur_end - cur_off
            out.append(cur)
    return out

