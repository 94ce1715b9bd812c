"""Which files of a checkpoint one rank's load reads, known before any tensor byte is read.

A tiered restore (:mod:`objckpt.tier.restore`) must know, before it moves a byte,
whether a node's folder holds everything a rank's load will read, and if not, which
files to fetch from peers.  That is the load's own planning, stopped before the
reads: the template is matched against the manifest exactly as :func:`objckpt.load`
matches it (:func:`~objckpt.load.pipeline.match_template`, after creating the
optimizer entries the load would create), the writers' rank indexes are located
from the placements (:func:`~objckpt.planning.symbolic.overlapping_pieces`, as the
v2 resolver's prefetch does) and read through the layout's resolver, and every
chunk the resolver says overlaps a target names its blob.  No second planner: a
change to how a load chooses its chunks changes this answer with it.

The answer covers every read strategy: a rank reading through a collective
(``broadcast``, ``allgather``) reads a part of the bytes its own direct read
would, never other bytes.

With ``in_place``, it also says where the load will put each whole chunk it reads
straight into host memory (the read plan's direct reads,
:func:`~objckpt.load.fill.plan_fill`), for the blobs all of whose reads are such:
a restore from peers receives those bytes right there, so that the load then finds
them in place and only checks them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import NotFoundError
from ..format import keys as objkeys
from ..format.tree import iter_leaves
from ..planning.symbolic import overlapping_pieces
from ..runtime import loop as _runtime
from ..state import create_optimizer_state, find_stateful
from .fill import FillTarget, plan_fill, through_ring
from .pipeline import match_template
from .session import ReadSession


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


def load_reads(state: Any, session: ReadSession, rank: int, *, strict: bool = True, cast: bool = False,
               allow_pickle: bool = False, in_place: bool = False) -> LoadReads:
    """The files ``objckpt.load(state, session.uri, ...)`` reads on ``rank``.

    Raises what the load would raise before reading (a template that does not match:
    :class:`~objckpt.errors.StateDictMismatchError`; a corrupt manifest or index).  A
    missing manifest or rank index is not an error here: it is returned as ``lacking``."""
    try:
        m = session.refresh()
    except NotFoundError:
        return LoadReads((), (objkeys.MANIFEST_NAME,))
    tree = m.rank_trees[rank] if m.rank_trees and rank < len(m.rank_trees) else m.tree
    leaves = dict(iter_leaves(tree))
    stateful = find_stateful(state)  # its own state_dict() copies: the load takes them anew
    create_optimizer_state(stateful, tree, m, allow_pickle, repr(session.uri))
    match = match_template(state, m, leaves, session.uri, strict, cast, stateful)
    wanted = [(t.key, t.box) for t in match.targets]
    wanted += [(c.key, box) for c in match.casts for box, _offs in c.pieces]
    files = [objkeys.MANIFEST_NAME]
    writers: set[int] = set()
    for key, box in wanted:
        lay = m.tensors[key].layout
        if lay is not None:
            writers.update(r for r, _piece, _inter in overlapping_pieces(m.tensors[key].shape, m.meshes[lay.mesh],
                                                                          lay, box))
    lacking = []
    for r in sorted(writers):
        ref = m.rank_indexes[r]
        if ref.spread:
            continue
        files.append(ref.name)
        if _runtime.run(session.store.head(m.index_key(session.prefix, r))) is None:
            lacking.append(ref.name)
    if lacking:
        return LoadReads(tuple(files), tuple(lacking))
    resolver = session.resolver
    _runtime.run(resolver.prefetch(wanted))
    blobs: set[int] = set()
    for key, box in wanted:
        blobs.update(ov.chunk.blob for ov in resolver.overlapping(key, box))
    files += sorted({m.blobs[b].name for b in blobs if not m.blobs[b].spread})
    return LoadReads(tuple(files), (), _in_place(m, resolver, match.targets, match.casts) if in_place else ())


def _in_place(m: Any, resolver: Any, targets: list[FillTarget], casts: list[Any]) -> tuple[InPlace, ...]:
    """The load's read plan for ``targets``: its direct reads into host memory, for the blobs
    that no other read (a staged piece, device memory, a cast temporary) touches."""
    plan = plan_fill(m, resolver, targets)
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
