"""Whole chunks into device memory through a ring of reused host buffers.

A GPU destination cannot receive socket bytes itself, so each chunk bound for
one is read in slot-sized segments into reused host buffers (pinned where CUDA
is available: DMA-direct, no driver bounce copy), checked, and copied to the
device on objckpt's side stream while the next segments are still on the
network.  A slot is taken again only once its copy has finished (an event per
copy), so the pinned memory a load holds is the ring's, however large the
state: the buffers come from the process-wide :class:`~objckpt.runtime.memory.HostPool`
and serve the next load (or save) without being pinned again.

Each segment's crc32c is taken in its host slot, as the bytes land where the
store can hash them there (``get_range_tallied``, the direct S3 path), else in
one pass after the GET; the chunk's crc is combined from them in order
(:func:`~objckpt.checksum.crc32c_combine`), so a chunk is verified without ever
being whole in host memory.

The copy engine is the only device-specific part: with a CPU destination (the
mirror that is tested on every machine) the copy is a plain ``copy_`` on a
worker thread; everything else (segments, slots, crc, errors) is the same code.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..runtime import loop as _runtime
from ..checksum import CellCrcs, crc32c, crc32c_combine
from ..errors import BlobMissingError, CorruptCheckpointError, NotFoundError
from ..runtime.memory import (MIN_SLOT_BYTES, RING_BYTES, RING_SLOT_BYTES, Budget, HostPool, OperationBudget,
                              host_pool, side_stream)
from ..results import IOStats
from ..storage.base import ObjectStore

#: bytes per segment: one ranged GET each, the piece size host loads split large spans into
#: (the ring's host memory at most is ``RING_BYTES``, both named in :mod:`objckpt.runtime.memory`)
SLOT_BYTES = RING_SLOT_BYTES


@dataclass(frozen=True)
class DeviceRead:
    """Fetch ``dest.numel()`` bytes of ``blob_key`` from ``offset`` into ``dest`` (a flat
    uint8 view of device memory), then check them against ``crc`` (None: unchecked)."""

    key: str
    blob_key: str
    offset: int
    dest: torch.Tensor
    crc: Optional[int]
    what: str


def device_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (any device) as a flat uint8 view."""
    return t.detach().reshape(-1).view(torch.uint8)


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dest, src in pairs:
            dest.copy_(src)


