"""Save plans kept from one save to the next of a state of the same structure.

A training job saves a state of one structure again and again: the same keys,
dtypes, shapes and placements, new values.  Describing that state (its boxes,
its symbolic description, the crc block it wants), the exchange that chooses the
layout, and the plan of this rank's writes (the blob layout, every chunk's
offset) are pure functions of that structure, of the options and of the ranks:
a state of 3,200 small tensors spent ~0.12 s of every save recomputing them
(``describe`` and ``plan`` in :attr:`SaveResult.timings`).  As DCP's
``enable_plan_caching`` does, the save keeps them here and, on a hit, only walks
the state (its tensors, its non-tensor values, every check the walk makes) and
hashes what must be hashed every time: the chunks' crc32c, the fingerprints of
the replicated plain tensors.

**The key** is everything the description and the plan depend on, and nothing of
the values: per tensor (in walk order) its key, type, dtype, shape, strides and
device, and for an :class:`objckpt.Shard` its global shape and offsets, for a
DTensor its global shape, placements and mesh (shape, ranks, dim names, this
rank's coordinate, and the same of its root mesh); the tied keys; the save's
options (but ``metadata``); the store's part limits; the group (its size, this
rank, the job ranks of its members).  The key is compared whole (a dict lookup:
hash, then equality), so a collision of hashes never passes for a hit.

**Agreement between ranks.**  A rank's plan depends on every rank's structure
(the gathered layout assigns replicated boxes from all of them).  A plan made in
a save is stored with that save's attempt id, which every rank learned in the
first exchange (the same id on every rank).  In the next save each rank looks up
its own key and says, in the same first exchange (:class:`Hello.plan_world`),
the attempt id of the plan it holds (``""``: none).  When every rank names the
same one, every rank's structure is what it was in that save, and so is every
plan: all reuse theirs.  Otherwise every rank takes the miss path together (a
rank whose own description is cached reuses it, the exchange and the plan are
made anew, as before this cache): the ranks decide from the same gathered
hellos, so they never take different collectives.

**What a hit skips**: describing each tensor (boxes, the symbolic description,
the crc block), gathering the ranks' descriptions (gathered layout), the layout's
plan, and building each write item; the chunk records are made from offsets
computed once.  Never cached: values (the state's non-tensor values, the chunks'
crcs, the replicated tensors' fingerprints), nor the caller's tensors (an entry
holds no reference to them).

The cache is per process (a forked child starts with its parent's entries, which
describe structures, not memory), bounded to :data:`DEFAULT_ENTRIES` entries,
least recently used first out: ``$OBJCKPT_PLAN_CACHE`` sets the number when the
process first saves (``0``: off, every save takes the miss path).
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch

from ..distributed.comm import Comm
from ..distributed.placements import Shard, _root_mesh, is_dtensor
from ..options import SaveOptions
from ..planning.assign import RankWrites, TensorMeta
from ..planning.boxes import Box
from ..planning.pack import PackLimits
from ..planning.symbolic import SymbolicDescription
from ..runtime.env_numbers import nonnegative
from ..format.manifest import ShardSpec
from ..layout import GatheredLayout, RankReport, SaveLayout, SymbolicLayout
from .describe import LocalState, Source, Walked, plain_fingerprints
from .records import Piece, chunk_places

#: entries kept by default (a job may alternate between a few states: model, optimizer, both)
DEFAULT_ENTRIES = 4
#: the number of entries (``0``: no cache); read once, when the first save looks the cache up
ENTRIES_ENV = "OBJCKPT_PLAN_CACHE"

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _entries_from_env() -> int:
    n = nonnegative(ENTRIES_ENV, "a number of plan cache entries (0 turns it off)")
    return DEFAULT_ENTRIES if n is None else n


def _mesh_facts(mesh: Any) -> tuple[Any, ...]:
    t = mesh.mesh
    coord = mesh.get_coordinate()
    return (str(mesh.device_type), tuple(int(d) for d in t.shape), tuple(int(r) for r in t.flatten().tolist()),
            tuple(getattr(mesh, "mesh_dim_names", None) or ()), None if coord is None else tuple(coord))


def _mesh_key(mesh: Any, memo: dict[int, Any]) -> Any:
    """What a DTensor's description takes from its mesh (and its root mesh), once per mesh
    and key computation (``memo``: by id, the meshes alive meanwhile)."""
    got = memo.get(id(mesh))
    if got is None:
        root = _root_mesh(mesh)
        got = memo[id(mesh)] = (_mesh_facts(mesh), None if root is None or root is mesh else _mesh_facts(root))
    return got


def _record(key: str, value: Any, memo: dict[int, Any]) -> tuple[Any, ...]:
    """One tensor's part of the key (not a plain tensor: those are inlined in :func:`key_of`)."""
    if isinstance(value, Shard):
        t = value.local
        return (key, Shard, t.dtype, t.shape, t.stride(), t.device, tuple(value.global_shape),
                tuple(value.global_offsets))
    if is_dtensor(value):
        t = value.to_local()
        return (key, type(value), value.dtype, tuple(value.shape), t.shape, t.stride(), t.device,
                tuple(repr(p) for p in value.placements), _mesh_key(value.device_mesh, memo))
    return (key, type(value), value.dtype, value.shape, value.stride(), value.device)


