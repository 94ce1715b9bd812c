"""save / load / read / inspect: plan -> stage -> write -> commit, and back.

The functions are synchronous.  Collectives (only in multi-rank saves: one
metadata exchange, one outcome exchange, one commit broadcast) run in the
caller's thread; all storage I/O runs as one coroutine at a time on objckpt's
background loop (see :mod:`objckpt._runtime`).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from . import _runtime
from .dist import get_comm
from .engine.commit import build_manifest, commit, delete_quietly
from .engine.fill import fill_boxes
from .engine.stats import IOStats
from .engine.write import write_plan
from .errors import (
    CheckpointExistsError,
    MissingKeyError,
    NotFoundError,
    ObjckptError,
    StateDictMismatchError,
)
from .format import layout
from .format.dtypes import dtype_from_name, dtype_name, itemsize
from .format.manifest import Manifest, decode
from .format.tree import decode_tree, iter_leaves
from .planning.rank_plan import plan_for_rank
from .planning.reshard import Box
from .planning.shard import TensorMeta
from .sharding import Shard, local_part
from .staging.pool import default_pool
from .statedict import collect, template_slots
from .storage import ObjectStore, open_store, split_uri

MiB = 1 << 20


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
class LoadResult:
    uri: str
    bytes: int  # bytes this rank fetched from storage (manifest included)
    seconds: float
    requests: int
    tensors: int
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def _open(uri: str, storage_options: Optional[dict[str, Any]], store: Optional[ObjectStore]) -> tuple[ObjectStore, str]:
    if store is None:
        return open_store(uri, storage_options)
    return store, split_uri(uri)[2].strip("/")


# --------------------------------------------------------------------------- save


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


def save(
    state_dict: Any,
    uri: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    overwrite: bool = False,
    metadata: Optional[dict[str, Any]] = None,
    allow_pickle: bool = False,
    process_group: Any = None,
    blob_size: int = 1 << 30,
    part_size: int = 16 * MiB,
    staging_bytes: int = 512 * MiB,
    crc_block: int = 1 * MiB,
    store: Optional[ObjectStore] = None,
) -> SaveResult:
    """Save ``state_dict`` (nested dicts/lists of tensors and plain values) to ``uri``.

    In a torch.distributed job every rank calls it with the same ``uri``: each
    rank writes only its own shards (DTensor, :class:`objckpt.Shard`), plain
    tensors count as replicated and are written once with the work spread over
    the ranks, and rank 0 commits the manifest after every rank succeeded.
    Tensor bytes go to a few large blobs as parallel (multipart) uploads; the
    manifest is written last and conditionally, so the checkpoint appears whole
    or not at all.  Raises :class:`CheckpointExistsError` when a checkpoint is
    already committed at ``uri`` unless ``overwrite=True`` (the old one stays
    loadable until the new manifest replaces it).  ``metadata`` is free-form
    JSON stored in the manifest.  ``store`` replaces the backend the URI would
    open (custom backends, wrappers); the URI's path is then the prefix.
    """
    t0 = time.perf_counter()
    comm = get_comm(process_group)
    st, prefix = _open(uri, storage_options, store)
    mkey = layout.manifest_key(prefix)
    stats = IOStats()

    # 1. local checks, then one exchange of metadata (and of any local error)
    err: Optional[str] = None
    local_exc: Optional[BaseException] = None
    local: Optional[_Local] = None
    exists = False
    try:
        meta = _check_metadata(metadata)
        local = _collect_local(state_dict, allow_pickle)
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

    # 2. who writes what (the same pure computation on every rank), then this rank's blobs
    items, plan = plan_for_rank([g[0] for g in gathered], comm.rank, st, blob_size, part_size)
    pieces: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[str, tuple[int, ...]]] = {}
    for i, it in enumerate(items):
        (_, src) = local.sources[it.key]
        pk = f"{it.key}\x00{i}"
        pieces[pk] = src.reshape(1) if src.dim() == 0 else src[it.row_start : it.row_end]
        where[pk] = (it.key, it.offsets)
    names = [layout.blob_name(attempt, comm.rank, b.index) for b in plan.blobs]
    keys = [layout.join(prefix, n) for n in names]
    records: list[tuple] = []
    werr: Optional[str] = None
    try:
        crcs = _runtime.run(write_plan(st, keys, plan, pieces, default_pool(staging_bytes), stats, crc_block=crc_block))
        for c in plan.chunks:
            key, base = where[c.key]
            offs = tuple(b + o for b, o in zip(base, c.offsets))
            total, blocks = crcs[c]
            records.append((key, offs, c.shape, c.blob, c.offset, c.length, total, blocks))
    except Exception as e:
        if comm.world_size == 1:
            raise
        local_exc, werr = e, f"{type(e).__name__}: {e}"
    mine = (records, [(n, b.size) for n, b in zip(names, plan.blobs)], werr)
    results = comm.all_gather_object(mine) if comm.world_size > 1 else [mine]
    failed = [(r, res[2]) for r, res in enumerate(results) if res[2]]
    if failed:
        delete_quietly(st, keys)
        raise ObjckptError(
            f"save to {uri!r} failed on {len(failed)} of {comm.world_size} rank(s), nothing committed: "
            + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc

    # 3. rank 0 builds and commits the manifest; everyone learns the outcome
    outcome: tuple[str, str, int] = ("ok", "", 0)
    commit_errors: list[BaseException] = []
    if comm.rank == 0:
        m = build_manifest(gathered, results, attempt, meta, crc_block, comm.world_size)
        outcome = commit(st, prefix, mkey, m, overwrite, uri, keys, stats, commit_errors)
    if comm.world_size > 1:
        outcome = comm.broadcast_object(outcome)
    status, message, manifest_bytes = outcome
    if status != "ok":
        if comm.rank != 0 and status == "failed-clean":
            delete_quietly(st, keys)
        if status.startswith("exists"):
            raise CheckpointExistsError(message)
        if commit_errors and comm.world_size == 1:
            raise commit_errors[0]
        raise ObjckptError(message)
    return SaveResult(uri, sum(b.size for b in plan.blobs), time.perf_counter() - t0, stats.requests,
                      len(local.dtypes), len(plan.blobs), manifest_bytes)


def _check_metadata(metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a JSON object (dict), got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable: {e}") from None
    return metadata


# --------------------------------------------------------------------------- manifest


async def _fetch_manifest(store: ObjectStore, prefix: str, uri: str, stats: Optional[IOStats] = None) -> Manifest:
    mkey = layout.manifest_key(prefix)
    try:
        data = await store.get(mkey)
    except NotFoundError:
        raise NotFoundError(f"no checkpoint at {uri!r} (no {layout.MANIFEST_NAME} under it)") from None
    if stats is not None:
        stats.add(len(data))
    return decode(data, f"{uri.rstrip('/')}/{layout.MANIFEST_NAME}")


def inspect(
    uri: str, *, storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None
) -> Manifest:
    """The checkpoint's manifest: keys, dtypes, shapes, chunks, blobs, metadata."""
    st, prefix = _open(uri, storage_options, store)
    return _runtime.run(_fetch_manifest(st, prefix, uri))


