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
from typing import Mapping, Sequence

from ..format.manifest import Blob, Chunk, ChunkRecord
from ..planning.pack import ChunkPlan, SavePlan
from .upload import ChunkCrc


@dataclass(frozen=True)
class Piece:
    """Rows of a tensor that one packing key stores, and where they sit globally."""

    key: str  # the tensor's key in the checkpoint
    offsets: tuple[int, ...]  # global offsets of the piece's first element


def chunk_records(plan: SavePlan, pieces: Mapping[str, Piece],
                  crcs: Mapping[ChunkPlan, ChunkCrc]) -> list[ChunkRecord]:
    """The records of ``plan``'s chunks: each chunk moved to its piece's place in the
    whole tensor, with the crc32c (whole and per block) of its staged bytes; ``blob``
    still numbers this rank's own blobs (the manifest rebases it)."""
    out = []
    for c in plan.chunks:
        piece = pieces[c.key]
        offs = tuple(b + o for b, o in zip(piece.offsets, c.offsets))
        crc = crcs[c]
        out.append(ChunkRecord(piece.key, Chunk(offs, c.shape, c.blob, c.offset, c.length, crc.total, crc.blocks)))
    return out


def rank_blobs(plan: SavePlan, names: Sequence[str], rank: int, bucket: str = "") -> list[Blob]:
    """This rank's blobs as the manifest lists them (``names``: the plan's blobs' names)."""
    return [Blob(n, b.size, rank, bucket) for n, b in zip(names, plan.blobs)]