def key_of(walked: Walked, comm: Comm, opts: SaveOptions, limits: PackLimits) -> Optional[tuple[Any, ...]]:
    """The cache key of a save of the walked state (the module docstring says what is in
    it), or None when it cannot be hashed (the save then plans as if there were no cache)."""
    records: list[tuple[Any, ...]] = []
    add = records.append
    memo: dict[int, Any] = {}
    facts = walked.col.facts  # plain tensors: (device, shape, strides, dtype), read by the walk
    for k, v in walked.col.tensors.items():
        f = facts.get(k)
        add((k, type(v), f) if f is not None else _record(k, v, memo))
    setting = (dataclasses.replace(opts, metadata=None), limits, comm.world_size, comm.rank,
               tuple(comm.global_ranks()))
    key = (tuple(records), tuple(walked.col.alias_of.items()), setting)
    try:
        hash(key)
    except TypeError:  # an option or a placement that cannot be hashed: no cache for this save
        return None
    return key


@dataclass(frozen=True)
class Described:
    """This rank's description of a structure, less what follows the values (the tree,
    the tensors, the fingerprints): what :func:`describe_walked` found."""

    metas: dict[str, TensorMeta]
    aliases: dict[str, str]
    dtypes: dict[str, str]
    symbolic: Optional[SymbolicDescription]
    #: per key with a source: its (first) box, and where each box starts when it holds several
    geometry: dict[str, tuple[Box, dict[Box, tuple[int, ...]]]]
    #: the crc block this rank asks for (:func:`objckpt.save.pipeline._crc_block_wanted`)
    crc_wanted: int

    @classmethod
    def of(cls, local: LocalState, crc_wanted: int) -> "Described":
        return cls(local.metas, local.aliases, local.dtypes, local.symbolic,
                   {k: (s.box, s.parts) for k, s in local.sources.items()}, crc_wanted)

    def local_state(self, walked: Walked, comm: Comm) -> LocalState:
        """The walked state described as :func:`describe_walked` would, from this description
        and the walk's values: its tree, its tensors (sources built on first use), and the
        plain tensors' fingerprints (multi-rank)."""
        col = walked.col
        local = LocalState(col.tree, self.metas, _Sources(self.geometry, walked), self.aliases, self.dtypes,
                           self.symbolic)
        if comm.world_size > 1:
            local.fingerprints = plain_fingerprints({k: col.tensors[k] for k in self.metas})
        return local


def local_tensor(value: Any) -> torch.Tensor:
    """The local tensor of a tensor leaf (a DTensor's shard, an objckpt.Shard's ``local``)."""
    if isinstance(value, Shard):
        return value.local
    if is_dtensor(value):
        return value.to_local()
    return value


class _Sources(Mapping[str, Source]):
    """A described state's sources, each made when first asked for (a hit whose plan is
    reused asks for none: :meth:`Planned.cut` reads the tensors straight from the walk)."""

    def __init__(self, geometry: dict[str, tuple[Box, dict[Box, tuple[int, ...]]]], walked: Walked) -> None:
        self._geometry = geometry
        self._walked = walked
        self._made: dict[str, Source] = {}

    def __getitem__(self, key: str) -> Source:
        got = self._made.get(key)
        if got is None:
            box, parts = self._geometry[key]
            value = self._walked.col.tensors[key]
            got = self._made[key] = Source(box, self._walked.read_from(key, local_tensor(value)), parts)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._geometry)

    def __len__(self) -> int:
        return len(self._geometry)


@dataclass
class Item:
    """One write item as a hit rebuilds it: its packing key, its tensor's key and, when
    it is not all of the tensor it reads (``whole``), its box and rows."""

    pk: str
    key: str
    whole: bool
    box: Box
    row_start: int
    row_end: int

    @classmethod
    def made(cls, pk: str, key: str, whole: bool, box: Box, row_start: int, row_end: int) -> "Item":
        """``Item(...)`` without the dataclass's ``__init__``: a first save makes one per tensor."""
        it = object.__new__(cls)
        it.__dict__.update(pk=pk, key=key, whole=whole, box=box, row_start=row_start, row_end=row_end)
        return it


@dataclass(frozen=True)
class Planned:
    """The plan every rank made in one save (``world``: its attempt id), as this rank holds it."""

    world: str
    symbolic: bool
    #: gathered layout: every rank's (metas, aliases, dtypes), in rank order
    reports: Optional[list[tuple[dict[str, TensorMeta], dict[str, str], dict[str, str]]]]
    #: symbolic layout: every tensor's shard spec
    specs: Optional[dict[str, ShardSpec]]
    writes: RankWrites
    crc_block: int
    items: list[Item]
    pieces: dict[str, Piece]
    #: per chunk of ``writes.plan`` (in its order): the tensor key and the chunk's global offsets
    places: list[tuple[str, tuple[int, ...]]]

    def cut(self, walked: Walked, local: LocalState) -> dict[str, torch.Tensor]:
        """The tensors the plan's chunks are cut from, by packing key, from this save's walk."""
        tensors = walked.col.tensors
        out: dict[str, torch.Tensor] = {}
        for it in self.items:
            if it.whole:
                v = tensors[it.key]
                out[it.pk] = walked.read_from(it.key, v if type(v) in _PLAIN_TYPES else local_tensor(v))
            else:
                out[it.pk] = item_tensor(local.sources[it.key], it.box, it.row_start, it.row_end)
        return out


