"""The one mover of a checkpoint's objects from one place to another, checked on the way.

``objckpt.copy`` (store to store) and the tier's drain (a node's folder to object storage)
move the same things: blobs in parts, and the small rank index objects.  Both must size
parts the same way (the destination's part rules, a memory budget) and, above all, check
every byte against the manifest *before* the destination holds it as a finished object:
a copy that moves a flipped byte turns a damaged source into a damaged destination, and
a drain that does so turns a local bit flip into a committed, unreadable checkpoint.  So
the pieces live here once:

* :func:`part_size` / :func:`budgeted_part` / :func:`parts`: bytes per part (the
  destination's smallest and largest part, its part count, a strict budget's cap);
* :class:`BlobCheck`: one blob's chunk crcs, checked as its parts pass (a crc32c per
  part-slice of each chunk, combined in order when the chunk is complete), so a part
  is checked before it is written and a mismatch raises before the blob is completed;
* :func:`check_index`: a rank index object against the size and crc32c its manifest records.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from ..checksum import crc32c, crc32c_combine
from ..errors import CorruptCheckpointError, MemoryBudgetError
from ..format.manifest import Chunk, Manifest, RankIndexRef
from ..runtime.memory import OperationBudget
from ..storage import ObjectStore
from ..units import MiB

#: bytes of one part read and written (raised to the destination's smallest part)
PART_SIZE = 16 * MiB


def part_floor(size: int, dst: ObjectStore) -> int:
    """The smallest part ``dst`` takes for an object of ``size`` bytes (its smallest part, or
    fewer parts than it allows)."""
    return max(dst.min_part_size, -(-size // max(dst.max_parts, 1)), 1)


def part_size(size: int, dst: ObjectStore, preferred: int = PART_SIZE) -> int:
    """Bytes per part of a ``size``-byte object at ``dst``: ``preferred``, within ``dst``'s rules."""
    return min(max(preferred, part_floor(size, dst)), max(dst.max_part_size, 1))


def budgeted_part(size: int, dst: ObjectStore, preferred: int, budget: OperationBudget, what: str) -> int:
    """:func:`part_size` (``size`` itself when it fits one part: one PUT), capped by a strict
    ``budget``; a lenient budget (a named default) never shrinks the part.  Below the
    destination's smallest part a :class:`MemoryBudgetError` names ``what`` and the budget."""
    part = part_size(size, dst, preferred)
    if size <= min(part, budget.nbytes) or not budget.strict:
        return min(size, part)
    floor = part_floor(size, dst)
    if budget.nbytes < floor:
        need = floor if size > floor else size
        raise MemoryBudgetError(
            f"{what} ({size} bytes) needs a buffer of {need} bytes (the store's smallest part), "
            f"more than the {budget.name} ({budget.nbytes} bytes); give a larger budget")
    return min(part, budget.nbytes)


def parts(size: int, part: int) -> list[tuple[int, int]]:
    """(offset, length) of each part of a ``size``-byte object (one empty part for an empty one)."""
    return [(o, min(part, size - o)) for o in range(0, size, max(part, 1))] or [(0, 0)]


@dataclass
class _ChunkCheck:
    """One chunk's crc, assembled from the crcs of the part-slices that cover it."""

    key: str
    chunk: Chunk
    pieces: dict[int, tuple[int, int]] = field(default_factory=dict)  # start -> (length, crc)
    covered: int = 0


