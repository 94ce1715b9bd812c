"""The records a manifest is made of: chunks, tensors, blobs, meshes, rank index
references (typed, frozen where shared).  :mod:`objckpt.format.manifest` holds the
manifest itself and its JSON codec, and re-exports these."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

#: no integer in a manifest (size, offset, length, dim) may reach this: keeps arithmetic
#: on hostile values away from 64-bit overflow in the OS, torch and HTTP ranges
MAX_INT = 1 << 62


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: a box of the global tensor at ``offsets``
    with ``shape``, stored raw row-major at ``blob``[``offset``: ``offset+length``]."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    blob: int  # index into Manifest.blobs
    offset: int
    length: int
    crc32c: int
    #: crc32c of each ``Manifest.crc_block``-byte block, for chunks larger than one block (a
    #: tuple as built; as decoded from v5, packed bytes read on demand, equal to that tuple)
    block_crc32c: Sequence[int] = ()


@dataclass(frozen=True)
class ChunkRecord:
    """A chunk a rank wrote, as it reports it: the tensor key and the chunk, whose
    ``blob`` numbers the rank's own blobs (its n-th) until the manifest is built."""

    key: str
    chunk: Chunk


@dataclass(frozen=True)
class Mesh:
    """A device mesh: its shape and the ranks (of the saving group) at its points, row-major."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def coordinate(self, rank: int) -> Optional[tuple[int, ...]]:
        pos = self.__dict__.get("_pos")
        if pos is None:
            pos = {r: i for i, r in enumerate(self.ranks)}
            object.__setattr__(self, "_pos", pos)
        flat = pos.get(rank)
        if flat is None:
            return None
        out = []
        for n in reversed(self.shape):
            out.append(flat % n)
            flat //= n
        return tuple(reversed(out))


@dataclass(frozen=True)
class ShardSpec:
    """How a tensor is cut over a mesh and who wrote each piece (v2; stored under the
    JSON key ``"layout"``, which stays): ``mesh`` indexes ``Manifest.meshes``;
    placements are "R" or "S<dim>" per mesh dim; each cell is stored as ``split`` pieces along
    dim 0, piece i written by replica slot (i + ``rot``) mod group size."""

    mesh: int
    placements: tuple[str, ...]
    split: int = 1
    rot: int = 0


#: the old name of :class:`ShardSpec` ("layout" now means :mod:`objckpt.layout` only)
TensorLayout = ShardSpec


@dataclass(frozen=True)
class RankIndexRef:
    """One rank's index object (v2): its chunk records."""

    name: str  # path relative to the checkpoint prefix (spread: see ``spread``)
    size: int
    crc32c: int
    #: v4: the hex bucket it is spread to ("" : under the checkpoint prefix)
    spread: str = ""


@dataclass
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)
    #: key of the tensor this one shares storage with (bytes stored once)
    alias_of: Optional[str] = None
    #: v2: the chunks are described by this shard spec and listed in the rank indexes
    layout: Optional[ShardSpec] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class TensorCount:
    """How many tensors a checkpoint holds, counted one way by every command and report.

    ``tensors`` counts keys: every tensor ``load`` fills and ``read`` returns, tied ones
    included (a tied ``lm_head.weight`` is a tensor of the state like any other).  ``tied``
    of them share their bytes with another key and are stored once, under that key; so
    ``stored`` tensors have bytes of their own.  Printed as ``113 tensors (1 tied: stored
    once)``."""

    tensors: int
    tied: int = 0

    @property
    def stored(self) -> int:
        return self.tensors - self.tied

    def __str__(self) -> str:
        return f"{self.tensors} tensors" + (f" ({self.tied} tied: stored once)" if self.tied else "")


@dataclass(frozen=True)
class Blob:
    name: str  # path relative to the checkpoint prefix (spread: see ``spread``)
    size: int
    rank: int = 0
    #: v4: the hex bucket it is spread to ("" : under the checkpoint prefix)
    spread: str = ""