def item_tensor(src: Source, box: Box, row_start: int, row_end: int) -> torch.Tensor:
    """Rows ``row_start:row_end`` of the part of ``src`` holding ``box`` (0-d: one element)."""
    t = src.view(box)
    if t.dim() == 0:
        return t.reshape(1)
    if row_start == 0 and row_end == t.shape[0]:
        return t
    return t[row_start:row_end]


def is_whole(src: Source, box: Box, row_start: int, row_end: int) -> bool:
    """Whether a write item reads all of its source's tensor as it is (no view to cut)."""
    _, shape = box
    return ((box is src.box or box == src.box) and not src.parts and len(shape) > 0 and row_start == 0
            and row_end == shape[0])


@dataclass
class Entry:
    """One structure's description on this rank, and the last plan made for it."""

    described: Described
    planned: Optional[Planned] = None


class SavePlanCache:
    """The process's save plans (see the module docstring); thread-safe (async saves
    prepare on the caller's thread, several callers may save at once)."""

    def __init__(self, entries: Optional[int] = None) -> None:
        self._size = entries
        self._entries: "OrderedDict[tuple[Any, ...], Entry]" = OrderedDict()
        self._lock = threading.Lock()
        #: ``hits`` (plan reused), ``described`` (description reused, plan made anew), ``misses``
        self.stats = {"hits": 0, "described": 0, "misses": 0}

    @property
    def size(self) -> int:
        if self._size is None:
            self._size = _entries_from_env()
        return self._size

    def find(self, key: Optional[tuple[Any, ...]]) -> Optional[Entry]:
        if key is None or self.size == 0:
            return None
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
            return got

    def keep(self, key: Optional[tuple[Any, ...]], entry: Entry) -> None:
        if key is None or self.size == 0:
            return
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats = {"hits": 0, "described": 0, "misses": 0}

    def __len__(self) -> int:
        return len(self._entries)


#: the process's save plan cache (``PLANS.stats``: hits, reused descriptions, misses)
PLANS = SavePlanCache()


def plan_made(world: str, layout: SaveLayout, local: LocalState, writes: RankWrites, crc_block: int) -> Planned:
    """The plan a save just made (the miss path), as the next save of its structure reuses it."""
    items: list[Item] = []
    pieces: dict[str, Piece] = {}
    sources = local.sources
    made, item = Piece.made, Item.made
    for i, it in enumerate(writes.items):
        key, box, r0, r1 = it.key, it.box, it.row_start, it.row_end
        pk = f"{key}\x00{i}"  # the packing key plan_save was given (see planning.pack.pack_items)
        o = box[0]
        items.append(item(pk, key, is_whole(sources[key], box, r0, r1), box, r0, r1))
        # WriteItem.offsets: the box's own offsets when its rows start at 0 (the common case)
        pieces[pk] = made(key, o if r0 == 0 and type(o) is tuple else (o[0] + r0,) + tuple(o[1:]) if o else ())
    places = chunk_places(writes.plan, pieces)
    if isinstance(layout, SymbolicLayout):
        return Planned(world, True, None, dict(layout.specs), writes, crc_block, items, pieces, places)
    if not isinstance(layout, GatheredLayout):  # pragma: no cover - the two layouts there are
        raise TypeError(f"no plan cache for layout {type(layout).__name__}")
    reports = [(r.metas, r.aliases, r.dtypes) for r in layout.reports]
    return Planned(world, False, reports, None, writes, crc_block, items, pieces, places)


def reused_layout(planned: Planned, local: LocalState, same_trees: bool, comm: Comm) -> SaveLayout:
    """The layout of a save that reuses ``planned``: the one that save chose, with this save's
    non-tensor values (every rank's, gathered when they differ between ranks, as
    :func:`objckpt.save.pipeline._choose_layout` gathers them)."""
    trees = None if same_trees else comm.all_gather_object(local.tree)
    if planned.symbolic:
        if local.symbolic is None or planned.specs is None:  # pragma: no cover - stored together
            raise TypeError("a symbolic plan without its description")
        layout = SymbolicLayout(local.symbolic, local.dtypes, local.aliases, local.tree, trees)
        layout.specs = dict(planned.specs)
        return layout
    reports = planned.reports or []
    tree_of = trees if trees is not None else [local.tree] * len(reports)
    return GatheredLayout([RankReport(m, t, a, d) for (m, a, d), t in zip(reports, tree_of)])