# --------------------------------------------------------------------------- reading boxes


def _stored_key(m: Manifest, key: str) -> str:
    return m.tensors[key].alias_of or key


def _whole(m: Manifest, key: str) -> Box:
    shape = m.tensors[key].shape
    return tuple(0 for _ in shape), tuple(shape)


def read(
    uri: str,
    keys: Optional[Iterable[str]] = None,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    allow_pickle: bool = False,
    store: Optional[ObjectStore] = None,
) -> Any:
    """Tensors (on CPU) and values of a checkpoint, without a template.

    ``keys=None`` returns the whole saved structure (nested as it was saved,
    tied tensors tied again, sharded tensors assembled whole).  With ``keys``,
    returns ``{key: value}`` for just those leaves and fetches only their bytes.
    """
    st, prefix = _open(uri, storage_options, store)
    stats = IOStats()
    m = _runtime.run(_fetch_manifest(st, prefix, uri, stats))
    leaves = dict(iter_leaves(m.tree))
    wanted_keys = list(keys) if keys is not None else None
    if wanted_keys is None:
        wanted = list(m.tensors)
    else:
        missing = [k for k in wanted_keys if k not in leaves]
        if missing:
            raise MissingKeyError(
                f"key(s) {missing[:10]} not in checkpoint {uri!r} (it has {len(leaves)} keys, e.g. {list(leaves)[:5]})"
            )
        wanted = [k for k in wanted_keys if k in m.tensors]
    bufs: dict[str, torch.Tensor] = {}
    for k in wanted:
        sk = _stored_key(m, k)
        if sk not in bufs:
            e = m.tensors[sk]
            bufs[sk] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype, sk))
    fill_boxes(st, prefix, m, [(k, _whole(m, k), t) for k, t in bufs.items()], stats)

    def get_tensor(k: str) -> torch.Tensor:
        return bufs[_stored_key(m, k)]

    if wanted_keys is None:
        return decode_tree(m.tree, get_tensor, allow_pickle=allow_pickle, where=repr(uri))
    return {k: decode_tree(leaves[k], get_tensor, allow_pickle=allow_pickle, where=repr(uri)) for k in wanted_keys}


