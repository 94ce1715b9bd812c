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
from .dist.fanout import Fanout
from .engine.fill import fill_boxes
from .engine.resolve import ChunkResolver
from .engine.stats import IOStats
from .errors import MissingKeyError, NotFoundError, StateDictMismatchError
from .format import layout
from .format.dtypes import dtype_from_name
from .format.manifest import Manifest, decode
from .format.tree import decode_tree, iter_leaves
from .planning.reshard import Box
from .sharding import Shard, local_part
from .staging.pool import default_pool
from .statedict import template_slots
from .storage import ObjectStore, open_store, split_uri
from . import saving
from .saving import SaveResult

MiB = 1 << 20


@dataclass
class LoadResult:
    uri: str
    bytes: int  # bytes this rank fetched from storage (manifest included)
    seconds: float
    requests: int
    tensors: int
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    received_bytes: int = 0  # bytes this rank received from other ranks (collective reads)
    strategy: str = "direct"  # how replicated tensors were read: direct, broadcast, allgather ("+"-joined if mixed)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def _open(uri: str, storage_options: Optional[dict[str, Any]], store: Optional[ObjectStore]) -> tuple[ObjectStore, str]:
    if store is None:
        return open_store(uri, storage_options)
    return store, split_uri(uri)[2].strip("/")


# --------------------------------------------------------------------------- save


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
    comm = get_comm(process_group)
    st, prefix = _open(uri, storage_options, store)
    prep = saving.prepare(state_dict, uri, st, prefix, comm, overwrite=overwrite, metadata=metadata,
                          allow_pickle=allow_pickle, blob_size=blob_size, part_size=part_size,
                          crc_block=crc_block, check_metadata=_check_metadata)
    outcome = _runtime.run(saving.upload(prep, default_pool(staging_bytes), zero_copy=True))
    return saving.finish(prep, comm, outcome)


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
    uri: str, *, storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None,
    chunks: bool = True,
) -> Manifest:
    """The checkpoint's manifest: keys, dtypes, shapes, chunks, blobs, metadata.

    A multi-rank checkpoint in format v2 keeps its chunk records in one index
    object per rank; ``chunks=True`` fetches them all so every tensor lists its
    chunks, ``chunks=False`` returns the manifest alone (one GET)."""
    st, prefix = _open(uri, storage_options, store)

    async def go() -> Manifest:
        m = await _fetch_manifest(st, prefix, uri)
        if chunks and m.rank_indexes:
            await ChunkResolver(m, st, prefix).resolve_all()
        return m

    return _runtime.run(go())


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
    read_strategy: str = "auto",
    collective_bytes: int = 256 * MiB,
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

    ``read_strategy`` says how ranks that need the same bytes (replicated
    tensors, the DP groups of a DP x TP layout) read them: ``"direct"`` (each
    rank from storage), ``"broadcast"`` (one member of each replica group
    reads, then broadcasts), ``"allgather"`` (each member reads a disjoint
    share, then all-gather) or ``"auto"`` (a cost model picks per group;
    ``"direct"`` without a process group).  Every rank must pass the same
    value.  Collectives run in batches of at most ``collective_bytes``; a
    failed read on any rank makes every rank raise.  See
    :mod:`objckpt.dist.fanout`.
    """
    fan = Fanout(get_comm(process_group), read_strategy, collective_bytes)
    with fan.failing_together():
        return _load(state_dict, uri, fan, storage_options, strict, allow_pickle, store)


def _load(state_dict: Any, uri: str, fan: Fanout, storage_options: Optional[dict[str, Any]], strict: bool,
          allow_pickle: bool, store: Optional[ObjectStore]) -> LoadResult:
    t0 = time.perf_counter()
    rank = fan.comm.rank
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
    sources: list[Any] = []  # the state-dict value of each target: its layout gives the replica group
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
        sources.append(s.value)
    if problems:
        raise StateDictMismatchError(f"cannot load {uri!r}: " + "; ".join(problems[:20]))
    fan.fill(st, prefix, m, targets, sources, stats, uri)
    for s in value_slots:
        if s.container is not None and not isinstance(s.container, tuple):
            s.container[s.index] = decode_tree(leaves[s.key], lambda k: None, allow_pickle=allow_pickle, where=repr(uri))
    return LoadResult(uri, stats.bytes, time.perf_counter() - t0, stats.requests, n_tensors, missing, unexpected,
                      fan.received_bytes, fan.strategy)
