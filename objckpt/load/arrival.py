"""Checking reads against crcs computed as their bytes arrived.

A load used to hash every destination once all its bytes were in: a second
pass over memory that had long left the CPU cache (a 180 MiB embedding, or
the ~130 MiB a dozen concurrent 8 MiB GETs hold in flight).  Where the store
can hash while it receives (``get_range_tallied``: the direct S3 path), each
request gets a :class:`~objckpt.checksum.CellCrcs` cut at every piece and
crc-check boundary it carries; the receiving thread hashes each piece right
after the kernel copied it, at about twice the speed (22 vs 11 GB/s), and a
read's checks are then judged by combining its cells' crcs, without touching
its bytes again.  The bytes hashed are those in their final place, as before.
A read any of whose checks is not exactly tiled by cells (a store that cannot
tally, a request served from scratch) is hashed afterwards, as before.
"""
from __future__ import annotations

import bisect
from typing import Optional, Protocol, Sequence

from ..checksum import CellCrcs, crc32c_combine
from ..planning.ranges import Request

#: a failed check and the crc its bytes have
Mismatch = tuple[tuple[int, int, int, str], int]


class _Read(Protocol):
    checks: tuple[tuple[int, int, int, str], ...]


class Tallies:
    """The cells hashed on arrival for each read (by index), and the verdicts drawn from them."""

    def __init__(self, reads: Sequence[_Read]) -> None:
        self._reads = reads
        self._bounds: dict[int, list[int]] = {}
        self._cells: dict[int, list[tuple[int, int, int]]] = {}
        #: the verdicts drawn while recording (read -> its mismatch, or None)
        self._judged: dict[int, Optional[Mismatch]] = {}

    def _check_bounds(self, i: int) -> list[int]:
        b = self._bounds.get(i)
        if b is None:
            b = self._bounds[i] = sorted({x for at, n, _, _ in self._reads[i].checks for x in (at, at + n)})
        return b

    def for_request(self, req: Request) -> Optional[CellCrcs]:
        """The tally for ``req``: cut where a piece or a check of one of its reads starts
        or ends; None when none of its reads has checks."""
        cuts: list[int] = []
        for span, at, in_span, n in req.pieces:
            checks = self._reads[span.target].checks  # type: ignore[index]
            if not checks:
                continue
            cuts += (at, at + n)
            if len(checks) == 1 and checks[0][0] <= in_span and in_span + n <= checks[0][0] + checks[0][1]:
                continue  # one check around the piece (a whole chunk read): no bound inside it
            bounds = self._check_bounds(span.target)  # type: ignore[arg-type]
            lo = bisect.bisect_right(bounds, in_span)
            hi = bisect.bisect_left(bounds, in_span + n)
            cuts.extend(at + b - in_span for b in bounds[lo:hi])
        return CellCrcs(cuts, req.length) if cuts else None

    def record(self, req: Request, tally: CellCrcs) -> None:
        """Hand each read the cells of ``req`` that fell in its pieces (nothing when the
        store did not feed the whole stream).  A read that is one piece of ``req`` with one
        check over all of it (a whole chunk read into place: most reads of a load) is judged
        here, from its one cell."""
        cells = tally.cells()
        if cells is None:
            return
        k, ncells = 0, len(cells)
        for span, at, in_span, n in req.pieces:
            i = span.target
            checks = self._reads[i].checks  # type: ignore[index]
            if not checks:
                continue
            if not (k < ncells and cells[k][0] == at):
                k = bisect.bisect_left(cells, (at,))  # (pieces out of order, or a gap before this one)
            if (k < ncells and cells[k][1] == n and len(checks) == 1 and in_span == 0 and checks[0][0] == 0
                    and checks[0][1] == n and i not in self._cells):
                crc, check = cells[k][2], checks[0]
                self._judged[i] = None if crc == check[2] else (check, crc)  # type: ignore[index]
                k += 1
                continue
            mine = self._cells.setdefault(i, [])  # type: ignore[arg-type]
            while k < ncells and cells[k][0] < at + n:
                s, ln, crc = cells[k]
                mine.append((in_span + s - at, ln, crc))
                k += 1

    def verdict(self, i: int) -> tuple[bool, Optional[Mismatch]]:
        """(judged, first mismatch): judged is False when some check of read ``i`` is not
        exactly tiled by cells hashed on arrival (hash its bytes instead)."""
        if i in self._judged:
            return True, self._judged.pop(i)
        cells = self._cells.pop(i, None)
        if not cells:
            return False, None
        checks = self._reads[i].checks
        if len(cells) == 1 and len(checks) == 1:  # one piece, one check (a whole chunk read)
            (s, ln, crc), check = cells[0], checks[0]
            if s != check[0] or ln != check[1]:
                return False, None
            return True, (None if crc == check[2] else (check, crc))
        cells.sort()
        starts = [c[0] for c in cells]
        for check in checks:
            at, n, want, _ = check
            k = bisect.bisect_left(starts, at)
            if k == len(cells) or cells[k][0] != at:
                return False, None
            pos, crc = at, 0
            while pos < at + n:
                if k == len(cells) or cells[k][0] != pos or pos + cells[k][1] > at + n:
                    return False, None
                crc = crc32c_combine(crc, cells[k][2], cells[k][1]) if pos > at else cells[k][2]
                pos += cells[k][1]
                k += 1
            if crc != want:
                return True, (check, crc)
        return True, None
