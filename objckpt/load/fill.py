"""Filling destination boxes from stored chunks: resolve, plan, execute.

A fill target is (stored key, global box, destination tensor of the box's
shape).  :func:`fill_boxes` asks the layout's resolver which chunks overlap
each box, has :func:`~objckpt.planning.read_plan.plan_reads` make a
:class:`~objckpt.planning.read_plan.ReadPlan` of it, and runs the plan batch
by batch: whole chunks straight into destination memory (device memory
through a ring of reused pinned buffers, copied while the next bytes are on
the network: :mod:`.device_stream`), the rest into temporaries (at most one
batch of them, within the budget), then one strided copy per piece.
"""
from __future__ import annotations

import asyncio
from typing import NamedTuple, Optional, Protocol, Sequence

import torch

from ..runtime import loop as _runtime
from ..format.dtypes import dtype_from_name, itemsize
from ..format.manifest import Manifest
from ..layout import Resolver, resolver_for
from ..runtime.memory import LOAD_TEMP_BYTES, Budget, OperationBudget, host_bytes
from ..planning.boxes import Box
from ..planning.read_plan import ReadBatch, ReadPlan, ReadTarget, plan_reads
from ..results import IOStats
from ..storage import ObjectStore
from .device_stream import DeviceRead, caller_streams, device_bytes, stream_reads
from .ranged_get import RangeRead, chunk_checks, read_ranges, whole_check

#: temporaries a load holds at once, by default (:data:`~objckpt.runtime.memory.LOAD_TEMP_BYTES`)
TEMP_BUDGET = Budget(LOAD_TEMP_BYTES)


class FillTarget(NamedTuple):
    """Fill ``dest`` (shaped like ``box``) with ``box`` of the stored tensor ``key``.  A named
    tuple, not a frozen dataclass: a template of thousands of tensors makes one per tensor."""

    key: str
    box: Box
    dest: torch.Tensor


def through_ring(t: torch.Tensor) -> bool:
    """Whether whole chunks reach ``t`` through the ring of reused host buffers
    (:mod:`.device_stream`): contiguous device memory, which sockets cannot write."""
    return (not t.is_cpu and not t.is_meta and t.is_contiguous() and not t.is_conj()
            and not t.is_neg())  # (is_cpu: a tenth of device.type's cost, asked per tensor)


def receives_in_place(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored bytes can land in ``t``'s memory as they are: received straight
    into host memory, or streamed through the ring into device memory."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == dtype and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.is_meta)  # plain_host or through_ring


def plan_fill(m: Manifest, resolver: Resolver, targets: Sequence[FillTarget], budget: Budget = TEMP_BUDGET,
              verify: bool = True) -> ReadPlan:
    """The read plan for ``targets`` (the resolver must have prefetched them)."""
    read_targets = []
    tensors = m.tensors
    for key, box, dest in targets:
        dt = dtype_from_name(tensors[key].dtype, key)
        read_targets.append(ReadTarget(key, box, itemsize(dt), receives_in_place(dest, dt)))
    return plan_reads(read_targets, resolver.overlapping, m.crc_block, budget, verify)


def _run_batch(st: ObjectStore, prefix: str, m: Manifest, targets: Sequence[FillTarget], batch: ReadBatch,
               stats: IOStats, verify: bool, memory: Optional[OperationBudget] = None) -> None:
    """One batch, its temporaries held in ``memory`` (the load's budget) while it runs."""
    if memory is None:
        _run_batch_held(st, prefix, m, targets, batch, stats, verify, None)
        return
    with memory.hold(batch.temp_bytes, f"read temporaries of {len(batch.staged)} piece(s) of "
                            f"{sorted({targets[s.target].key for s in batch.staged})[:3]}"):
        _run_batch_held(st, prefix, m, targets, batch, stats, verify, memory)


def _run_batch_held(st: ObjectStore, prefix: str, m: Manifest, targets: Sequence[FillTarget], batch: ReadBatch,
                    stats: IOStats, verify: bool, memory: Optional[OperationBudget]) -> None:
    reads: list[RangeRead] = []
    ring: list[DeviceRead] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination view, source view)
    views: dict[int, memoryview] = {}
    flat: dict[int, torch.Tensor] = {}
    blob_keys: dict[int, str] = {}  # (thousands of chunks share a few blobs)
    for i, c, at in batch.direct:
        key, _box, tdest = targets[i]
        bk = blob_keys.get(c.blob)
        if bk is None:
            bk = blob_keys[c.blob] = m.blob_key(prefix, c.blob)
        if through_ring(tdest):  # device memory: through the ring
            dbytes = flat.get(i)
            if dbytes is None:
                dbytes = flat[i] = device_bytes(tdest)
            ring.append(DeviceRead(key, bk, c.offset, dbytes[at : at + c.length], c.crc32c if verify else None,
                                   f"chunk at {list(c.offsets)}"))
            continue
        # a whole chunk: its crc32c covers every byte read (the block crcs are for partial reads)
        view = views.get(i)
        if view is None:
            view = views[i] = host_bytes(tdest)
        reads.append(RangeRead(key, bk, c.offset, view[at : at + c.length], whole_check(c) if verify else ()))
    for s in batch.staged:
        t = targets[s.target]
        piece = s.piece
        c = piece.chunk
        dt = dtype_from_name(m.tensors[t.key].dtype, t.key)
        temp = torch.empty(piece.hi - piece.lo, dtype=torch.uint8, pin_memory=t.dest.is_cuda)
        tview = memoryview(temp.numpy()) if temp.numel() else memoryview(bytearray(0))
        blob_key = m.blob_key(prefix, c.blob)
        for a, b in piece.ranges:
            checks = chunk_checks(c, a, b, m.crc_block) if verify else ()
            reads.append(RangeRead(t.key, blob_key, c.offset + a, tview[a - piece.lo : b - piece.lo], checks))
        i_off, i_shape = piece.inter
        if not i_shape:
            copies.append((t.dest, temp.view(dt).reshape(())))
        else:
            d_off = t.box[0]
            src = temp.view(dt).as_strided(i_shape, piece.strides, piece.elem_offset)
            copies.append((t.dest[tuple(slice(o - d, o - d + n) for o, d, n in zip(i_off, d_off, i_shape))], src))
    if reads or ring:
        with stats.timings.timed("fetch"):
            _runtime.run(_fetch(st, reads, ring, stats, caller_streams(ring), memory))
    with torch.no_grad(), stats.timings.timed("fill"):
        for dst, src in copies:
            dst.copy_(src, non_blocking=dst.is_cuda)
        if any(d.is_cuda for d, _ in copies):
            torch.cuda.synchronize()