class _Copier:
    """Host slot -> destination copies: async on each CUDA device's side stream (the
    caller's stream is waited for first, so earlier kernels writing the destination
    come before), synchronous on a worker thread for any other device."""

    def __init__(self, caller_streams: dict[int, Any]) -> None:
        self.caller_streams = caller_streams
        self.streams: dict[int, Any] = {}
        self._waits: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def _stream(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self.streams.get(idx)
        if s is None:
            s = self.streams[idx] = side_stream(device)
            caller = self.caller_streams.get(idx)
            s.wait_stream(caller if caller is not None else torch.cuda.current_stream(idx))
        return s

    async def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (destination, host source) pair; returns once the sources may be reused."""
        if any(d.device.type != "cuda" for d, _ in pairs):
            await _runtime.in_thread(_copy_all, pairs)
            return
        used: dict[int, Any] = {}
        for dest, src in pairs:
            stream = self._stream(dest.device)
            with torch.cuda.stream(stream):
                dest.copy_(src, non_blocking=True)
            used[id(stream)] = stream
        done = []
        for stream in used.values():
            ev = torch.cuda.Event(blocking=True)  # its waiter sleeps in the driver, it does not spin
            ev.record(stream)
            done.append(ev)
        if all(ev.query() for ev in done):
            return
        # The slot is free the moment its copy ends: one thread waits on the events in the
        # order they were recorded (a side stream completes in that order) and wakes this
        # task then.  Polling with sleeps woke up to 5 ms late and kept slots idle.
        await asyncio.get_running_loop().run_in_executor(self._waiter(), _synchronize, done)

    def _waiter(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._waits is None:
            self._waits = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-h2d-wait")
        return self._waits

    def finish(self) -> None:
        """Every copy issued is complete (the destinations hold the bytes when the load returns)."""
        for s in self.streams.values():
            s.synchronize()
        if self._waits is not None:
            self._waits.shutdown(wait=True)
            self._waits = None


def _synchronize(events: Sequence[Any]) -> None:
    for ev in events:
        ev.synchronize()  # releases the GIL while it waits


def caller_streams(reads: Sequence[DeviceRead]) -> dict[int, Any]:
    """The calling thread's current stream on each CUDA device ``reads`` write to (the
    I/O loop's thread has its own current streams, so they are taken here)."""
    out: dict[int, Any] = {}
    for r in reads:
        d = r.dest.device
        if d.type == "cuda":
            idx = d.index if d.index is not None else torch.cuda.current_device()
            if idx not in out:
                out[idx] = torch.cuda.current_stream(idx)
    return out


#: bytes between two reads of one blob that a request reads and drops rather than split
MERGE_GAP = 256 << 10


@dataclass(frozen=True)
class Segment:
    """One GET into one slot: ``length`` bytes of ``blob_key`` from ``offset``, serving
    ``pieces`` (read index, start in the read, end in the read, start in the slot)."""

    blob_key: str
    offset: int
    length: int
    pieces: tuple[tuple[int, int, int, int], ...]


def segments(reads: Sequence[DeviceRead], slot: int, merge_gap: int = MERGE_GAP) -> list[Segment]:
    """The GETs that serve ``reads``: a read larger than a slot is cut into slot-sized
    pieces; reads that follow each other in a blob (small tensors, one after the
    other) share a GET while they fit one slot."""
    out: list[Segment] = []
    cur: Optional[tuple[str, int, int, list[tuple[int, int, int, int]]]] = None
    order = sorted((i for i, r in enumerate(reads) if r.dest.numel()), key=lambda i: (reads[i].blob_key, reads[i].offset))
    for i in order:
        r = reads[i]
        n = r.dest.numel()
        for a in range(0, n, slot):
            b = min(a + slot, n)
            at = r.offset + a
            if cur is not None:
                key, off, length, pieces = cur
                gap = at - (off + length)
                if key == r.blob_key and 0 <= gap <= merge_gap and length + gap + (b - a) <= slot:
                    pieces.append((i, a, b, length + gap))
                    cur = (key, off, length + gap + b - a, pieces)
                    continue
                out.append(Segment(key, off, length, tuple(pieces)))
            cur = (r.blob_key, at, b - a, [(i, a, b, 0)])
    if cur is not None:
        out.append(Segment(cur[0], cur[1], cur[2], tuple(cur[3])))
    return out


def _names(reads: Sequence[DeviceRead], s: Segment) -> str:
    keys = sorted({reads[i].key for i, *_ in s.pieces})
    return ", ".join(map(repr, keys[:5]))


def _check(r: DeviceRead, crcs: list[tuple[int, int]]) -> None:
    """Compare the crc combined from ``crcs`` ((crc, length) per segment, in order) with ``r.crc``."""
    got = 0
    for c, n in crcs:
        got = crc32c_combine(got, c, n)
    if got != r.crc:
        raise CorruptCheckpointError(
            f"tensor {r.key!r}: crc32c mismatch in blob {r.blob_key!r} at offset {r.offset} "
            f"(length {r.dest.numel()}, {r.what}): stored {r.crc:#010x}, read {got:#010x}")


async def stream_reads(store: ObjectStore, reads: Sequence[DeviceRead], stats: IOStats, *,
                       streams: Optional[dict[int, Any]] = None, slot_bytes: Optional[int] = None,
                       ring_bytes: Optional[int] = None, memory: Optional[OperationBudget] = None) -> None:
    """Fetch every read through the ring and copy it into place; raise naming the tensor
    on a missing blob or a crc mismatch.  ``streams``: :func:`caller_streams`, taken on
    the caller's thread.  ``memory``: the load's budget; the ring takes at most what is
    left of it (fewer or smaller slots) and holds that until its last copy is done."""
    slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
    ring_bytes = RING_BYTES if ring_bytes is None else ring_bytes
    if memory is not None:  # not below MIN_SLOT_BYTES: less left is an error naming the budget, not tiny GETs
        ring_bytes = memory.share(ring_bytes).nbytes
        slot_bytes = min(slot_bytes, max(ring_bytes, MIN_SLOT_BYTES))
    segs = segments(reads, slot_bytes)
    for r in reads:  # nothing to fetch: an empty chunk's crc is that of no bytes
        if r.dest.numel() == 0 and r.crc is not None:
            _check(r, [])
    if not segs:
        return
    slot = max(s.length for s in segs)
    nslots = max(1, min(Budget(ring_bytes).slots(slot), store.concurrency, len(segs)))
    pool = host_pool()
    if memory is not None:
        memory.draw(nslots * slot, f"the device ring ({nslots} slot(s) of {slot} bytes)")
    try:
        await _ring(store, reads, stats, segs, streams, pool, [pool.take(slot, Budget(slot)) for _ in range(nslots)])
    finally:
        if memory is not None:
            memory.release(nslots * slot)


async def _ring(store: ObjectStore, reads: Sequence[DeviceRead], stats: IOStats, segs: list[Segment],
                streams: Optional[dict[int, Any]], pool: HostPool, bufs: list[torch.Tensor]) -> None:
    """The ring itself: ``bufs`` (from ``pool``, given back at the end) carry ``segs``."""
    free: asyncio.Queue[torch.Tensor] = asyncio.Queue()
    for buf in bufs:
        free.put_nowait(buf)
    crcs: list[dict[int, tuple[int, int]]] = [{} for _ in reads]
    left = [0] * len(reads)
    for s in segs:
        for i, *_ in s.pieces:
            left[i] += 1
    copier = _Copier(streams or {})
    tallied = getattr(store, "get_range_tallied", None)

    async def one(s: Segment) -> None:
        buf = await free.get()
        try:
            view = memoryview(buf[: s.length].numpy())
            checked = [(i, a, b, at) for i, a, b, at in s.pieces if reads[i].crc is not None]
            # one cell per checked piece (pieces never overlap), hashed as its bytes land
            tally = CellCrcs([x for *_, a, b, at in checked for x in (at, at + b - a)], s.length) \
                if checked and tallied is not None else None
            try:
                if tally is not None:
                    await tallied(s.blob_key, s.offset, [view], tally)
                else:
                    await store.get_range_into(s.blob_key, s.offset, view)
            except NotFoundError:
                raise BlobMissingError(f"blob {s.blob_key!r} is missing (needed by tensor(s) "
                                       f"{_names(reads, s)})") from None
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{e} (needed by tensor(s) {_names(reads, s)})") from None
            stats.add(s.length)
            if checked:
                cells = tally.cells() if tally is not None else None  # None: the store did not hash them
                if cells is not None:
                    at_start = {start: crc for start, _, crc in cells}
                    got = [at_start[at] for *_, at in checked]
                else:
                    got = await _runtime.in_thread(lambda: [crc32c(view[at : at + b - a]) for _, a, b, at in checked])
                for (i, a, b, _), c in zip(checked, got):
                    crcs[i][a] = (c, b - a)
            await copier.copy([(reads[i].dest[a:b], buf[at : at + b - a]) for i, a, b, at in s.pieces])
        finally:
            free.put_nowait(buf)
        for i, *_ in s.pieces:
            left[i] -= 1
            if left[i] == 0 and reads[i].crc is not None:  # the read's last piece: its chunk is whole
                _check(reads[i], [crcs[i][a] for a in sorted(crcs[i])])

    try:
        tasks = [asyncio.ensure_future(one(s)) for s in segs]
        await _runtime.gather_fail_fast(tasks)
    finally:
        copier.finish()  # no copy may still read a slot once it is back in the pool
        for b in bufs:
            pool.give(b)
