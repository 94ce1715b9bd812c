"""Filling destination boxes from stored chunks (the read side of every load).

Targets are (stored key, global box, destination tensor).  Chunks that lie
wholly inside a target and span its full rows are read straight into the
destination's memory; everything else goes through a temporary holding just
the planned, block-aligned byte ranges, then one strided copy per overlap.
"""
from __future__ import annotations

import torch

from .. import _runtime
from ..format import layout
from ..format.dtypes import dtype_from_name, itemsize
from ..format.manifest import Manifest
from ..planning.reshard import Box, plan_piece
from ..storage import ObjectStore
from .read import RangeRead, chunk_checks, read_ranges
from .resolve import ChunkResolver, check_coverage
from .stats import IOStats

__all__ = ["fill_boxes", "check_coverage", "direct_ok", "byte_view"]


def direct_ok(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and type(t) in (torch.Tensor, torch.nn.Parameter)
    )


def byte_view(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _flush(st: ObjectStore, reads: list[RangeRead], copies: list[tuple[torch.Tensor, torch.Tensor]],
           stats: IOStats) -> None:
    if reads:
        _runtime.run(read_ranges(st, reads, stats))
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src, non_blocking=dst.is_cuda)
        if any(d.is_cuda for d, _ in copies):
            torch.cuda.synchronize()
    reads.clear()
    copies.clear()


def fill_boxes(st: ObjectStore, prefix: str, m: Manifest, targets: list[tuple[str, Box, torch.Tensor]],
               stats: IOStats, verify: bool = True, temp_budget: int = 256 << 20) -> None:
    """Fill each target (stored key, global box, destination tensor of the box's shape).

    Temporaries (for GPU or strided destinations and partial chunks) are capped
    near ``temp_budget`` bytes: reads run in batches, each copied out before the
    next, so host memory stays bounded whatever the layout.
    """
    reads: list[RangeRead] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination view, source view)
    resolver = ChunkResolver(m, st, prefix)
    _runtime.run(resolver.prefetch(((key, box) for key, box, _ in targets), stats))
    temp_bytes = 0
    for key, box, dest in targets:
        entry = m.tensors[key]
        dt = dtype_from_name(entry.dtype, key)
        isz = itemsize(dt)
        direct = direct_ok(dest) and dest.dtype == dt
        dview = byte_view(dest) if direct else None
        d_off, d_shape = box
        d_row = int(torch.Size(d_shape[1:]).numel()) * isz if d_shape else isz
        for chunk, inter in resolver.overlapping(key, box):
            blob_key = layout.join(prefix, m.blobs[chunk.blob].name)
            piece = plan_piece(chunk, inter, isz, m.crc_block, verify)
            i_off, i_shape = inter
            # the whole chunk lies inside the target and spans its full rows: read in place
            inside = tuple(i_shape) == tuple(chunk.shape) and tuple(i_shape[1:]) == tuple(d_shape[1:])
            if inside and dview is not None:
                start = (i_off[0] - d_off[0]) * d_row if d_shape else 0
                checks = chunk_checks(chunk, 0, chunk.length, m.crc_block) if verify else ()
                reads.append(RangeRead(key, blob_key, chunk.offset, dview[start : start + chunk.length], checks))
                continue
            if temp_bytes + piece.hi - piece.lo > temp_budget and copies:
                _flush(st, reads, copies, stats)
                temp_bytes = 0
            temp = torch.empty(piece.hi - piece.lo, dtype=torch.uint8, pin_memory=dest.is_cuda)
            temp_bytes += piece.hi - piece.lo
            tview = memoryview(temp.numpy()) if temp.numel() else memoryview(bytearray(0))
            for s, e in piece.ranges:
                checks = chunk_checks(chunk, s, e, m.crc_block) if verify else ()
                reads.append(RangeRead(key, blob_key, chunk.offset + s, tview[s - piece.lo : e - piece.lo], checks))
            if not i_shape:
                src = temp.view(dt).reshape(())
                dst = dest
            else:
                src = temp.view(dt).as_strided(i_shape, piece.strides, piece.elem_offset)
                dst = dest[tuple(slice(o - d, o - d + n) for o, d, n in zip(i_off, d_off, i_shape))]
            copies.append((dst, src))
    _flush(st, reads, copies, stats)


