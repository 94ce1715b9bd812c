"""The three phases of a save, shared by :func:`save` and :func:`async_save`.

1. :func:`prepare` (caller's thread): describe local state, one metadata
   exchange between ranks, plan this rank's writes (cached per layout).
2. :func:`upload` (coroutine on the I/O loop): stage and upload this rank's
   blobs; reports when every part is staged.
3. :func:`finish` (a thread that may issue collectives): exchange outcomes,
   rank 0 commits the manifest, every rank learns the result.

Collectives happen only in phases 1 and 3, always in the same order on every
rank; an async save runs phase 3 on a gloo group from its own thread, never on
NCCL.
"""
from __future__ import annotations

import hashlib
import json
import math
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import _runtime
from .dist import Comm
from .checksum import crc32c
from .engine.commit import build_manifest, build_manifest_v2, commit, delete_quietly
from .engine.stats import IOStats
from .engine.write import write_plan
from .errors import CheckpointExistsError, ObjckptError, StateDictMismatchError
from .format import layout, rank_index
from .format.dtypes import dtype_name, itemsize
from .format.manifest import Layout, Mesh
from .planning.layout import TensorDesc, cell_box
from .planning.pack import SavePlan
from .planning.rank_plan import plan_for_rank, plan_for_rank_symbolic
from .planning.reshard import Box
from .planning.shard import TensorMeta
from .sharding import Shard, dtensor_placements, is_dtensor, local_part, mesh_layout
from .staging.pool import BufferPool
from .statedict import collect
from .storage import ObjectStore


@dataclass
class SaveResult:
    uri: str
    bytes: int  # tensor bytes this rank uploaded (blob sizes, padding included)
    seconds: float
    requests: int  # requests this rank made
    tensors: int
    blobs: int  # blobs this rank wrote
    manifest_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class _Symbolic:
    """The layout description every rank of a symbolic save shares (and its digest)."""

    descs: list[TensorDesc]
    meshes: list[Mesh]
    digest: bytes


@dataclass
class _Local:
    """What one rank brings to a save."""

    tree: Any
    metas: dict[str, TensorMeta]
    sources: dict[str, tuple[Box, torch.Tensor]]  # key -> (box, local tensor)
    aliases: dict[str, str]
    dtypes: dict[str, str]
    sym: Optional[_Symbolic] = None


def _collect_local(state: Any, allow_pickle: bool, comm: Optional[Comm] = None,
                   mirror: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None) -> _Local:
    """This rank's state, described.  ``mirror(key, local)``, when given, starts a
    copy of each local tensor as soon as it is found and returns the tensor the
    save then reads from (see :mod:`objckpt.staging.mirror`)."""
    early: dict[str, torch.Tensor] = {}

    def start_copy(key: str, value: Any) -> None:  # each copy starts the moment its tensor is found
        assert mirror is not None
        local = value.local if isinstance(value, Shard) else value.to_local() if is_dtensor(value) else value
        early[key] = mirror(key, local)

    col = collect(state, allow_pickle=allow_pickle, on_new=start_copy if mirror is not None else None)
    metas: dict[str, TensorMeta] = {}
    sources: dict[str, tuple[Box, torch.Tensor]] = {}
    dtypes: dict[str, str] = {}
    values: dict[str, Any] = {}
    for key, value in col.tensors.items():
        shape, dt, box, local = local_part(key, value)
        dtypes[key] = dtype_name(dt, key)
        if key in col.alias_of:
            continue
        boxes = (box,) if box is not None else ()
        metas[key] = TensorMeta(dtypes[key], shape, itemsize(dt), boxes)
        values[key] = value
        if box is not None and local is not None:
            sources[key] = (box, early.get(key, local))
    out = _Local(col.tree, metas, sources, dict(col.alias_of), dtypes)
    if comm is not None and comm.world_size > 1:
        out.sym = _describe(out, values, comm)
    return out


def _describe(local: _Local, values: dict[str, Any], comm: Comm) -> Optional[_Symbolic]:
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
            ident, mshape, granks, placements = mesh_layout(v, pl)
            mid = mesh_ids.get(ident, -1)
            if mid < 0:
                ranks = [comm.group_rank(r) for r in granks]
                if any(r is None for r in ranks):
                    return None
                mesh = Mesh(mshape, tuple(ranks))  # type: ignore[arg-type]
                mid = meshes.index(mesh) if mesh in meshes else len(meshes)
                if mid == len(meshes):
                    meshes.append(mesh)
                mesh_ids[ident] = mid
        else:
            return None
        coord = meshes[mid].coordinate(comm.rank)
        if coord is not None:
            mine = t.boxes[0] if t.boxes else None
            rule = cell_box(t.shape, meshes[mid].shape, placements, coord)
            if mine is None or (rule != mine and (math.prod(rule[1]) or math.prod(mine[1]))):
                return None
        descs.append(TensorDesc(key, tuple(t.shape), t.itemsize, mid, placements))
    digest = hashlib.blake2b(
        pickle.dumps(([(d, local.dtypes[d.key]) for d in descs], meshes, sorted(local.aliases.items()),
                      sorted(local.dtypes.items()))),
        digest_size=20,
    ).digest()
    return _Symbolic(descs, meshes, digest)


