"""The one interface both layouts implement (format v1 "gathered", v2 "symbolic").

A *layout* is how a multi-rank checkpoint knows which rank wrote which chunk:

* gathered (v1): every rank's boxes are gathered, every rank runs the same
  assignment, rank 0 lists every chunk in the manifest;
* symbolic (v2): every rank describes its state by DTensor placements, the
  ranks only agree on a digest, each rank derives its own writes, and writes
  its chunk records to an index object of its own.

Save and load never ask which one they hold: a save calls :meth:`SaveLayout.plan`,
:meth:`SaveLayout.publish` and :meth:`SaveLayout.manifest`; a load asks a
:class:`Resolver` (:func:`objckpt.layout.resolver_for`) which chunks overlap a box.
"""
from __future__ import annotations

import abc
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Protocol, TypeVar

from .._version import __version__
from ..distributed.comm import RankError
from ..format.manifest import Blob, Chunk, ChunkRecord, Manifest, RankIndexRef
from ..format.spread import Placement
from ..planning.assign import RankWrites
from ..planning.boxes import Box
from ..planning.pack import PackLimits
from ..planning.read_plan import Overlap
from ..results import IOStats
from ..storage import ObjectStore

T = TypeVar("T")
WRITER = f"objckpt {__version__}"


@dataclass(frozen=True, eq=False)
class RankOutcome:
    """What one rank reports once its uploads are done (gathered for the commit).

    Sent to rank 0 as plain tuples (:meth:`wire`; pickled, the same tuples behind a
    constructor), and rebuilt as a :class:`_PackedOutcome` that builds its ``Blob`` and
    ``RankIndexRef`` objects on first use: at 65,536 ranks rank 0 rebuilds 65,536 of them
    (docs/s3-scale.md §6)."""

    blobs: list[Blob] = field(default_factory=list)
    #: gathered layout: this rank's chunk records travel to rank 0
    records: list[ChunkRecord] = field(default_factory=list)
    #: symbolic layout: this rank's index object holds its records
    index: Optional[RankIndexRef] = None
    #: what failed on this rank (its kind, the failure's registered class name, is the class
    #: every rank raises); None: its uploads are done
    error: Optional[RankError] = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        i = self.index
        return (_unpack_outcome, (tuple((b.name, b.size, b.rank, b.spread) for b in self.blobs), self.records,
                                  None if i is None else (i.name, i.size, i.crc32c, i.spread), self.error))

    def blob_rows(self) -> tuple[tuple[str, int, int, str], ...]:
        """(name, size, rank, spread) of each blob: what the manifest's table is built from."""
        return tuple((b.name, b.size, b.rank, b.spread) for b in self.blobs)

    def index_row(self) -> Optional[tuple[str, int, int, str]]:
        """(name, size, crc32c, spread) of this rank's index object, if it wrote one."""
        i = self.index
        return None if i is None else (i.name, i.size, i.crc32c, i.spread)

    def wire(self) -> tuple[Any, ...]:
        """This outcome as tuples of builtins (no class to look up when unpickled): what a
        rank sends rank 0 for the commit, rebuilt there by :meth:`from_wire`.  Unpickling
        65,536 of them on rank 0 takes a third of the time pickled outcomes take."""
        return self.__reduce__()[1]

    @staticmethod
    def from_wire(w: tuple[Any, ...]) -> "RankOutcome":
        return _unpack_outcome(*w)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankOutcome):
            return NotImplemented
        return (self.blobs, self.records, self.index, self.error) == (other.blobs, other.records, other.index,
                                                                      other.error)


class _PackedOutcome(RankOutcome):
    """A :class:`RankOutcome` as unpickled: its blobs and index are built when first read."""

    @property  # type: ignore[override]
    def blobs(self) -> list[Blob]:
        got = self.__dict__.get("_blobs")
        if got is None:
            got = [Blob(*b) for b in self.__dict__["_packed"][0]]
            object.__setattr__(self, "_blobs", got)
        return got

    @property  # type: ignore[override]
    def index(self) -> Optional[RankIndexRef]:
        i = self.__dict__["_packed"][1]
        return None if i is None else RankIndexRef(*i)

    def blob_rows(self) -> tuple[tuple[str, int, int, str], ...]:
        return self.__dict__["_packed"][0]  # as they arrived: no Blob made

    def index_row(self) -> Optional[tuple[str, int, int, str]]:
        return self.__dict__["_packed"][1]

    def __repr__(self) -> str:
        return (f"RankOutcome(blobs={self.blobs!r}, records={self.records!r}, index={self.index!r}, "
                f"error={self.error!r})")


def _unpack_outcome(blobs: tuple[tuple[str, int, int, str], ...], records: list[ChunkRecord],
                    index: Optional[tuple[str, int, int, str]], error: Optional[RankError]) -> RankOutcome:
    out = object.__new__(_PackedOutcome)
    out.__dict__.update(_packed=(blobs, index), records=records, error=error)
    return out


@dataclass(frozen=True)
class ManifestCommon:
    """The manifest fields that do not depend on the layout."""

    attempt: str
    metadata: dict[str, Any]
    crc_block: int


class SaveLayout(abc.ABC):
    """One save's layout, the same on every rank once the ranks agreed on it."""

    #: the manifest format version this layout writes
    version: int

    @abc.abstractmethod
    def plan(self, rank: int, boxes: dict[str, Box], limits: PackLimits) -> RankWrites:
        """What ``rank`` writes (``boxes``: the boxes it holds, by key)."""

    #: whether each rank writes an index object besides its blobs (``place.index_name``)
    writes_index: bool = False

    @abc.abstractmethod
    async def publish(self, records: list[ChunkRecord], blobs: list[Blob], store: ObjectStore, place: Placement,
                      attempt: str, rank: int, stats: IOStats) -> RankOutcome:
        """Make this rank's chunk records available to the commit (``place``: where
        this rank's objects go)."""

    @abc.abstractmethod
    def manifest(self, outcomes: list[RankOutcome], common: ManifestCommon) -> Manifest:
        """The manifest rank 0 commits, from every rank's outcome."""


class Resolver(Protocol):
    """Which stored chunks overlap a box, whatever the layout."""

    async def prefetch(self, wanted: Iterable[tuple[str, Box]], stats: Optional[IOStats] = None) -> None:
        """Fetch whatever ``overlapping`` will need for these (key, box) pairs."""

    def overlapping(self, key: str, box: Box) -> list[Overlap]:
        """Every stored chunk of ``key`` overlapping ``box``, with the intersection."""

    async def resolve_all(self, stats: Optional[IOStats] = None) -> None:
        """List every chunk of every tensor in the manifest (tools that walk whole checkpoints)."""


class PlanCache:
    """The last few save plans, by digest of everything they depend on.

    A training job saves the same layout again and again; planning is pure, so
    the save pipeline keeps its results here rather than planning in each call.
    Not shared across processes; bounded to ``size`` entries."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._plans: "OrderedDict[bytes, Any]" = OrderedDict()
        self.stats = {"hits": 0, "misses": 0}

    def get(self, digest: bytes, build: Callable[[], T]) -> T:
        hit = self._plans.get(digest)
        if hit is not None:
            self._plans.move_to_end(digest)
            self.stats["hits"] += 1
            return hit
        self.stats["misses"] += 1
        out = self._plans[digest] = build()
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return out


#: the save pipeline's plan cache (``PLAN_CACHE.stats``: hits and misses)
PLAN_CACHE = PlanCache()