class BlobCheck:
    """The chunk crcs of one blob, checked as its parts pass (in any order): :meth:`slices`
    (pure, may run on a worker thread) then :meth:`record` (on one thread), or :meth:`feed`;
    :meth:`finish` once every part passed.  ``where`` names the blob in errors."""

    def __init__(self, where: str, checks: list[tuple[str, Chunk]]) -> None:
        self.where = where
        self.checks = sorted((_ChunkCheck(k, c) for k, c in checks), key=lambda ch: ch.chunk.offset)
        self.starts = [ch.chunk.offset for ch in self.checks]
        #: chunks whose crc was checked so far
        self.verified = 0

    def fresh(self) -> "BlobCheck":
        """The same checks with nothing recorded (the blob read again, from another copy)."""
        return BlobCheck(self.where, [(ch.key, ch.chunk) for ch in self.checks])

    def slices(self, off: int, data: memoryview) -> list[tuple[int, int, int, int]]:
        """(check index, start in its chunk, length, crc32c) of every chunk slice inside
        ``data`` (bytes ``off``.. of the blob)."""
        end = off + len(data)
        out = []
        i = max(0, bisect.bisect_right(self.starts, off) - 1)
        while i < len(self.checks) and self.checks[i].chunk.offset < end:
            c = self.checks[i].chunk
            a, b = max(off, c.offset), min(end, c.offset + c.length)
            if b > a:
                out.append((i, a - c.offset, b - a, crc32c(data[a - off: b - off])))
            i += 1
        return out

    def record(self, found: list[tuple[int, int, int, int]]) -> int:
        """Add slice crcs to their chunks; check each chunk they complete (a mismatch:
        :class:`CorruptCheckpointError`).  Returns the number of chunks completed."""
        done = 0
        for i, start, n, piece in found:
            ch = self.checks[i]
            ch.pieces[start] = (n, piece)
            ch.covered += n
            c = ch.chunk
            if ch.covered != c.length:
                continue
            crc = 0
            for s in sorted(ch.pieces):
                length, part_crc = ch.pieces[s]
                crc = crc32c_combine(crc, part_crc, length)
            if crc != c.crc32c:
                raise CorruptCheckpointError(
                    f"tensor {ch.key!r}: crc32c mismatch in blob {self.where!r} at offset {c.offset} (length "
                    f"{c.length}, chunk at {list(c.offsets)}): stored {c.crc32c:#010x}, read {crc:#010x}")
            done += 1
        self.verified += done
        return done

    def feed(self, off: int, data: memoryview) -> int:
        """:meth:`slices` and :meth:`record` in one."""
        return self.record(self.slices(off, data))

    def finish(self) -> int:
        """After every part: each chunk was covered whole and each empty chunk has the empty
        crc; returns the empty chunks counted as verified."""
        short = [ch for ch in self.checks if ch.covered != ch.chunk.length and ch.chunk.length]
        if short:
            raise CorruptCheckpointError(f"blob {self.where!r}: chunk of tensor {short[0].key!r} not fully read")
        bad = [ch for ch in self.checks if not ch.chunk.length and ch.chunk.crc32c != 0]
        if bad:
            raise CorruptCheckpointError(f"tensor {bad[0].key!r}: an empty chunk with crc32c "
                                         f"{bad[0].chunk.crc32c:#010x} in blob {self.where!r}")
        empty = sum(1 for ch in self.checks if not ch.chunk.length)
        self.verified += empty
        return empty


def blob_checks(m: Manifest, where: Optional[list[str]] = None) -> list[BlobCheck]:
    """One :class:`BlobCheck` per blob of ``m`` (its chunks listed: a v2 manifest resolved
    first), named ``where[i]`` (default: the blob's name)."""
    per: list[list[tuple[str, Chunk]]] = [[] for _ in range(len(m.blobs))]
    for key, e in m.tensors.items():
        if e.alias_of is None:
            for c in e.chunks:
                per[c.blob].append((key, c))
    names = where if where is not None else [b.name for b in m.blobs]
    return [BlobCheck(n, checks) for n, checks in zip(names, per)]


def check_index(data: bytes, ref: RankIndexRef, where: str) -> None:
    """A rank index object's bytes against the size and crc32c ``ref`` (its manifest) records."""
    if len(data) != ref.size or crc32c(data) != ref.crc32c:
        raise CorruptCheckpointError(f"rank index {where!r}: size or crc32c differs from the manifest")