def _tree_digest(tree: Any) -> bytes:
    return hashlib.blake2b(json.dumps(tree, sort_keys=True).encode(), digest_size=20).digest()


@dataclass
class Prepared:
    """Everything phases 2 and 3 need; no reference to the caller's containers."""

    uri: str
    store: ObjectStore
    prefix: str
    rank: int
    world_size: int
    overwrite: bool
    meta: dict[str, Any]
    crc_block: int
    attempt: str
    gathered: list
    local: _Local
    plan: SavePlan
    pieces: dict[str, torch.Tensor]
    where: dict[str, tuple[str, tuple[int, ...]]]
    blob_names: list[str]
    blob_keys: list[str]
    #: symbolic saves (format v2): every tensor's layout, the rank trees, this rank's index object
    layouts: Optional[dict[str, Layout]] = None
    rank_trees: Optional[list[Any]] = None
    index_name: str = ""
    stats: IOStats = field(default_factory=IOStats)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def manifest_key(self) -> str:
        return layout.manifest_key(self.prefix)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.plan.blobs)

    @property
    def written_keys(self) -> list[str]:
        """Every object this rank writes (deleted if the save does not commit)."""
        return self.blob_keys + ([layout.join(self.prefix, self.index_name)] if self.index_name else [])


def prepare(state: Any, uri: str, st: ObjectStore, prefix: str, comm: Comm, *, overwrite: bool,
            metadata: Optional[dict[str, Any]], allow_pickle: bool, blob_size: int, part_size: int,
            crc_block: int, check_metadata: Callable[[Any], dict[str, Any]],
            mirror: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None) -> Prepared:
    """Phase 1 (caller's thread): describe, exchange, plan.

    The exchange is one all_gather of a few small values per rank: the digest
    of the symbolic layout description, the digest of the tree, and status.
    When every rank reports the same description (DTensors and plain tensors,
    the common case) that is all: each rank plans its own writes from it.
    Otherwise a second all_gather brings every rank's boxes (objckpt.Shard,
    layouts without a symbolic form), and the trees when their values differ.
    """
    t0 = time.perf_counter()
    stats = IOStats()
    mkey = layout.manifest_key(prefix)
    err: Optional[str] = None
    local_exc: Optional[BaseException] = None
    local: Optional[_Local] = None
    exists = False
    meta: dict[str, Any] = {}
    world = comm.world_size
    try:
        meta = check_metadata(metadata)
        local = _collect_local(state, allow_pickle, comm, mirror)
        if comm.rank == 0:
            exists = _runtime.run(st.head(mkey)) is not None
            stats.add(0)
    except Exception as e:
        if world == 1:
            raise
        local_exc, err = e, f"{type(e).__name__}: {e}"
    attempt = layout.new_attempt_id() if comm.rank == 0 else ""
    sym_digest = local.sym.digest if local is not None and local.sym is not None else None
    tree_digest = _tree_digest(local.tree) if local is not None and world > 1 else b""
    first = (sym_digest, tree_digest, exists, attempt, err)
    round1 = comm.all_gather_object(first) if world > 1 else [first]
    failed = [(r, g[4]) for r, g in enumerate(round1) if g[4]]
    if failed:
        raise ObjckptError(
            f"save to {uri!r} not started: " + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc
    assert local is not None
    if round1[0][2] and not overwrite:
        raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; pass overwrite=True to replace it")
    attempt = round1[0][3]
    symbolic = world > 1 and sym_digest is not None and all(g[0] == sym_digest for g in round1)
    if symbolic:
        return _prepare_symbolic(local, round1, uri, st, prefix, comm, overwrite, meta, crc_block, attempt,
                                 blob_size, part_size, stats, t0)
    mine = (local.metas, local.tree, local.aliases, local.dtypes)
    full = comm.all_gather_object(mine) if world > 1 else [mine]
    gathered = [f + (g[2], g[3], None) for f, g in zip(full, round1)]
    alias_maps = [g[2] for g in gathered]
    if any(a != alias_maps[0] for a in alias_maps):
        raise StateDictMismatchError("tied tensors differ between ranks; tie the same keys on every rank")

    items, plan = plan_for_rank([g[0] for g in gathered], comm.rank, st, blob_size, part_size)
    pieces, where = _pieces(local, items)
    names = [layout.blob_name(attempt, comm.rank, b.index) for b in plan.blobs]
    return Prepared(
        uri, st, prefix, comm.rank, world, overwrite, meta, crc_block, attempt, gathered, local,
        plan, pieces, where, names, [layout.join(prefix, n) for n in names], stats=stats, t0=t0,
    )


def _pieces(local: _Local, items: list) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, tuple[int, ...]]]]:
    pieces: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, it in enumerate(items):
        (_, src) = local.sources[it.key]
        pk = f"{it.key}\x00{i}"
        pieces[pk] = src.reshape(1) if src.dim() == 0 else src[it.row_start : it.row_end]
        where[pk] = (it.key, it.offsets)
    return pieces, where


