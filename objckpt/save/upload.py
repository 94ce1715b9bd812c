"""Upload a save plan: stage each part, checksum it, upload it, in parallel.

Every part of every blob is an independent job: take a staging buffer, copy the
part's chunks into it (any device, any strides), crc32c each chunk on the
staged bytes, upload the part, give the buffer back.  The number of jobs in
flight is bounded by the staging budget and the store's concurrency, so host
memory stays near the budget however large the state.  A blob is completed as
soon as its last part is up.  On any failure every unfinished upload is
aborted and every blob already written is deleted, then the error is raised:
nothing of a failed attempt stays visible (``gc`` sweeps what a crash leaves).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..runtime import loop as _runtime
from ..checksum import RunningCrc, block_crcs, crc32c, crc32c_combine
from ..errors import MemoryBudgetError
from ..runtime.memory import AnyBudget, Budget, HostPool, host_bytes, operation_budget, plain_host
from ..planning.pack import ChunkPlan, PartPlan, SavePlan
from ..results import IOStats
from ..storage.base import BlobWriter, ObjectStore


def _chunk_source(t: torch.Tensor, c: ChunkPlan) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1)
    return t[c.row_start : c.row_end]


@dataclass(frozen=True)
class ChunkCrc:
    """A staged chunk's crc32c, whole and per ``crc_block``-byte block."""

    total: int
    blocks: tuple[int, ...]



def enqueue_part(
    part: PartPlan,
    tensors: Mapping[str, torch.Tensor],
    buf: torch.Tensor,
    stream: Optional["torch.cuda.Stream"] = None,
) -> Optional["torch.cuda.Event"]:
    """Issue ``part``'s copies into ``buf``; device copies are only queued on
    ``stream``, and the returned event (None: nothing on a device) completes with
    them.  Queuing every part before waiting on any keeps the copy engine busy
    back to back, where a wait after each part would leave a gap per part."""
    flat = buf[: part.size]
    pos = 0
    on_device = False
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        for c in part.chunks:
            rel = c.offset - part.offset
            if rel > pos:
                flat[pos:rel].zero_()
            if c.length:
                src = _chunk_source(tensors[c.key], c)
                dst = flat[rel : rel + c.length].view(src.dtype).view(src.shape)
                on_device = on_device or src.is_cuda
                dst.copy_(src, non_blocking=src.is_cuda)
            pos = rel + c.length
    if pos < part.size:
        flat[pos:].zero_()
    if not on_device:
        return None
    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream())
    return ev


def part_crcs(part: PartPlan, buf: torch.Tensor, block: int = 0) -> list[ChunkCrc]:
    """crc32c of each chunk of a staged part (and of its blocks), on the staged bytes."""
    return staged_crcs(part, buf, block)[0]


def staged_crcs(part: PartPlan, buf: torch.Tensor, block: int = 0) -> tuple[list[ChunkCrc], int]:
    """:func:`part_crcs`, and the whole part's crc32c (padding included), built while the
    chunks are hashed (:class:`~objckpt.checksum.RunningCrc`), not combined afterwards."""
    host = memoryview(buf[: part.size].numpy()).cast("B")
    out: list[ChunkCrc] = []
    whole = RunningCrc()
    pos = 0
    for c in part.chunks:
        rel = c.offset - part.offset
        if rel > pos:
            whole.add(host[pos:rel])  # the zero padding, as staged
        v = host[rel : rel + c.length]
        total, blocks = block_crcs(v, block)
        out.append(ChunkCrc(total, tuple(blocks)))
        whole.add(v, total)
        pos = rel + c.length
    if pos < part.size:
        whole.add(host[pos : part.size])
    return out, whole.value


_ZEROS = memoryview(bytes(4096))


def direct_views(
    part: PartPlan, tensors: Mapping[str, torch.Tensor], block: int = 0, whole: bool = True
) -> tuple[list[memoryview], list[ChunkCrc], Optional[int]]:
    """The part as views of the tensors' own bytes (zero padding between), chunk crcs, and
    the part's crc32c (built as the chunks are hashed: see :func:`staged_crcs`; None when
    not ``whole``: a store that does not send it, local files, is spared a second pass)."""
    views: list[memoryview] = []
    crcs: list[ChunkCrc] = []
    running = RunningCrc() if whole else None
    pos = part.offset
    for c in part.chunks:
        if c.offset > pos:
            views.append(_ZEROS[: c.offset - pos])
            if running is not None:
                running.add(views[-1])
        t = tensors[c.key]
        v = host_bytes(t)
        if t.dim() and len(v) != c.length:  # rows of the tensor (its whole is the common case)
            row = c.length // max(c.row_end - c.row_start, 1) if c.length else 0
            v = v[c.row_start * row : c.row_start * row + c.length]
        total, blocks = block_crcs(v, block)
        crcs.append(ChunkCrc(total, tuple(blocks)))
        if running is not None:
            running.add(v, total)
        if len(v):
            views.append(v)
        pos = c.offset + c.length
    if pos < part.offset + part.size:
        views.append(_ZEROS[: part.offset + part.size - pos])
        if running is not None:
            running.add(views[-1])
    return views, crcs, running.value if running is not None else None