async def _fetch(st: ObjectStore, reads: Sequence[RangeRead], ring: Sequence[DeviceRead], stats: IOStats,
                 streams: dict, memory: Optional[OperationBudget] = None) -> None:
    """Host reads and device reads at the same time (each bounded by the store's concurrency)."""
    tasks = []
    if reads:
        tasks.append(asyncio.ensure_future(read_ranges(st, reads, stats)))
    if ring:
        tasks.append(asyncio.ensure_future(stream_reads(st, ring, stats, streams=streams, memory=memory)))
    await _runtime.gather_fail_fast(tasks)


def run_plan(st: ObjectStore, prefix: str, m: Manifest, targets: Sequence[FillTarget], plan: ReadPlan,
             stats: IOStats, verify: bool = True, memory: Optional[OperationBudget] = None) -> None:
    """Execute ``plan``: each batch's temporaries are copied out and freed before the next."""
    for batch in plan.batches:
        _run_batch(st, prefix, m, targets, batch, stats, verify, memory)


class Planned(Protocol):
    """A load whose reads were planned before its fill (:class:`~objckpt.load.prepared.PreparedLoad`)."""

    resolver: Optional[Resolver]

    def plan_for(self, targets: Sequence[FillTarget], budget: Budget = ..., verify: bool = ...
                 ) -> Optional[ReadPlan]: ...


def fill_boxes(st: ObjectStore, prefix: str, m: Manifest, targets: Sequence[FillTarget], stats: IOStats,
               verify: bool = True, budget: Budget = TEMP_BUDGET, resolver: Optional[Resolver] = None,
               memory: Optional[OperationBudget] = None, prepared: Optional[Planned] = None) -> None:
    """Fill every target: resolve which chunks it needs, plan, execute.  ``memory``: the
    load's one budget; the temporaries then take at most ``budget`` of what is left of
    it, and the device ring the rest, both held only while a batch runs.  ``prepared``:
    the load's prepared reads: its resolver, and its plan when ``targets`` are its own."""
    if resolver is None:
        resolver = prepared.resolver if prepared is not None and prepared.resolver is not None else None
    resolver = resolver if resolver is not None else resolver_for(m, st, prefix)
    with stats.timings.timed("plan"):
        _runtime.run(resolver.prefetch(((t.key, t.box) for t in targets), stats))
        share = budget if memory is None else memory.share(budget.nbytes)
        plan = prepared.plan_for(targets, share, verify) if prepared is not None else None
        if plan is None:
            plan = plan_fill(m, resolver, targets, share, verify)
    run_plan(st, prefix, m, targets, plan, stats, verify, memory)
