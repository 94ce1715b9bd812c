"""Packing tensors into blobs and upload parts (pure).

Each stored tensor is cut along dim 0 into chunks of at most ``chunk_bytes``
(whole rows), each chunk gets its own crc32c, and chunks are laid out back to
back (start aligned to ``align`` bytes) in blobs of about ``blob_bytes``.  A
blob is uploaded as parts made of whole chunks, at least ``min_part`` bytes
each except the last: so every part can be staged and checksummed on its own,
in parallel, and a chunk's crc never spans two parts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..errors import UnsupportedValueError


@dataclass(frozen=True)
class TensorSpec:
    """What packing needs to know of a tensor."""

    key: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


class WriteItemLike(Protocol):
    key: str

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class ChunkPlan:
    key: str
    row_start: int  # along dim 0 (0 for 0-d tensors)
    row_end: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    blob: int
    offset: int  # inside the blob
    length: int

    @classmethod
    def _made(cls, key: str, row_start: int, row_end: int, offsets: tuple[int, ...], shape: tuple[int, ...],
              blob: int, offset: int, length: int) -> "ChunkPlan":
        """The same as ``ChunkPlan(...)``, built without the frozen dataclass's one
        ``object.__setattr__`` per field: a plan of 3,200 chunks makes them all."""
        c = object.__new__(cls)
        c.__dict__.update(key=key, row_start=row_start, row_end=row_end, offsets=offsets, shape=shape, blob=blob,
                          offset=offset, length=length)
        return c


@dataclass
class PartPlan:
    blob: int
    index: int
    offset: int
    size: int
    chunks: list[ChunkPlan] = field(default_factory=list)


@dataclass
class BlobPlan:
    index: int
    size: int = 0
    parts: list[PartPlan] = field(default_factory=list)


@dataclass
class SavePlan:
    blobs: list[BlobPlan]

    @property
    def chunks(self) -> list[ChunkPlan]:
        return [c for b in self.blobs for p in b.parts for c in p.chunks]

    @property
    def max_part(self) -> int:
        return max((p.size for b in self.blobs for p in b.parts), default=0)


def split_rows(spec: TensorSpec, chunk_bytes: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) of dim 0, each at most ``chunk_bytes`` (at least one row)."""
    if len(spec.shape) == 0:
        return [(0, 1)]
    rows = spec.shape[0]
    if rows == 0 or spec.nbytes == 0:
        return [(0, rows)]
    row_bytes = spec.nbytes // rows
    per = max(1, chunk_bytes // row_bytes)
    return [(r, min(rows, r + per)) for r in range(0, rows, per)]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_save(
    specs: Sequence[TensorSpec],
    *,
    blob_bytes: int = 1 << 30,
    part_bytes: int = 16 << 20,
    chunk_bytes: int = 16 << 20,
    max_part_bytes: int = 5 << 30,
    align: int = 64,
    first_blob: int = 0,
) -> SavePlan:
    """Lay ``specs`` out in blobs and parts; the order of ``specs`` is kept."""
    return _lay_out([(s.key, s.shape, s.itemsize) for s in specs], blob_bytes=blob_bytes, part_bytes=part_bytes,
                    chunk_bytes=chunk_bytes, max_part_bytes=max_part_bytes, align=align, first_blob=first_blob)


def _lay_out(specs: Sequence[tuple[str, tuple[int, ...], int]], *, blob_bytes: int, part_bytes: int,
             chunk_bytes: int, max_part_bytes: int, align: int = 64, first_blob: int = 0) -> SavePlan:
    """:func:`plan_save` of (key, shape, itemsize) triples: a save of thousands of tensors
    makes no :class:`TensorSpec` per tensor on its way to the layout."""
    if part_bytes <= 0 or chunk_bytes <= 0 or blob_bytes <= 0:
        raise ValueError("blob, part and chunk sizes must be positive")
    blobs: list[BlobPlan] = []
    blob: BlobPlan | None = None
    part: PartPlan | None = None

    def new_blob() -> BlobPlan:
        b = BlobPlan(first_blob + len(blobs))
        blobs.append(b)
        return b

    made = ChunkPlan._made
    for key, dims, size in specs:
        nbytes = math.prod(dims) * size
        # the whole tensor in one chunk (the common case) is split_rows's one range, found without it
        whole = len(dims) > 0 and (nbytes <= chunk_bytes or dims[0] == 0)
        rows = [(0, dims[0])] if whole else split_rows(TensorSpec(key, dims, size), chunk_bytes)
        for r0, r1 in rows:
            if len(dims) == 0:
                shape: tuple[int, ...] = ()
                offsets: tuple[int, ...] = ()
                length = size
            elif whole:  # its shape as it is
                shape = tuple(dims)
                offsets = (0,) * len(dims)
                length = nbytes
            else:
                shape = (r1 - r0,) + tuple(dims[1:])
                offsets = (r0,) + (0,) * (len(dims) - 1)
                length = math.prod(shape) * size
            if length > max_part_bytes:
                raise UnsupportedValueError(
                    f"tensor {key!r}: one row along dim 0 is {length} bytes, above the store's "
                    f"largest part ({max_part_bytes}); reshape it so dim 0 is longer"
                )
            if blob is None or (blob.size >= blob_bytes and length > 0):
                blob = new_blob()
                part = None
            start = _align(blob.size, align)
            if part is None or part.size >= part_bytes or start + length - part.offset > max_part_bytes:
                if part is not None:  # alignment padding goes to the part that ends here
                    part.size = start - part.offset
                part = PartPlan(blob.index, len(blob.parts), start, 0)
                blob.parts.append(part)
            chunk = made(key, r0, r1, offsets, shape, blob.index, start, length)
            part.chunks.append(chunk)
            blob.size = start + length
            part.size = blob.size - part.offset
    return SavePlan(blobs)


@dataclass(frozen=True)
class PackLimits:
    """Sizes a save packs to: its options and the store's part-size limits."""

    blob_size: int
    part_size: int
    min_part: int
    max_part: int


def pack_items(items: Sequence["WriteItemLike"], itemsizes: dict[str, int], limits: PackLimits) -> SavePlan:
    """Lay out write items (in order) in blobs and parts; item ``i`` packs under the key ``"<key>\\0<i>"``."""
    specs = [(f"{it.key}\x00{i}", tuple(it.shape), itemsizes[it.key]) for i, it in enumerate(items)]
    return _lay_out(specs, blob_bytes=limits.blob_size, part_bytes=max(limits.part_size, limits.min_part),
                    chunk_bytes=limits.part_size, max_part_bytes=limits.max_part)
