"""Everything objckpt knows of DTensor placements and hand-made shards.

What part of a global tensor each rank holds, how a DTensor's mesh and
placements are described symbolically, and which ranks hold the same box
(replica groups): the one module that looks inside DTensors.

Three kinds of tensor leaves are understood:

* a plain ``torch.Tensor``: the whole tensor, identical on every rank
  (replicated), so it is written once, its bytes spread over the replicas;
* a ``DTensor`` (any DeviceMesh, Shard(d)/Replicate placements, uneven shards):
  its local shard is the box torch computes for this rank; with
  ``_StridedShard`` placements (FSDP2 x TP) it may be several boxes, each a
  view of the local tensor (:mod:`objckpt.planning.strided`);
* :class:`Shard`: a local tensor plus its global shape and offsets, for
  frameworks that shard by hand (Megatron style).
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import UnsupportedValueError
from ..planning.boxes import Box
from ..planning.strided import LocalPiece, Step, local_pieces, local_shape, nested_order

Ranks = tuple[int, ...]


@dataclass
class Shard:
    """``local`` is the box of a ``global_shape`` tensor starting at ``global_offsets``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(d) for d in self.global_shape)
        self.global_offsets = tuple(int(o) for o in self.global_offsets)
        if not (len(self.global_shape) == len(self.global_offsets) == self.local.dim()):
            raise ValueError(
                f"Shard: local tensor has {self.local.dim()} dims, global_shape {list(self.global_shape)} and "
                f"global_offsets {list(self.global_offsets)} must match it"
            )
        for o, n, d in zip(self.global_offsets, self.local.shape, self.global_shape):
            if o < 0 or o + n > d:
                raise ValueError(
                    f"Shard of shape {list(self.local.shape)} at {list(self.global_offsets)} does not fit in "
                    f"global shape {list(self.global_shape)}"
                )

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype


_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")
_dtensor_cls: Optional[type] = None


def _dtensor_type() -> Optional[type]:
    """DTensor's class, or None while no DTensor can exist yet.

    Importing ``torch.distributed.tensor`` costs about a second of a cold process
    (it pulls in sympy); a DTensor cannot exist before its module is imported, so
    the class is looked up only once the caller's code has imported it.
    """
    global _dtensor_cls
    if _dtensor_cls is None:
        mods = sys.modules
        if mods.get(_DTENSOR_MODULES[0]) is None and mods.get(_DTENSOR_MODULES[1]) is None:
            return None  # called for every tensor of every save and load: kept cheap
        try:
            from torch.distributed.tensor import DTensor  # torch >= 2.5
        except ImportError:
            try:
                from torch.distributed._tensor import DTensor  # type: ignore[no-redef]  # torch 2.4
            except ImportError:
                return None
        _dtensor_cls = DTensor
    return _dtensor_cls


def is_dtensor(x: Any) -> bool:
    t = _dtensor_type()
    return t is not None and isinstance(x, t)


def _compute_local(shape: Any, mesh: Any, placements: list[Any]) -> Box:
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset  # type: ignore
    shp, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shp)


#: per DeviceMesh: (shape, placements) -> the offsets torch gives this rank's empty strided box
_EMPTY_AT: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[int, ...]]]" = weakref.WeakKeyDictionary()


def _empty_box_offsets(shape: tuple[int, ...], mesh: Any, placements: list[Any]) -> tuple[int, ...]:
    """Where torch says this rank's (empty) box of a strided DTensor starts, once per
    shape and placements: torch's rule for ``_StridedShard`` costs O(mesh size) (~50 ms at
    65,536 ranks), and a rank may hold nothing of hundreds of same-shaped tensors (an
    MoE's router rows, fewer than its FSDP cells)."""
    key = (shape, tuple(repr(p) for p in placements))
    try:
        per = _EMPTY_AT.setdefault(mesh, {})
    except TypeError:
        per = {}
    hit = per.get(key)
    if hit is None:
        hit = per[key] = _compute_local(shape, mesh, placements)[0]
    return hit


