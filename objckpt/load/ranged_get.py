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
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

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


@dataclass(frozen=True)
class RangeRead:
    """Fetch ``len(dest)`` bytes of ``blob_key`` from ``offset`` into ``dest``, then
    check each ``(offset in dest, length, crc32c, what)`` of ``checks``."""

    key: str
    blob_key: str
    offset: int
    dest: memoryview
    checks: tuple[tuple[int, int, int, str], ...] = ()


def chunk_checks(chunk: Chunk, start: int, end: int, block: int) -> tuple[tuple[int, int, int, str], ...]:
    """The crc checks that cover bytes [start, end) of ``chunk`` (chunk-relative).

    The whole chunk is checked against its crc; a partial range against the
    crcs of the whole blocks it spans (ranges are planned block-aligned).
    """
    if start == 0 and end == chunk.length:
        return ((0, chunk.length, chunk.crc32c, f"chunk at {list(chunk.offsets)}"),)
    if not chunk.block_crc32c or block <= 0:
        return ()
    out = []
    for k in range(start // block, -(-end // block)):
        b0 = k * block
        n = min(block, chunk.length - b0)
        if b0 >= start and b0 + n <= end:
            out.append((b0 - start, n, chunk.block_crc32c[k], f"block {k} of chunk at {list(chunk.offsets)}"))
    return tuple(out)


def first_mismatch(r: RangeRead) -> Optional[tuple[tuple[int, int, int, str], int]]:
    """The first check of ``r`` its bytes fail, with the crc they have; None when all pass.
    One call for all of a read's checks: a partial read of small crc blocks has many."""
    for check in r.checks:
        at, n, want, _ = check
        got = crc32c(r.dest[at : at + n])
        if got != want:
            return check, got
    return None


def _overlapping(req: Request) -> bool:
    """True when two pieces of ``req`` want the same bytes (two destinations of one
    stored range: tied tensors loaded into separate template tensors)."""
    pos = 0
    for _, at, _, n in sorted(req.pieces, key=lambda p: p[1]):
        if at < pos:
            return True
        pos = at + n
    return False


def _scatter_views(req: Request, reads: Sequence[RangeRead]) -> list[memoryview]:
    """Consecutive buffers covering ``req`` (no two pieces overlap): destinations,
    with scratch for the gaps."""
    views: list[memoryview] = []
    pos = 0
    for span, at, in_span, n in sorted(req.pieces, key=lambda p: p[1]):
        if at > pos:
            views.append(memoryview(bytearray(at - pos)))
        views.append(reads[span.target].dest[in_span : in_span + n])  # type: ignore[index]
        pos = at + n
    if pos < req.length:
        views.append(memoryview(bytearray(req.length - pos)))
    return views


async def _fetch_copied(store: ObjectStore, req: Request, reads: Sequence[RangeRead]) -> None:
    """Fetch ``req`` once into scratch and copy each piece to its destination: the
    pieces overlap, so no single scatter list can serve them."""
    scratch = memoryview(bytearray(req.length))
    await store.get_range_into(str(req.obj), req.offset, scratch)
    for span, at, in_span, n in req.pieces:
        reads[span.target].dest[in_span : in_span + n] = scratch[at : at + n]  # type: ignore[index]


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
    pending = {i: 0 for i in range(len(reads))}
    for req in requests:
        for span, _, _, _ in req.pieces:
            pending[span.target] += 1  # type: ignore[index]
    sem = asyncio.Semaphore(store.concurrency)
    tallied = getattr(store, "get_range_tallied", None)
    tallies = Tallies(reads)

    async def finish(i: int) -> None:
        r = reads[i]
        if r.checks:
            judged, bad = tallies.verdict(i)
            if not judged:
                bad = await _runtime.in_thread(first_mismatch, r)
            if bad is not None:
                (at, n, want, what), got = bad
                raise CorruptCheckpointError(
                    f"tensor {r.key!r}: crc32c mismatch in blob {r.blob_key!r} at offset {r.offset + at} "
                    f"(length {n}, {what}): stored {want:#010x}, read {got:#010x}"
                )
        if on_chunk_done is not None:
            on_chunk_done(r)

    async def fetch(req: Request) -> None:
        async with sem:
            try:
                if _overlapping(req):
                    await _fetch_copied(store, req, reads)
                else:
                    if req.direct:
                        span, _, in_span, n = req.pieces[0]
                        views = [reads[span.target].dest[in_span : in_span + n]]  # type: ignore[index]
                    else:
                        views = _scatter_views(req, reads)
                    tally = tallies.for_request(req) if tallied is not None else None
                    if tally is not None:
                        await tallied(str(req.obj), req.offset, views, tally)
                        tallies.record(req, tally)
                    elif req.direct:
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
            i = span.target
            pending[i] -= 1  # type: ignore[index]
            if pending[i] == 0:  # type: ignore[index]
                await finish(i)  # type: ignore[arg-type]

    # fresh destinations: their pages are populated by other threads, in request order,
    # rather than faulted in one by one by this loop as the bytes arrive
    faults = prefault.start(reads[span.target].dest[in_span : in_span + n]  # type: ignore[index]
                            for req in requests for span, _, in_span, n in req.pieces) if prefault_dest else None
    tasks = [asyncio.ensure_future(fetch(r)) for r in requests]
    # zero-length chunks have no request; they are done already
    for i, n in pending.items():
        if n == 0:
            tasks.append(asyncio.ensure_future(finish(i)))
    try:
        await _runtime.gather_fail_fast(tasks)
    finally:
        if faults is not None:
            await faults.finish()