def _prepare_symbolic(local: _Local, round1: list, uri: str, st: ObjectStore, prefix: str, comm: Comm,
                      overwrite: bool, meta: dict[str, Any], crc_block: int, attempt: str, blob_size: int,
                      part_size: int, stats: IOStats, t0: float) -> Prepared:
    sym = local.sym
    assert sym is not None
    rank_trees = None
    if any(g[1] != round1[0][1] for g in round1):  # non-tensor values differ between ranks
        rank_trees = comm.all_gather_object(local.tree)
    boxes = {k: b for k, (b, _) in local.sources.items()}
    layouts, items, plan = plan_for_rank_symbolic(sym.digest, sym.descs, sym.meshes, boxes, comm.rank, st,
                                                  blob_size, part_size)
    pieces, where = _pieces(local, items)
    names = [layout.blob_name(attempt, comm.rank, b.index) for b in plan.blobs]
    return Prepared(
        uri, st, prefix, comm.rank, comm.world_size, overwrite, meta, crc_block, attempt, [], local,
        plan, pieces, where, names, [layout.join(prefix, n) for n in names], layouts=layouts,
        rank_trees=rank_trees, index_name=layout.index_name(attempt, comm.rank), stats=stats, t0=t0,
    )


async def upload(prep: Prepared, pool: BufferPool, *, zero_copy: bool,
                 on_staged: Optional[Callable[[], None]] = None, stream: Any = None) -> tuple:
    """Phase 2 (I/O loop): this rank's blobs; returns its outcome record for phase 3."""
    try:
        crcs = await write_plan(prep.store, prep.blob_keys, prep.plan, prep.pieces, pool, prep.stats,
                                zero_copy=zero_copy, crc_block=prep.crc_block, on_staged=on_staged, stream=stream)
    except Exception as e:
        return ([], [], f"{type(e).__name__}: {e}", e)
    records = []
    for c in prep.plan.chunks:
        key, base = prep.where[c.key]
        offs = tuple(b + o for b, o in zip(base, c.offsets))
        total, blocks = crcs[c]
        records.append((key, offs, c.shape, c.blob, c.offset, c.length, total, blocks))
    blobs = [(n, b.size) for n, b in zip(prep.blob_names, prep.plan.blobs)]
    if not prep.index_name:
        return (records, blobs, None, None)
    try:  # symbolic save: the records go to this rank's index object, not to rank 0
        data = rank_index.encode(prep.attempt, prep.rank, records)
        await prep.store.put(layout.join(prep.prefix, prep.index_name), data)
        prep.stats.add(len(data))
    except Exception as e:
        return ([], [], f"writing the rank index {prep.index_name!r}: {type(e).__name__}: {e}", e)
    return ((len(data), crc32c(data)), blobs, None, None)


def finish(prep: Prepared, comm: Comm, outcome: tuple) -> SaveResult:
    """Phase 3: exchange outcomes; rank 0 commits; every rank returns or raises alike."""
    local_exc: Optional[BaseException] = outcome[3]
    if prep.world_size == 1 and local_exc is not None:
        delete_quietly(prep.store, prep.written_keys)  # e.g. blobs of an abandoned lazy save
        raise local_exc
    mine = outcome[:3]
    results = comm.all_gather_object(mine) if prep.world_size > 1 else [mine]
    failed = [(r, res[2]) for r, res in enumerate(results) if res[2]]
    st = prep.store
    if failed:
        delete_quietly(st, prep.written_keys)
        raise ObjckptError(
            f"save to {prep.uri!r} failed on {len(failed)} of {prep.world_size} rank(s), nothing committed: "
            + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc
    status_msg: tuple[str, str, int] = ("ok", "", 0)
    commit_errors: list[BaseException] = []
    if prep.rank == 0:
        if prep.layouts is not None:
            loc = prep.local
            assert loc.sym is not None
            m = build_manifest_v2(loc.sym.descs, loc.sym.meshes, prep.layouts, loc.dtypes, loc.aliases, loc.tree,
                                  prep.rank_trees, results, prep.attempt, prep.meta, prep.crc_block)
        else:
            m = build_manifest(prep.gathered, results, prep.attempt, prep.meta, prep.crc_block, prep.world_size)
        status_msg = commit(st, prep.prefix, prep.manifest_key, m, prep.overwrite, prep.uri, prep.written_keys,
                            prep.stats, commit_errors)
    if prep.world_size > 1:
        status_msg = comm.broadcast_object(status_msg)
    status, message, manifest_bytes = status_msg
    if status != "ok":
        if prep.rank != 0 and status == "failed-clean":
            delete_quietly(st, prep.written_keys)
        if status.startswith("exists"):
            raise CheckpointExistsError(message)
        if commit_errors and prep.world_size == 1:
            raise commit_errors[0]
        raise ObjckptError(message)
    return SaveResult(prep.uri, prep.nbytes, time.perf_counter() - prep.t0, prep.stats.requests,
                      len(prep.local.dtypes), len(prep.plan.blobs), manifest_bytes)