def _is_strided(p: Any) -> bool:
    return type(p).__name__ == "_StridedShard"


def _shard_dim(p: Any) -> Optional[int]:
    """The tensor dim a Shard / _StridedShard placement shards, None for others."""
    name = type(p).__name__
    return int(p.dim) if name in ("Shard", "_StridedShard") else None


def _split_factor(p: Any) -> int:
    return int(p.split_factor) if _is_strided(p) else 1


def _dtensor_pieces(key: str, dt: Any) -> Optional[list[LocalPiece]]:
    """The boxes this rank holds of a DTensor and where each sits in its local
    tensor; None when the rank is outside the mesh.  Without ``_StridedShard``
    it is the one box torch computes; with it, what :mod:`objckpt.planning.strided`
    derives (several boxes when the local tensor is strided over the global one)."""
    placements = list(dt.placements)
    for p in placements:
        if type(p).__name__ == "Partial" or (hasattr(p, "is_partial") and p.is_partial()):
            raise UnsupportedValueError(
                f"tensor {key!r}: DTensor has a Partial placement (pending reduction); reduce it before saving"
            )
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return None
    shape = tuple(int(d) for d in dt.shape)
    if not any(_is_strided(p) for p in placements):
        return [LocalPiece(_compute_local(dt.shape, mesh, placements), tuple(0 for _ in shape))]
    steps: list[list[Step]] = [[] for _ in shape]
    coords: list[list[int]] = [[] for _ in shape]
    for md, p in enumerate(placements):
        d = _shard_dim(p)
        if d is not None:
            if d >= len(shape):
                raise UnsupportedValueError(f"tensor {key!r}: placement {p} on a {len(shape)}-d tensor")
            steps[d].append(Step(int(mesh.size(md)), _split_factor(p)))
            coords[d].append(int(coord[md]))
    pieces = local_pieces(shape, steps, coords)
    if not pieces:  # holds nothing: an empty box where torch says it starts
        off = _empty_box_offsets(shape, mesh, placements)
        return [LocalPiece((off, local_shape(shape, steps, coords)), tuple(0 for _ in shape))]
    return pieces


@dataclass(frozen=True)
class LocalPart:
    """What this rank holds of a tensor leaf: ``pieces`` pairs each box it holds with
    the view of ``local`` holding it (usually one; several for a strided DTensor);
    empty when the rank holds no part of it (outside the DTensor's mesh)."""

    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    local: Optional[torch.Tensor]  # the local tensor
    pieces: tuple[tuple[Box, torch.Tensor], ...] = ()
    #: where each piece's box starts in ``local`` (same order as ``pieces``)
    local_offsets: tuple[tuple[int, ...], ...] = ()

    @property
    def box(self) -> Optional[Box]:
        """The box held when it is one box (None: none, or several)."""
        return self.pieces[0][0] if len(self.pieces) == 1 else None


def local_view(local: torch.Tensor, box: Box, local_offsets: tuple[int, ...]) -> torch.Tensor:
    """The view of ``local`` holding ``box`` (a piece starting at ``local_offsets``)."""
    if tuple(local.shape) == tuple(box[1]):
        return local
    v = local
    for d, (o, n) in enumerate(zip(local_offsets, box[1])):
        if (o, n) != (0, local.shape[d]):
            v = v.narrow(d, o, n)
    return v


