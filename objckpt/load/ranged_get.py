"""Fetch tensor chunks with concurrent ranged GETs, straight into place.

Each wanted byte range is a span of a blob with a destination: a slice of host
memory (the caller's own CPU tensor when it is contiguous and of the stored
dtype, else a temporary).  Spans become requests (merged across small gaps,
split when large); a request that serves exactly one span reads directly into
the destination, others scatter into destinations and scratch for the gaps.
Once all of a chunk's bytes are in, its crc32c is checked, from crcs the
receiving threads computed as the bytes landed where the store can
(:mod:`.arrival`), else by hashing the destination; a mismatch names tensor,
blob and offset.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, NamedTuple, Optional, Sequence

from ..runtime import loop as _runtime
from ..checksum import crc32c
from ..errors import BlobMissingError, CorruptCheckpointError, NotFoundError
from ..format.manifest import Chunk
from ..planning.ranges import Request, Span, plan_requests
from ..results import IOStats
from ..storage.base import ObjectStore
from ..storage.shape import shape_for
from . import prefault
from .arrival import Tallies


#: one crc check of a read: (offset in its destination, length, crc32c, what); ``what`` says
#: which bytes they are, as text or as (block number, chunk offsets), -1 for the whole chunk,
#: put in words only when the check fails (:func:`check_name`): a load of thousands of
#: chunks formats none of them
Check = tuple[int, int, int, Any]


class RangeRead(NamedTuple):
    """Fetch ``len(dest)`` bytes of ``blob_key`` from ``offset`` into ``dest``, then
    check each :data:`Check` ``(offset in dest, length, crc32c, what)`` of ``checks``.
    (A named tuple: a load of many small tensors makes one per tensor.)"""

    key: str
    blob_key: str
    offset: int
    dest: memoryview
    checks: tuple[Check, ...] = ()


def check_name(what: Any) -> str:
    """The words for a :data:`Check`'s ``what``."""
    if isinstance(what, str):
        return what
    k, offsets = what
    return f"chunk at {list(offsets)}" if k < 0 else f"block {k} of chunk at {list(offsets)}"


def whole_check(chunk: Chunk) -> tuple[Check, ...]:
    """The check of a whole chunk read: its crc32c, which covers every byte of it."""
    return ((0, chunk.length, chunk.crc32c, (-1, chunk.offsets)),)


