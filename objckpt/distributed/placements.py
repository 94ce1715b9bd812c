"""Everything objckpt knows of DTensor placements and hand-made shards.

What part of a global tensor each rank holds, how a DTensor's mesh and
placements are described symbolically, and which ranks hold the same box
(replica groups): the one module that looks inside DTensors.

Three kinds of tensor leaves are understood:

* a plain ``torch.Tensor``: the whole tensor, identical on every rank
  (replicated), so it is written once, its bytes spread over the replicas;
* a ``DTensor`` (any DeviceMesh, Shard(d)/Replicate placements, uneven shards):
  its local shard is the box torch computes for this rank;
* :class:`Shard`: a local tensor plus its global shape and offsets, for
  frameworks that shard by hand (Megatron style).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import UnsupportedValueError
from ..planning.boxes import Box

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


@functools.lru_cache(maxsize=1)
def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor  # torch >= 2.5
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor  # type: ignore[no-redef]  # torch 2.4
        except ImportError:
            return None
    return DTensor


def is_dtensor(x: Any) -> bool:
    t = _dtensor_type()
    return t is not None and isinstance(x, t)


def _dtensor_box(key: str, dt: Any) -> Optional[Box]:
    placements = list(dt.placements)
    for p in placements:
        name = type(p).__name__
        if name == "_StridedShard":
            raise UnsupportedValueError(
                f"tensor {key!r}: DTensor placement {p} (strided sharding, FSDP2 + TP) is not supported yet; "
                "call .redistribute() to plain Shard/Replicate placements first"
            )
        if name == "Partial" or (hasattr(p, "is_partial") and p.is_partial()):
            raise UnsupportedValueError(
                f"tensor {key!r}: DTensor has a Partial placement (pending reduction); reduce it before saving"
            )
    mesh = dt.device_mesh
    if mesh.get_coordinate() is None:  # this rank is not in the mesh
        return None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset  # type: ignore
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


@dataclass(frozen=True)
class LocalPart:
    """What this rank holds of a tensor leaf."""

    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    box: Optional[Box]  # None: this rank holds no part of it (outside the DTensor's mesh)
    local: Optional[torch.Tensor]  # the local tensor holding ``box``


def local_part(key: str, x: Any) -> LocalPart:
    """This rank's part of a plain tensor (all of it), a DTensor or an :class:`Shard`."""
    if isinstance(x, Shard):
        return LocalPart(x.global_shape, x.local.dtype, (x.global_offsets, tuple(x.local.shape)), x.local)
    if is_dtensor(x):
        box = _dtensor_box(key, x)
        local = x.to_local() if box is not None else None
        if local is not None and box is not None and tuple(local.shape) != box[1]:
            raise UnsupportedValueError(
                f"tensor {key!r}: DTensor local shard has shape {list(local.shape)}, expected {list(box[1])}"
            )
        return LocalPart(tuple(int(d) for d in x.shape), x.dtype, box, local)
    t: torch.Tensor = x
    return LocalPart(tuple(t.shape), t.dtype, (tuple(0 for _ in t.shape), tuple(t.shape)), t)


def dtensor_placements(x: Any) -> Optional[tuple[str, ...]]:
    """A DTensor's placements as layout strings ("S<dim>", "R"); None when one
    of them has no symbolic form (the save then lists its chunks)."""
    out = []
    for p in x.placements:
        name = type(p).__name__
        if name == "Shard":
            out.append(f"S{int(p.dim)}")
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


def mesh_description(x: Any, placements: tuple[str, ...]) -> MeshDescription:
    """The mesh a DTensor is described on, and its placements there.

    A DTensor on a slice of a bigger mesh (tensor parallel on ``mesh["tp"]``
    under data parallel) is described on the root mesh, Replicate on the
    other dims: that description is the same on every rank, where the slice's
    own rank list differs from one replica to the next."""
    mesh = x.device_mesh
    root = _root_mesh(mesh)
    names = getattr(mesh, "mesh_dim_names", None)
    rnames = getattr(root, "mesh_dim_names", None) if root is not None else None
    if root is not None and root is not mesh and names and rnames and set(names) <= set(rnames):
        pos = [rnames.index(n) for n in names]
        if pos == sorted(pos):
            by_dim = dict(zip(pos, placements))
            m = root.mesh
            return MeshDescription(id(root), tuple(int(d) for d in m.shape),
                                   tuple(int(r) for r in m.flatten().tolist()),
                                   tuple(by_dim.get(i, "R") for i in range(len(rnames))))
    m = mesh.mesh
    return MeshDescription(id(mesh), tuple(int(d) for d in m.shape), tuple(int(r) for r in m.flatten().tolist()),
                           placements)


def _is_replicate(p: Any) -> bool:
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
            index.append(slice(None) if _is_replicate(p) or mesh.size(d) == 1 else coord[d])
        ranks = tuple(sorted(int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist()))
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
    vary = [d for d, p in enumerate(value.placements) if mesh.size(d) > 1 and _is_replicate(p)]
    if len(vary) != 1:
        return None
    pg = mesh.get_group(vary[0])
    return pg if tuple(sorted(dist.get_process_group_ranks(pg))) == ranks else None