def local_part(key: str, x: Any) -> LocalPart:
    """This rank's part of a plain tensor (all of it), a DTensor or an :class:`Shard`."""
    if isinstance(x, Shard):
        box = (x.global_offsets, tuple(x.local.shape))
        return LocalPart(x.global_shape, x.local.dtype, x.local, ((box, x.local),), (tuple(0 for _ in box[0]),))
    if is_dtensor(x):
        shape = tuple(int(d) for d in x.shape)
        pieces = _dtensor_pieces(key, x)
        if pieces is None:
            return LocalPart(shape, x.dtype, None)
        local = x.to_local()
        want = tuple(max((p.local_offsets[d] + p.box[1][d] for p in pieces), default=0) for d in range(len(shape)))
        if len(pieces) == 1:
            want = pieces[0].box[1]
        if tuple(local.shape) != want:
            raise UnsupportedValueError(
                f"tensor {key!r}: DTensor local shard has shape {list(local.shape)}, expected {list(want)} "
                f"from its placements {list(map(str, x.placements))}"
            )
        return LocalPart(shape, x.dtype, local,
                         tuple((p.box, local_view(local, p.box, p.local_offsets)) for p in pieces),
                         tuple(p.local_offsets for p in pieces))
    t: torch.Tensor = x
    box = (tuple(0 for _ in t.shape), tuple(t.shape))
    return LocalPart(tuple(t.shape), t.dtype, t, ((box, t),), (box[0],))


def dtensor_placements(x: Any) -> Optional[tuple[str, ...]]:
    """A DTensor's placements as strings: "S<dim>", "R", and "S<dim>/<sf>" for a
    ``_StridedShard`` (an in-memory form only: :func:`mesh_description` turns it
    into plain "S<dim>" on a permuted mesh, or gives up).  None when one of them
    has no symbolic form (the save then lists its chunks)."""
    out = []
    for p in x.placements:
        name = type(p).__name__
        if name == "Shard" or (name == "_StridedShard" and _split_factor(p) <= 1):
            out.append(f"S{int(p.dim)}")
        elif name == "_StridedShard":
            out.append(f"S{int(p.dim)}/{_split_factor(p)}")
        elif name == "Replicate":
            out.append("R")
        else:
            return None
    return tuple(out)


def _root_mesh(mesh: Any) -> Any:
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    try:  # torch < 2.6
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(mesh)
    except (ImportError, AttributeError):
        return None


@dataclass(frozen=True)
class MeshDescription:
    """A DTensor's mesh as a symbolic save records it."""

    ident: Any  # the same object for every tensor on this mesh (within one process)
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks, row-major
    placements: tuple[str, ...]  # "S<dim>" / "R" per mesh dim


def _parse(p: str) -> Optional[tuple[int, int]]:
    """(tensor dim, split factor) of "S<d>" / "S<d>/<sf>", None for "R"."""
    if p == "R":
        return None
    d, _, sf = p[1:].partition("/")
    return int(d), int(sf or 1)


#: per DeviceMesh, dropped with it: its rank tensor, shape and row-major ranks
_MESHES: "weakref.WeakKeyDictionary[Any, tuple[Any, tuple[int, ...], tuple[int, ...]]]" = \
    weakref.WeakKeyDictionary()


#: per DeviceMesh, dropped with it: by permutation of its dims, the permuted shape and row-major ranks
_PERMUTED: "weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]]" = \
    weakref.WeakKeyDictionary()


