"""What a rank reports of its upload: its chunk records, in global coordinates, and its blobs.

Every save packs pieces of tensors under packing keys (``"<key>\\0<i>"``,
:func:`objckpt.planning.pack.pack_items`), whether its tensors come from a state
dict (:mod:`.pipeline`) or from a source (:mod:`.source`: DCP's write items, a
converter's stream).  This is the one place that turns the plan's chunks and
their crc32c into the records a manifest lists, so every writer records the
same chunk for the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..format.manifest import Blob, Chunk, ChunkRecord
from ..planning.pack import ChunkPlan, SavePlan
from .upload import ChunkCrc


@dataclass(frozen=True)
class Piece:
    """Rows of a tensor that one packing key stores, and where they sit globally."""

    key: str  # the tensor's key in the checkpoint
    offsets: tuple[int, ...]  # global offsets of the piece's first element

    @classmethod
    def made(cls, key: str, offsets: tuple[int, ...]) -> "Piece":
        """The same as ``Piece(...)``, built without the frozen dataclass's one
        ``object.__setattr__`` per field: a save of thousands of tensors makes one each."""
        p = object.__new__(cls)
        p.__dict__.update(key=key, offsets=offsets)
        return p


def chunk_places(plan: SavePlan, pieces: Mapping[str, Piece]) -> list[tuple[str, tuple[int, ...]]]:
    """Per chunk of ``plan`` (in its order): its tensor's key and its global offsets (the
    chunk moved to its piece's place in the whole tensor).  The same in every save of one
    plan, so a save that reuses a plan computes them once (:mod:`.plan_cache`)."""
    out = []
    add = out.append
    for c in plan.chunks:
        piece = pieces[c.key]
        base = piece.offsets
        add((piece.key, tuple(b + o for b, o in zip(base, c.offsets)) if any(base) else c.offsets))
    return out


def chunk_records(plan: SavePlan, pieces: Mapping[str, Piece], crcs: Mapping[ChunkPlan, ChunkCrc],
                  places: Optional[Sequence[tuple[str, tuple[int, ...]]]] = None) -> list[ChunkRecord]:
    """The records of ``plan``'s chunks: each chunk at its place in the whole tensor
    (``places``, else :func:`chunk_places`), with the crc32c (whole and per block) of its
    staged bytes; ``blob`` still numbers this rank's own blobs (the manifest rebases it)."""
    chunks = plan.chunks
    out = []
    for c, (key, offs) in zip(chunks, places if places is not None else chunk_places(plan, pieces)):
        crc = crcs[c]
        out.append(ChunkRecord(key, Chunk(offs, c.shape, c.blob, c.offset, c.length, crc.total, crc.blocks)))
    return out


def rank_blobs(plan: SavePlan, names: Sequence[str], rank: int, bucket: str = "") -> list[Blob]:
    """This rank's blobs as the manifest lists them (``names``: the plan's blobs' names)."""
    return [Blob(n, b.size, rank, bucket) for n, b in zip(names, plan.blobs)]