def part_crc(part: PartPlan, crcs: Sequence[ChunkCrc]) -> int:
    """The part's crc32c, combined from its chunks' crcs and the zero padding between
    them: the server can verify every part without objckpt hashing its bytes twice.
    (A save builds it while hashing instead: :func:`staged_crcs`, :func:`direct_views`.)"""
    crc, pos = 0, part.offset
    for c, k in zip(part.chunks, crcs):
        if c.offset > pos:
            crc = crc32c_combine(crc, crc32c(bytes(c.offset - pos)), c.offset - pos)
        crc = crc32c_combine(crc, k.total, c.length)
        pos = c.offset + c.length
    end = part.offset + part.size
    if end > pos:
        crc = crc32c_combine(crc, crc32c(bytes(end - pos)), end - pos)
    return crc


async def _event_done(ev: "torch.cuda.Event") -> None:
    """Wait for a CUDA event by polling it from the loop: a thread blocked in
    ``synchronize()`` would hold the GIL and keep the other parts' copies from
    being queued, pacing the copy engine one part at a time."""
    delay = 50e-6
    while not ev.query():
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)


def staged_parts(plan: SavePlan, tensors: Mapping[str, torch.Tensor], zero_copy: bool) -> list[PartPlan]:
    """The parts of ``plan`` that go through a staging buffer: every part, or with
    ``zero_copy`` those with a chunk that is not plain host memory (the rest upload
    from the tensors' own memory)."""
    direct = {k: plain_host(t) for k, t in tensors.items()} if zero_copy else {}
    return [p for b in plan.blobs for p in b.parts if not (zero_copy and all(direct[c.key] for c in p.chunks))]


def refuse_unstageable(parts: Sequence[PartPlan], budget: AnyBudget, uri: str, min_part_size: int) -> None:
    """Under a staging budget the caller gave (strict), refuse a save with a part to stage
    that is larger than the whole budget, before anything is written: a part is staged
    whole (copied, checksummed and uploaded from one buffer), so it cannot be cut here.
    A default budget (lenient) stages such a part alone, past the budget, as it always did."""
    memory = operation_budget(budget, "save staging budget")
    if not memory.strict or not parts:
        return
    big = max(parts, key=lambda p: p.size)
    if big.size <= memory.nbytes:
        return
    names = sorted({c.key.split("\x00")[0] for c in big.chunks})  # packing keys: "<key>\x00<i>"
    shown = ", ".join(map(repr, names[:3])) + (" ..." if len(names) > 3 else "")
    # a part holds whole chunks (each at most part_size) until it reaches part_size: up to twice part_size
    if memory.nbytes // 2 >= min_part_size:
        smaller = f", or a part_size of at most {memory.nbytes // 2} (a part may grow to twice part_size)"
    else:
        smaller = f" (this store's multipart parts are at least {min_part_size} bytes: no part_size helps)"
    raise MemoryBudgetError(
        f"save to {uri!r}: part {big.index} of blob {big.blob} ({big.size} bytes of {shown}) is staged whole in "
        f"host memory, but the {memory.name} is {memory.nbytes} bytes; give staging_bytes of at least "
        f"{big.size}{smaller}.  Nothing was written.")