def _mesh_ranks(mesh: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
    """(rank tensor, shape, row-major ranks) of ``mesh``, computed once per mesh.

    Why: ``DeviceMesh.mesh`` rebuilds its tensor from the layout on every access in
    torch 2.13 (~30 us); a save describes every DTensor, thousands in a large model."""
    try:
        hit = _MESHES.get(mesh)
    except TypeError:  # a mesh-like object that cannot be weakly referenced or hashed
        hit = None
    if hit is not None:
        return hit
    mesh_t = mesh.mesh
    entry = (mesh_t, tuple(int(d) for d in mesh_t.shape), tuple(int(r) for r in mesh_t.flatten().tolist()))
    try:
        _MESHES[mesh] = entry
    except TypeError:
        pass
    return entry


def _unstride(shape: tuple[int, ...], mesh: Any, placements: tuple[str, ...],
              ident: Any) -> Optional[MeshDescription]:
    """Strided placements as plain Shard on a permuted mesh (same points, same
    boxes), or None when no order of the mesh dims reproduces them."""
    mesh_t, mshape, ranks = _mesh_ranks(mesh)
    if not any("/" in p for p in placements):
        return MeshDescription(ident, mshape, ranks, placements)
    perm = nested_order(shape, mshape, [_parse(p) for p in placements])
    if perm is None:
        return None
    # the permuted rank list once per mesh and order, not per tensor: at 65,536 ranks
    # listing it costs ~4 ms, and FSDP2 x TP describes thousands of tensors this way
    try:
        per = _PERMUTED.setdefault(mesh, {})
    except TypeError:
        per = {}
    hit = per.get(perm)
    if hit is None:
        m = mesh_t.permute(*perm) if len(perm) > 1 else mesh_t
        hit = per[perm] = (tuple(mshape[i] for i in perm), tuple(int(r) for r in m.flatten().tolist()))
    plain = tuple("R" if p == "R" else p.partition("/")[0] for p in placements)
    return MeshDescription((ident, perm), hit[0], hit[1], tuple(plain[i] for i in perm))


def mesh_description(x: Any, placements: tuple[str, ...]) -> Optional[MeshDescription]:
    """The mesh a DTensor is described on, and its placements there; None when
    it has no symbolic description.

    A DTensor on a slice of a bigger mesh (tensor parallel on ``mesh["tp"]``
    under data parallel) is described on the root mesh, Replicate on the
    other dims: that description is the same on every rank, where the slice's
    own rank list differs from one replica to the next.  ``_StridedShard``
    placements (FSDP2 x TP: "tp" sharded first, "dp" second) are described as
    plain nested Shard on the mesh with those dims swapped, when that holds
    exactly the same indices on every point (:func:`objckpt.planning.strided.nested_order`)."""
    mesh = x.device_mesh
    shape = tuple(int(d) for d in x.shape)
    root = _root_mesh(mesh)
    names = getattr(mesh, "mesh_dim_names", None)
    rnames = getattr(root, "mesh_dim_names", None) if root is not None else None
    if root is not None and root is not mesh and names and rnames and set(names) <= set(rnames):
        pos = [rnames.index(n) for n in names]
        if pos == sorted(pos):
            by_dim = dict(zip(pos, placements))
            return _unstride(shape, root, tuple(by_dim.get(i, "R") for i in range(len(rnames))), id(root))
    return _unstride(shape, mesh, placements, id(mesh))


def is_replicate(p: Any) -> bool:
    return p.is_replicate() if hasattr(p, "is_replicate") else type(p).__name__ == "Replicate"


def replica_group(value: Any, group_ranks: Ranks) -> Optional[Ranks]:
    """Global ranks holding the same box of ``value`` as this rank, or None when unknown.

    ``group_ranks``: the global ranks of the load's process group (a plain
    tensor is held whole by each of them).  A DTensor's group is the set of
    mesh ranks whose coordinates agree on every non-``Replicate`` mesh dim; an
    :class:`Shard` carries no replica information."""
    if isinstance(value, Shard):
        return None
    if is_dtensor(value):
        mesh = value.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            return None
        index: list[Any] = []
        for d, p in enumerate(value.placements):
            index.append(slice(None) if is_replicate(p) or mesh.size(d) == 1 else coord[d])
        ranks = tuple(sorted(int(r) for r in _mesh_ranks(mesh)[0][tuple(index)].reshape(-1).tolist()))
        return ranks if set(ranks) <= set(group_ranks) else None
    if isinstance(value, torch.Tensor):
        return group_ranks
    return None


def mesh_group(value: Any, ranks: Ranks) -> Any:
    """The DeviceMesh's own process group for ``ranks`` when ``value`` is a DTensor
    replicated over exactly one mesh dim (a DP group of DP x TP), else None.

    Reusing it costs nothing; a new group would cost a rendezvous (and with NCCL
    a communicator)."""
    if not is_dtensor(value):
        return None
    import torch.distributed as dist

    mesh = value.device_mesh
    vary = [d for d, p in enumerate(value.placements) if mesh.size(d) > 1 and is_replicate(p)]
    if len(vary) != 1:
        return None
    pg = mesh.get_group(vary[0])
    return pg if tuple(sorted(dist.get_process_group_ranks(pg))) == ranks else None
