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

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import _runtime
from .dist import Comm
from .engine.commit import build_manifest, commit, delete_quietly
from .engine.stats import IOStats
from .engine.write import write_plan
from .errors import CheckpointExistsError, ObjckptError, StateDictMismatchError
from .format import layout
from .format.dtypes import dtype_name, itemsize
from .planning.pack import SavePlan
from .planning.rank_plan import plan_for_rank
from .planning.reshard import Box
from .planning.shard import TensorMeta
from .sharding import local_part
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
class _Local:
    """What one rank brings to a save."""

    tree: Any
    metas: dict[str, TensorMeta]
    sources: dict[str, tuple[Box, torch.Tensor]]  # key -> (box, local tensor)
    aliases: dict[str, str]
    dtypes: dict[str, str]


def _collect_local(state: Any, allow_pickle: bool) -> _Local:
    col = collect(state, allow_pickle=allow_pickle)
    metas: dict[str, TensorMeta] = {}
    sources: dict[str, tuple[Box, torch.Tensor]] = {}
    dtypes: dict[str, str] = {}
    for key, value in col.tensors.items():
        shape, dt, box, local = local_part(key, value)
        dtypes[key] = dtype_name(dt, key)
        if key in col.alias_of:
            continue
        boxes = (box,) if box is not None else ()
        metas[key] = TensorMeta(dtypes[key], shape, itemsize(dt), boxes)
        if box is not None and local is not None:
            sources[key] = (box, local)
    return _Local(col.tree, metas, sources, dict(col.alias_of), dtypes)


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
    stats: IOStats = field(default_factory=IOStats)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def manifest_key(self) -> str:
        return layout.manifest_key(self.prefix)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.plan.blobs)


def prepare(state: Any, uri: str, st: ObjectStore, prefix: str, comm: Comm, *, overwrite: bool,
            metadata: Optional[dict[str, Any]], allow_pickle: bool, blob_size: int, part_size: int,
            crc_block: int, check_metadata: Callable[[Any], dict[str, Any]]) -> Prepared:
    """Phase 1 (caller's thread): describe, exchange, plan."""
    t0 = time.perf_counter()
    stats = IOStats()
    mkey = layout.manifest_key(prefix)
    err: Optional[str] = None
    local_exc: Optional[BaseException] = None
    local: Optional[_Local] = None
    exists = False
    meta: dict[str, Any] = {}
    try:
        meta = check_metadata(metadata)
        local = _collect_local(state, allow_pickle)
        if comm.rank == 0:
            exists = _runtime.run(st.head(mkey)) is not None
            stats.add(0)
    except Exception as e:
        if comm.world_size == 1:
            raise
        local_exc, err = e, f"{type(e).__name__}: {e}"
    attempt = layout.new_attempt_id() if comm.rank == 0 else ""
    if local is None:
        payload: tuple = (None, None, None, None, exists, attempt, err)
    else:
        payload = (local.metas, local.tree, local.aliases, local.dtypes, exists, attempt, None)
    gathered = comm.all_gather_object(payload) if comm.world_size > 1 else [payload]
    failed = [(r, g[6]) for r, g in enumerate(gathered) if g[6]]
    if failed:
        raise ObjckptError(
            f"save to {uri!r} not started: " + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc
    assert local is not None
    if gathered[0][4] and not overwrite:
        raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; pass overwrite=True to replace it")
    attempt = gathered[0][5]
    alias_maps = [g[2] for g in gathered]
    if any(a != alias_maps[0] for a in alias_maps):
        raise StateDictMismatchError("tied tensors differ between ranks; tie the same keys on every rank")

    items, plan = plan_for_rank([g[0] for g in gathered], comm.rank, st, blob_size, part_size)
    pieces: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, it in enumerate(items):
        (_, src) = local.sources[it.key]
        pk = f"{it.key}\x00{i}"
        pieces[pk] = src.reshape(1) if src.dim() == 0 else src[it.row_start : it.row_end]
        where[pk] = (it.key, it.offsets)
    names = [layout.blob_name(attempt, comm.rank, b.index) for b in plan.blobs]
    return Prepared(
        uri, st, prefix, comm.rank, comm.world_size, overwrite, meta, crc_block, attempt, gathered, local,
        plan, pieces, where, names, [layout.join(prefix, n) for n in names], stats, t0,
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
    return (records, [(n, b.size) for n, b in zip(prep.blob_names, prep.plan.blobs)], None, None)


def finish(prep: Prepared, comm: Comm, outcome: tuple) -> SaveResult:
    """Phase 3: exchange outcomes; rank 0 commits; every rank returns or raises alike."""
    local_exc: Optional[BaseException] = outcome[3]
    if prep.world_size == 1 and local_exc is not None:
        delete_quietly(prep.store, prep.blob_keys)  # e.g. blobs of an abandoned lazy save
        raise local_exc
    mine = outcome[:3]
    results = comm.all_gather_object(mine) if prep.world_size > 1 else [mine]
    failed = [(r, res[2]) for r, res in enumerate(results) if res[2]]
    st = prep.store
    if failed:
        delete_quietly(st, prep.blob_keys)
        raise ObjckptError(
            f"save to {prep.uri!r} failed on {len(failed)} of {prep.world_size} rank(s), nothing committed: "
            + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc
    status_msg: tuple[str, str, int] = ("ok", "", 0)
    commit_errors: list[BaseException] = []
    if prep.rank == 0:
        m = build_manifest(prep.gathered, results, prep.attempt, prep.meta, prep.crc_block, prep.world_size)
        status_msg = commit(st, prep.prefix, prep.manifest_key, m, prep.overwrite, prep.uri, prep.blob_keys,
                            prep.stats, commit_errors)
    if prep.world_size > 1:
        status_msg = comm.broadcast_object(status_msg)
    status, message, manifest_bytes = status_msg
    if status != "ok":
        if prep.rank != 0 and status == "failed-clean":
            delete_quietly(st, prep.blob_keys)
        if status.startswith("exists"):
            raise CheckpointExistsError(message)
        if commit_errors and prep.world_size == 1:
            raise commit_errors[0]
        raise ObjckptError(message)
    return SaveResult(prep.uri, prep.nbytes, time.perf_counter() - prep.t0, prep.stats.requests,
                      len(prep.local.dtypes), len(prep.plan.blobs), manifest_bytes)
