"""Which files of a checkpoint one rank's load reads, known before any tensor byte is read.

A tiered restore (:mod:`objckpt.tier.restore`) must know, before it moves a byte,
whether a node's folder holds everything a rank's load will read, and if not, which
files to fetch from peers.  That is the load's own preparation
(:class:`~objckpt.load.prepared.PreparedLoad`, whose ``reads`` return the types
here), stopped before the reads: the template matched once as :func:`objckpt.load`
matches it (:func:`~objckpt.load.match.match_template`, after creating the
optimizer entries the load would create), the writers' rank indexes located
from the placements (:func:`~objckpt.planning.symbolic.overlapping_pieces`, as the
v2 resolver's prefetch does) and read through the layout's resolver, and every
chunk the resolver says overlaps a target names its blob.  No second planner: a
change to how a load chooses its chunks changes this answer with it.

The answer covers every read strategy: a rank reading through a collective
(``broadcast``, ``allgather``) reads a part of the bytes its own direct read
would, never other bytes.

With ``in_place``, it also says where the load will put each whole chunk it reads
straight into host memory (the prepared read plan's direct reads, :func:`in_place`),
for the blobs all of whose reads are such:
a restore from peers receives those bytes right there, so that the load then finds
them in place and only checks them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..planning.read_plan import ReadPlan
from .fill import FillTarget, through_ring


@dataclass(frozen=True)
class InPlace:
    """A whole chunk a load reads straight into host memory: ``length`` bytes of ``file`` at
    ``offset`` land in ``dest`` (a uint8 view of the destination tensor's memory)."""

    file: str
    offset: int
    length: int
    dest: torch.Tensor = field(compare=False, repr=False)


@dataclass(frozen=True)
class LoadReads:
    """The files (names relative to the checkpoint) one rank's load reads.

    ``lacking`` non-empty: the store lacks metadata (the manifest, or the rank index of a
    writer whose pieces the load needs) without which the blobs cannot be known;
    ``files`` then holds what is known so far.  Objects placed outside the checkpoint
    (``spread``) are left out: they are not files of its folder."""

    files: tuple[str, ...]
    lacking: tuple[str, ...] = ()
    #: (``in_place``) the chunks of the blobs every read of which lands whole in host memory
    in_place: tuple[InPlace, ...] = ()

    @property
    def known(self) -> bool:
        return not self.lacking


def in_place(m: Any, resolver: Any, targets: Sequence[FillTarget], casts: Sequence[Any],
             plan: ReadPlan) -> tuple[InPlace, ...]:
    """``plan`` (the load's read plan for ``targets``): its direct reads into host memory, for
    the blobs that no other read (a staged piece, device memory, a cast temporary) touches."""
    other: set[int] = set()
    for key, box in [(c.key, b) for c in casts for b, _offs in c.pieces]:
        other.update(ov.chunk.blob for ov in resolver.overlapping(key, box))
    found: list[tuple[int, InPlace]] = []
    for batch in plan.batches:
        other.update(r.piece.chunk.blob for r in batch.staged)
        for d in batch.direct:
            t, c = targets[d.target], d.chunk
            if through_ring(t.dest) or m.blobs[c.blob].spread:
                other.add(c.blob)
                continue
            if c.length:
                flat = t.dest.detach().reshape(-1).view(torch.uint8)
                found.append((c.blob, InPlace(m.blobs[c.blob].name, c.offset, c.length,
                                              flat[d.dest_offset: d.dest_offset + c.length])))
    return tuple(p for b, p in found if b not in other)