async def write_plan(
    store: ObjectStore,
    blob_keys: list[str],
    plan: SavePlan,
    tensors: Mapping[str, torch.Tensor],
    pool: HostPool,
    budget: AnyBudget,
    stats: IOStats,
    *,
    zero_copy: bool = True,
    crc_block: int = 0,
    on_staged: Optional[Callable[[], None]] = None,
    stream: Optional["torch.cuda.Stream"] = None,
) -> dict[ChunkPlan, ChunkCrc]:
    """Upload every blob of ``plan``; returns the crc32c of each chunk.

    With ``zero_copy`` (sync saves), parts made only of contiguous CPU tensors
    are uploaded from the tensors' own memory: the caller is blocked until the
    upload ends, so the bytes cannot change under us.  Everything else (GPU
    tensors, strided views, and every part of an async save) is staged through
    the host pool: a buffer is taken, filled, checksummed, uploaded, given
    back.  Staging runs ahead of uploads as far as ``budget`` allows (the save's
    one staging budget: its slots of the largest part, each buffer at most that
    part, held in the budget while it is out); ``on_staged`` is called once every
    part has been staged (from then on the caller's tensors are no longer read).
    """
    memory = operation_budget(budget, "save staging budget")
    crcs: dict[ChunkPlan, ChunkCrc] = {}
    writers: dict[int, BlobWriter] = {}
    remaining: dict[int, int] = {}
    completed: list[int] = []
    max_part = max(plan.max_part, 1)
    slot = Budget(max_part)  # no buffer larger than the largest part: slots x slot stays within the budget
    buffers = asyncio.Semaphore(memory.value.slots(max_part))
    uploads = asyncio.Semaphore(store.concurrency)
    parts = [p for b in plan.blobs for p in b.parts]
    to_stage = [0]

    for b in plan.blobs:
        writers[b.index] = store.open_writer(blob_keys[b.index], b.size, len(b.parts))
        remaining[b.index] = len(b.parts)

    direct = {k: plain_host(t) for k, t in tensors.items()} if zero_copy else {}
    # parts hashed from the tensors' own memory take at most all but one of the CPU threads:
    # hashing many small chunks holds the GIL, and the writes queued behind it (local files
    # write from the same threads) would otherwise wait for every part in flight to be hashed
    hashing = asyncio.Semaphore(max(1, _runtime.cpu_threads() - 1))

    all_staged = asyncio.Event()
    enqueue_one = asyncio.Lock()

    def staged_one() -> None:
        to_stage[0] -= 1
        if to_stage[0] == 0:
            all_staged.set()
            if on_staged is not None:
                on_staged()

    async def job(part: PartPlan) -> None:
        if zero_copy and all(direct[c.key] for c in part.chunks):
            async with uploads:
                writer = writers[part.blob]
                async with hashing:
                    views, part_crcs, whole = await _runtime.in_thread(
                        direct_views, part, tensors, crc_block, writer.uses_part_crc)
                for c, v in zip(part.chunks, part_crcs):
                    crcs[c] = v
                await writer.write_part_views(part.index, part.offset, views, crc32c=whole)
                stats.add(part.size)
        else:
            await staged(part)
        remaining[part.blob] -= 1
        if remaining[part.blob] == 0:
            await writers[part.blob].complete()
            if len(plan.blobs[part.blob - plan.blobs[0].index].parts) > 1:
                stats.add(0, 2)  # create + complete of the multipart upload
            completed.append(part.blob)

    async def staged(part: PartPlan) -> None:
        async with buffers:
            buf = pool.take(part.size, slot)
            memory.draw(buf.numel(), "a staging buffer")
            try:
                if stream is not None:
                    # device copies are queued from one thread at a time: measured on an
                    # H100, 8 threads queuing at once took 30 ms for what one thread
                    # queues in 5 ms (the copies then ran at pinned D2H speed)
                    async with enqueue_one:
                        ev = await _runtime.in_thread(enqueue_part, part, tensors, buf, stream)
                else:
                    ev = await _runtime.in_thread(enqueue_part, part, tensors, buf, stream)
                if ev is not None:  # never checksummed nor uploaded before its copy completed
                    await _event_done(ev)
                staged_one()
                if hold_uploads:  # all of it fits: stage everything first, the caller is waiting
                    await all_staged.wait()
                found, whole = await _runtime.in_thread(staged_crcs, part, buf, crc_block)
                for c, v in zip(part.chunks, found):
                    crcs[c] = v
                async with uploads:
                    data = memoryview(buf.numpy())[: part.size]
                    await writers[part.blob].write_part_views(part.index, part.offset, [data], crc32c=whole)
                stats.add(part.size)
            finally:
                memory.release(buf.numel())
                pool.give(buf)

    if zero_copy:
        to_stage[0] = sum(1 for p in parts if not all(direct[c.key] for c in p.chunks))
    else:
        to_stage[0] = len(parts)
    # With a waiting caller (on_staged) and room for every staged part, uploads start
    # only once staging is done: on a busy host they would otherwise slow the copy.
    hold_uploads = on_staged is not None and to_stage[0] <= memory.value.slots(max_part)
    if to_stage[0] == 0:
        all_staged.set()
        if on_staged is not None:
            on_staged()
    tasks = [asyncio.ensure_future(job(p)) for p in parts]
    try:
        await _runtime.gather_fail_fast(tasks)
    except BaseException:
        await asyncio.gather(
            *(w.abort() for i, w in writers.items() if i not in completed), return_exceptions=True
        )
        if completed:
            try:
                await store.delete([blob_keys[i] for i in completed])
            except Exception:
                pass  # left for gc; not referenced by any manifest
        raise
    return crcs