def chunk_checks(chunk: Chunk, start: int, end: int, block: int) -> tuple[Check, ...]:
    """The crc checks that cover bytes [start, end) of ``chunk`` (chunk-relative).

    The whole chunk is checked against its crc; a partial range against the
    crcs of the whole blocks it spans (ranges are planned block-aligned).
    """
    if start == 0 and end == chunk.length:
        return whole_check(chunk)
    if not chunk.block_crc32c or block <= 0:
        return ()
    out = []
    offsets = chunk.offsets
    for k in range(start // block, -(-end // block)):
        b0 = k * block
        n = min(block, chunk.length - b0)
        if b0 >= start and b0 + n <= end:
            out.append((b0 - start, n, chunk.block_crc32c[k], (k, offsets)))
    return tuple(out)


def first_mismatch(r: RangeRead) -> Optional[tuple[Check, int]]:
    """The first check of ``r`` its bytes fail, with the crc they have; None when all pass.
    One call for all of a read's checks: a partial read of small crc blocks has many."""
    for check in r.checks:
        at, n, want, _ = check
        got = crc32c(r.dest[at : at + n])
        if got != want:
            return check, got
    return None


def _scatter_views(req: Request, reads: Sequence[RangeRead]) -> Optional[list[memoryview]]:
    """Consecutive buffers covering ``req``: destinations, with scratch for the gaps (one
    buffer for all of them); None when two pieces want the same bytes (two destinations
    of one stored range: tied tensors loaded into separate template tensors), which no
    single scatter list can serve."""
    pieces = req.pieces
    if any(a[1] > b[1] for a, b in zip(pieces, pieces[1:])):  # (planned requests list them in order)
        pieces = sorted(pieces, key=lambda p: p[1])
    views: list[Optional[memoryview]] = []
    gaps: list[tuple[int, int]] = []  # (where in views, length)
    pos = 0
    for span, at, in_span, n in pieces:
        if at < pos:
            return None
        if at > pos:
            gaps.append((len(views), at - pos))
            views.append(None)
        dest = reads[span.target].dest  # type: ignore[index]
        views.append(dest if in_span == 0 and n == len(dest) else dest[in_span : in_span + n])
        pos = at + n
    if pos < req.length:
        gaps.append((len(views), req.length - pos))
        views.append(None)
    if gaps:
        scratch, at = memoryview(bytearray(sum(n for _, n in gaps))), 0
        for k, n in gaps:
            views[k] = scratch[at : at + n]
            at += n
    return views  # type: ignore[return-value]


async def _fetch_copied(store: ObjectStore, req: Request, reads: Sequence[RangeRead]) -> None:
    """Fetch ``req`` once into scratch and copy each piece to its destination: the
    pieces overlap, so no single scatter list can serve them."""
    scratch = memoryview(bytearray(req.length))
    await store.get_range_into(str(req.obj), req.offset, scratch)
    for span, at, in_span, n in req.pieces:
        reads[span.target].dest[in_span : in_span + n] = scratch[at : at + n]  # type: ignore[index]


def _mismatch(r: RangeRead, bad: tuple[Check, int]) -> CorruptCheckpointError:
    (at, n, want, what), got = bad
    return CorruptCheckpointError(
        f"tensor {r.key!r}: crc32c mismatch in blob {r.blob_key!r} at offset {r.offset + at} "
        f"(length {n}, {check_name(what)}): stored {want:#010x}, read {got:#010x}")


async def read_ranges(
    store: ObjectStore,
    reads: Sequence[RangeRead],
    stats: IOStats,
    *,
    on_chunk_done: Optional[Callable[[RangeRead], None]] = None,
    merge_gap: Optional[int] = None,
    max_request: Optional[int] = None,
    split_above: Optional[int] = None,
    split_into: Optional[int] = None,
    prefault_dest: bool = True,
) -> None:
    """Fetch every read and check its crcs.  Request sizes not given come from the
    store's endpoint kind (:mod:`objckpt.storage.shape`): on S3, large spans are
    split into concurrent 8 MiB GETs; on moto, which copies the whole object for
    every ranged GET, each blob is read by one GET."""
    shape = (await shape_for(store)).read
    spans = [Span(r.blob_key, r.offset, len(r.dest), i) for i, r in enumerate(reads)]
    requests = plan_requests(
        spans,
        merge_gap=shape.merge_gap if merge_gap is None else merge_gap,
        max_request=shape.max_request if max_request is None else max_request,
        split_above=shape.split_above if split_above is None else split_above,
        split_into=shape.split_into if split_into is None else split_into,
    )
    pending = [0] * len(reads)
    for req in requests:
        for span, _, _, _ in req.pieces:
            pending[span.target] += 1  # type: ignore[call-overload]
    sem = asyncio.Semaphore(store.concurrency)
    tallied = getattr(store, "get_range_tallied", None)
    tallies = Tallies(reads)

    def judge(i: int) -> bool:
        """Read ``i``'s verdict from the crcs hashed as its bytes arrived (raising on a
        mismatch); False when they do not cover its checks (its bytes are hashed instead)."""
        r = reads[i]
        if r.checks:
            judged, bad = tallies.verdict(i)
            if not judged:
                return False
            if bad is not None:
                raise _mismatch(r, bad)
        if on_chunk_done is not None:
            on_chunk_done(r)
        return True

    async def finish(i: int) -> None:
        if not judge(i):
            await hashed(i)

    async def hashed(i: int) -> None:
        """Read ``i`` checked by hashing its bytes where they landed."""
        r = reads[i]
        bad = await _runtime.in_thread(first_mismatch, r)
        if bad is not None:
            raise _mismatch(r, bad)
        if on_chunk_done is not None:
            on_chunk_done(r)

    async def fetch(req: Request) -> None:
        async with sem:
            try:
                views = _scatter_views(req, reads)
                if views is None:
                    await _fetch_copied(store, req, reads)
                else:
                    tally = tallies.for_request(req) if tallied is not None else None
                    if tally is not None:
                        await tallied(str(req.obj), req.offset, views, tally)
                        tallies.record(req, tally)
                    elif len(views) == 1:
                        await store.get_range_into(str(req.obj), req.offset, views[0])
                    else:
                        await store.get_range_scatter(str(req.obj), req.offset, views)
            except NotFoundError:
                keys = sorted({reads[s.target].key for s, *_ in req.pieces})  # type: ignore[index]
                raise BlobMissingError(
                    f"blob {req.obj!r} is missing (needed by tensor(s) {', '.join(map(repr, keys[:5]))})"
                ) from None
            except CorruptCheckpointError as e:
                keys = sorted({reads[s.target].key for s, *_ in req.pieces})  # type: ignore[index]
                raise CorruptCheckpointError(f"{e} (needed by tensor(s) {', '.join(map(repr, keys[:5]))})") from None
            stats.add(req.length)
        for span, *_ in req.pieces:
            i: int = span.target  # type: ignore[assignment]  # (a read's index: the spans are made above)
            pending[i] -= 1
            if pending[i] == 0 and not judge(i):
                await hashed(i)

    # fresh destinations: their pages are populated by other threads, in request order,
    # rather than faulted in one by one by this loop as the bytes arrive (only those
    # prefault acts on are viewed: a load of thousands of small chunks views none)
    small = prefault.smallest_used()
    faults = prefault.start(reads[span.target].dest[in_span : in_span + n]  # type: ignore[index]
                            for req in requests for span, _, in_span, n in req.pieces
                            if n >= small) if prefault_dest else None
    tasks = [asyncio.ensure_future(fetch(r)) for r in requests]
    # zero-length chunks have no request; they are done already
    for i, n in enumerate(pending):
        if n == 0:
            tasks.append(asyncio.ensure_future(finish(i)))
    try:
        await _runtime.gather_fail_fast(tasks)
    finally:
        if faults is not None:
            await faults.finish()
