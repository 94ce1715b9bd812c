"""Describe phase: this rank's state as tensor boxes, sources and (when it has one) a symbolic description.

Nothing here talks to other ranks or to storage; the description is what the
exchange in :mod:`objckpt.save.pipeline` compares and plans from.
"""
from __future__ import annotations

import hashlib
import math
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from ..distributed.comm import Comm
from ..distributed.placements import Shard, dtensor_placements, is_dtensor, local_part, local_view, mesh_description
from ..format.dtypes import dtype_name, itemsize
from ..format.manifest import Mesh
from ..planning.assign import TensorMeta
from ..planning.boxes import Box
from ..planning.symbolic import SymbolicDescription, TensorDesc, cell_box
from ..state import Collected, collect
from .fingerprint import fingerprint

#: ``mirror(key, local)`` starts a host copy of ``local`` and returns the tensor to read from
Mirror = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class Source:
    """Where a tensor's bytes come from on this rank: its box, and the local tensor holding it.

    A strided DTensor (``_StridedShard``) holds several boxes: ``parts`` maps each
    to where it starts in ``tensor`` (empty for the usual single box)."""

    box: Box
    tensor: torch.Tensor
    parts: dict[Box, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def whole(cls, box: Box, tensor: torch.Tensor) -> "Source":
        """``Source(box, tensor)`` of a plain tensor, built without the dataclass's
        ``__init__`` and its new ``parts`` dict: a save describes thousands of them."""
        s = object.__new__(cls)
        s.__dict__.update(box=box, tensor=tensor, parts=_NO_PARTS)
        return s

    def view(self, box: Box) -> torch.Tensor:
        """The part of ``tensor`` holding ``box`` (one of the boxes this rank holds)."""
        if box == self.box and not self.parts:
            return self.tensor
        return local_view(self.tensor, box, self.parts[box])


#: a plain tensor's ``Source.parts`` (one box, all of it): shared, never written to
_NO_PARTS: dict[Box, tuple[int, ...]] = {}


@dataclass
class LocalState:
    """What one rank brings to a save."""

    tree: Any
    metas: dict[str, TensorMeta]
    #: (a save that reuses a description makes each source when first asked: objckpt.save.plan_cache)
    sources: Mapping[str, Source]
    aliases: dict[str, str]
    dtypes: dict[str, str]
    #: None: some tensor has no symbolic form, or a single process
    symbolic: Optional[SymbolicDescription] = None
    #: plain tensors' fingerprints (multi-rank only): the save checks that they agree on every rank
    fingerprints: dict[str, int] = field(default_factory=dict)

    @property
    def boxes(self) -> dict[str, Box]:
        """Each tensor's box, where this rank holds one box (a symbolic save: always)."""
        return {k: s.box for k, s in self.sources.items()}


#: tensor types described without :func:`local_part` (the common case: each is all of itself)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Walked:
    """The state as one walk found it: its tensors and tree (:func:`objckpt.state.collect`)
    and the host mirrors whose copies started during the walk (by key)."""

    col: Collected
    early: dict[str, torch.Tensor] = field(default_factory=dict)

    def read_from(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The tensor a save reads ``key``'s bytes from: its mirror, else ``local``."""
        return self.early.get(key, local) if self.early else local


def walk(state: Any, allow_pickle: bool, mirror: Optional[Mirror] = None) -> Walked:
    """Walk ``state`` once; ``mirror``, when given, starts a copy of each local tensor as
    soon as it is found, and the save then reads from the copy (see
    :mod:`objckpt.save.mirrors`)."""
    early: dict[str, torch.Tensor] = {}

    def start_copy(key: str, value: Any) -> None:  # each copy starts the moment its tensor is found
        if mirror is not None:
            if type(value) in _PLAIN_TYPES:
                early[key] = mirror(key, value)
                return
            local = value.local if isinstance(value, Shard) else value.to_local() if is_dtensor(value) else value
            early[key] = mirror(key, local)

    col = collect(state, allow_pickle=allow_pickle, on_new=start_copy if mirror is not None else None)
    return Walked(col, early)


def describe_local(state: Any, allow_pickle: bool, comm: Optional[Comm] = None,
                   mirror: Optional[Mirror] = None) -> LocalState:
    """This rank's state, described (:func:`walk`, then :func:`describe_walked`)."""
    return describe_walked(walk(state, allow_pickle, mirror), comm)


def describe_walked(w: Walked, comm: Optional[Comm] = None) -> LocalState:
    """This rank's state as the walk ``w`` found it, described.  A plain tensor (the common
    case, thousands in a model) is its own single box, described in place; a DTensor or an
    :class:`objckpt.Shard` through :func:`local_part`."""
    col = w.col
    metas: dict[str, TensorMeta] = {}
    sources: dict[str, Source] = {}
    dtypes: dict[str, str] = {}
    values: dict[str, Any] = {}
    alias_of = col.alias_of
    facts = col.facts  # plain tensors: (device, shape, strides, dtype), read by the walk
    by_dtype: dict[torch.dtype, tuple[str, int]] = {}  # its name and item size
    zeros: dict[int, tuple[int, ...]] = {}  # a box's offsets, by rank
    made, whole = TensorMeta.made, Source.whole
    for key, value in col.tensors.items():
        if type(value) in _PLAIN_TYPES:
            f = facts.get(key)
            dt, size = (f[3], f[1]) if f is not None else (value.dtype, value.shape)
            named = by_dtype.get(dt)
            if named is None:
                named = by_dtype[dt] = (dtype_name(dt, key), itemsize(dt))
            dtypes[key] = named[0]
            if key in alias_of:
                continue
            shape = tuple(size)
            n = len(shape)
            origin = zeros.get(n)
            if origin is None:
                origin = zeros[n] = (0,) * n
            box = (origin, shape)
            metas[key] = made(named[0], shape, named[1], (box,))
            values[key] = value
            sources[key] = whole(box, w.read_from(key, value))
            continue
        part = local_part(key, value)
        dtypes[key] = dtype_name(part.dtype, key)
        if key in alias_of:
            continue
        boxes = tuple(b for b, _ in part.pieces)
        metas[key] = TensorMeta(dtypes[key], part.shape, itemsize(part.dtype), boxes)
        values[key] = value
        if part.pieces and part.local is not None:
            parts = dict(zip(boxes, part.local_offsets)) if len(boxes) > 1 else {}
            sources[key] = Source(boxes[0], w.read_from(key, part.local), parts)
    out = LocalState(col.tree, metas, sources, dict(alias_of), dtypes)
    if comm is not None and comm.world_size > 1:
        out.symbolic = describe_symbolic(out, values, comm)
        out.fingerprints = plain_fingerprints(values)
    return out


def plain_fingerprints(values: dict[str, Any]) -> dict[str, int]:
    """The fingerprints of the plain tensors among ``values`` (by key): what the save
    compares between ranks, every save (they follow the values, never the structure)."""
    return {k: fingerprint(v) for k, v in values.items()
            if isinstance(v, torch.Tensor) and not is_dtensor(v) and v.device.type != "meta"}


def describe_symbolic(local: LocalState, values: dict[str, Any], comm: Comm) -> Optional[SymbolicDescription]:
    """The symbolic description of this rank's state, or None when some tensor
    has no symbolic layout (objckpt.Shard, a mesh outside the group, a box that
    differs from the rule): the save then gathers every rank's boxes."""
    world = comm.world_size
    meshes: list[Mesh] = [Mesh((world,), tuple(range(world)))]
    mesh_ids: dict[Any, int] = {}
    descs: list[TensorDesc] = []
    for key, t in local.metas.items():
        v = values[key]
        if isinstance(v, torch.Tensor) and not is_dtensor(v):
            mid, placements = 0, ("R",)
        elif is_dtensor(v):
            pl = dtensor_placements(v)
            if pl is None:
                return None
            md = mesh_description(v, pl)
            if md is None:
                return None
            placements = md.placements
            mid = mesh_ids.get(md.ident, -1)
            if mid < 0:
                ranks = [comm.group_rank(r) for r in md.ranks]
                if any(r is None for r in ranks):
                    return None
                mesh = Mesh(md.shape, tuple(ranks))  # type: ignore[arg-type]
                mid = meshes.index(mesh) if mesh in meshes else len(meshes)
                if mid == len(meshes):
                    meshes.append(mesh)
                mesh_ids[md.ident] = mid
        else:
            return None
        coord = meshes[mid].coordinate(comm.rank)
        if coord is not None:
            if len(t.boxes) > 1:
                return None
            mine = t.boxes[0] if t.boxes else None
            # every mesh point checks its own box against the rule: this is also what
            # makes a strided layout's permuted-mesh description exact (nested_order
            # only proposes it from a sample of points on big meshes)
            rule = cell_box(t.shape, meshes[mid].shape, placements, coord)
            if mine is None or (rule != mine and (math.prod(rule[1]) or math.prod(mine[1]))):
                return None
        descs.append(TensorDesc(key, tuple(t.shape), t.itemsize, mid, placements))
    digest = hashlib.blake2b(
        pickle.dumps(([(d, local.dtypes[d.key]) for d in descs], meshes, sorted(local.aliases.items()),
                      sorted(local.dtypes.items()))),
        digest_size=20,
    ).digest()
    return SymbolicDescription(descs, meshes, digest)