# --------------------------------------------------------------------------- load


def load(
    state_dict: Any,
    uri: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    strict: bool = True,
    allow_pickle: bool = False,
    process_group: Any = None,
    store: Optional[ObjectStore] = None,
) -> LoadResult:
    """Fill ``state_dict``'s tensors in place (any device) from the checkpoint.

    Tensors may be plain (the whole tensor is loaded), DTensors (each rank
    fills its local shard) or :class:`objckpt.Shard`; the checkpoint may have
    been saved with any other layout and world size.  Each rank fetches only
    the bytes that overlap what it holds.  Non-tensor values in dicts and lists
    are replaced by the saved ones (per rank, when ranks saved different
    values).  Dtype and global shape must match exactly.  With ``strict`` (the
    default) keys missing from the checkpoint or not in ``state_dict`` are an
    error; otherwise they are reported in the result.
    """
    t0 = time.perf_counter()
    rank = get_comm(process_group).rank
    st, prefix = _open(uri, storage_options, store)
    stats = IOStats()
    m = _runtime.run(_fetch_manifest(st, prefix, uri, stats))
    tree = m.rank_trees[rank] if m.rank_trees and rank < len(m.rank_trees) else m.tree
    leaves = dict(iter_leaves(tree))
    slots = list(template_slots(state_dict))
    tkeys = {s.key for s in slots}
    missing = [s.key for s in slots if s.key not in leaves]
    unexpected = [k for k in leaves if k not in tkeys]
    if strict and (missing or unexpected):
        raise StateDictMismatchError(
            f"state dict does not match checkpoint {uri!r}: missing from checkpoint {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}; in checkpoint but not in state dict {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''} (pass strict=False to load the common keys)"
        )
    problems: list[str] = []
    targets: list[tuple[str, Box, torch.Tensor]] = []
    value_slots = []
    seen: set[tuple] = set()
    n_tensors = 0
    for s in slots:
        if s.key not in leaves:
            continue
        is_t = isinstance(s.value, (torch.Tensor, Shard))
        in_ckpt_t = s.key in m.tensors
        if is_t != in_ckpt_t:
            problems.append(f"{s.key!r}: {'tensor' if is_t else 'value'} in state dict, "
                            f"{'tensor' if in_ckpt_t else 'value'} in checkpoint")
            continue
        if not is_t:
            value_slots.append(s)
            continue
        e = m.tensors[s.key]
        shape, dt, box, local = local_part(s.key, s.value)
        if dt != dtype_from_name(e.dtype, s.key) or tuple(shape) != e.shape:
            problems.append(f"{s.key!r}: state dict has {dt} {list(shape)}, checkpoint has {e.dtype} {list(e.shape)}")
            continue
        if box is None or local is None:
            continue  # this rank holds no part of it
        n_tensors += 1
        sk = _stored_key(m, s.key)
        ident = (local.device, local.data_ptr(), tuple(local.shape), tuple(local.stride()), sk, box)
        if ident in seen and local.numel():
            continue  # tied destination: fill once
        seen.add(ident)
        targets.append((sk, box, local))
    if problems:
        raise StateDictMismatchError(f"cannot load {uri!r}: " + "; ".join(problems[:20]))
    fill_boxes(st, prefix, m, targets, stats)
    for s in value_slots:
        if s.container is not None and not isinstance(s.container, tuple):
            s.container[s.index] = decode_tree(leaves[s.key], lambda k: None, allow_pickle=allow_pickle, where=repr(uri))
    return LoadResult(uri, stats.bytes, time.perf_counter() - t0, stats.requests, n_tensors, missing, unexpected)
