"""save / load / read / inspect: plan -> stage -> write -> commit, and back.

The sync functions are thin wrappers that run one coroutine on objckpt's
background loop (see :mod:`objckpt._runtime`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from . import __version__, _runtime
from .engine.read import ChunkRead, read_chunks
from .engine.stats import IOStats
from .engine.write import write_plan
from .errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    MissingKeyError,
    NotFoundError,
    PreconditionFailed,
    StateDictMismatchError,
)
from .format import layout
from .format.dtypes import dtype_from_name, dtype_name, itemsize
from .format.manifest import Blob, Chunk, Manifest, TensorEntry, decode, encode
from .format.tree import decode_tree, iter_leaves
from .planning.pack import TensorSpec, plan_save
from .staging.pool import default_pool
from .statedict import collect, template_slots
from .storage import ObjectStore, open_store

MiB = 1 << 20


@dataclass
class SaveResult:
    uri: str
    bytes: int  # tensor bytes uploaded (blob sizes, padding included)
    seconds: float
    requests: int
    tensors: int
    blobs: int
    manifest_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class LoadResult:
    uri: str
    bytes: int  # bytes fetched from storage (manifest included)
    seconds: float
    requests: int
    tensors: int
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


# --------------------------------------------------------------------------- save


def save(
    state_dict: Any,
    uri: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    overwrite: bool = False,
    metadata: Optional[dict[str, Any]] = None,
    allow_pickle: bool = False,
    blob_size: int = 1 << 30,
    part_size: int = 16 * MiB,
    staging_bytes: int = 512 * MiB,
    crc_block: int = 1 * MiB,
    store: Optional[ObjectStore] = None,
) -> SaveResult:
    """Save ``state_dict`` (nested dicts/lists of tensors and plain values) to ``uri``.

    Tensor bytes go to a few large blobs under ``uri`` as parallel (multipart)
    uploads; the manifest is written last and conditionally, so the checkpoint
    appears whole or not at all.  Raises :class:`CheckpointExistsError` when a
    checkpoint is already committed at ``uri`` unless ``overwrite=True`` (the old
    one stays loadable until the new manifest replaces it).  ``metadata`` is
    free-form JSON stored in the manifest.  ``store`` replaces the backend the
    URI would open (custom backends, wrappers); the URI's path is the prefix.
    """
    return _runtime.run(
        _save(state_dict, uri, storage_options, overwrite, metadata, allow_pickle, blob_size, part_size,
              staging_bytes, crc_block, store)
    )


async def _save(
    state: Any,
    uri: str,
    storage_options: Optional[dict[str, Any]],
    overwrite: bool,
    metadata: Optional[dict[str, Any]],
    allow_pickle: bool,
    blob_size: int,
    part_size: int,
    staging_bytes: int,
    crc_block: int,
    store_override: Optional[ObjectStore],
) -> SaveResult:
    t0 = time.perf_counter()
    store, prefix = _open(uri, storage_options, store_override)
    meta = _check_metadata(metadata)
    col = collect(state, allow_pickle=allow_pickle)
    stored = [k for k in col.tensors if k not in col.alias_of]
    specs = [TensorSpec(k, tuple(col.tensors[k].shape), col.tensors[k].element_size()) for k in stored]
    part = max(part_size, store.min_part_size)
    plan = plan_save(
        specs, blob_bytes=blob_size, part_bytes=part, chunk_bytes=part_size, max_part_bytes=store.max_part_size
    )
    mkey = layout.manifest_key(prefix)
    stats = IOStats()

    old: Optional[Manifest] = None
    if await store.head(mkey) is not None:
        stats.add(0)
        if not overwrite:
            raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; pass overwrite=True to replace it")
        try:
            old = decode(await store.get(mkey), mkey)
        except Exception:
            old = None  # unreadable: replace it, leave its blobs to gc

    attempt = layout.new_attempt_id()
    names = [layout.blob_name(attempt, 0, b.index) for b in plan.blobs]
    keys = [layout.join(prefix, n) for n in names]
    pool = default_pool(staging_bytes)
    crcs = await write_plan(store, keys, plan, col.tensors, pool, stats, crc_block=crc_block)

    entries: dict[str, TensorEntry] = {}
    for k, t in col.tensors.items():
        entries[k] = TensorEntry(k, dtype_name(t.dtype, k), tuple(t.shape), alias_of=col.alias_of.get(k))
    for c in plan.chunks:
        total, blocks = crcs[c]
        entries[c.key].chunks.append(Chunk(c.offsets, c.shape, c.blob, c.offset, c.length, total, blocks))
    manifest = Manifest(
        tensors=entries,
        blobs=[Blob(n, b.size, 0) for n, b in zip(names, plan.blobs)],
        tree=col.tree,
        metadata=meta,
        attempt=attempt,
        world_size=1,
        writer=f"objckpt {__version__}",
        crc_block=crc_block,
    )
    data = encode(manifest)
    try:
        await store.put(mkey, data, if_absent=not overwrite)
        stats.add(len(data))
    except BaseException as e:
        # The PUT may have landed even though we saw an error (a lost reply, then
        # a retry answered 412): look before deleting anything a manifest may
        # point to.
        committed = await _committed_attempt(store, mkey)
        if committed != attempt:
            if committed != "?":  # ours is certainly not referenced: remove its blobs
                try:
                    await store.delete(keys)
                except Exception:
                    pass  # unreferenced: gc sweeps them
            if isinstance(e, PreconditionFailed):
                raise CheckpointExistsError(f"another writer committed a checkpoint at {uri!r} first") from None
            raise
        stats.add(len(data))
    if old is not None:  # the replaced checkpoint's blobs are garbage now
        live = set(names)
        stale = [layout.join(prefix, b.name) for b in old.blobs if b.name not in live]
        try:
            await store.delete(stale)
        except Exception:
            pass  # gc sweeps them
    return SaveResult(
        uri, sum(b.size for b in plan.blobs), time.perf_counter() - t0, stats.requests,
        len(col.tensors), len(plan.blobs), len(data),
    )


async def _committed_attempt(store: ObjectStore, mkey: str) -> Optional[str]:
    """The attempt id of the manifest now at ``mkey``; None if absent, "?" if unknown."""
    try:
        return decode(await store.get(mkey), mkey).attempt
    except NotFoundError:
        return None
    except Exception:
        return "?"


def _check_metadata(metadata: Optional[dict[str, Any]]) -> dict[str, Any]:
    import json

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


def _open(uri: str, storage_options: Optional[dict[str, Any]], store: Optional[ObjectStore]) -> tuple[ObjectStore, str]:
    if store is None:
        return open_store(uri, storage_options)
    from .storage import split_uri

    return store, split_uri(uri)[2].strip("/")


def inspect(
    uri: str, *, storage_options: Optional[dict[str, Any]] = None, store: Optional[ObjectStore] = None
) -> Manifest:
    """The checkpoint's manifest: keys, dtypes, shapes, chunks, blobs, metadata."""
    store, prefix = _open(uri, storage_options, store)
    return _runtime.run(_fetch_manifest(store, prefix, uri))


# --------------------------------------------------------------------------- reading


def _row_span(entry: TensorEntry, c: Chunk) -> tuple[int, int]:
    """Byte offset/length of chunk ``c`` inside the row-major tensor ``entry``."""
    shape = entry.shape
    if len(shape) == 0:
        return 0, c.length
    if tuple(c.shape[1:]) != tuple(shape[1:]) or any(c.offsets[1:]):
        raise CorruptCheckpointError(
            f"tensor {entry.key!r}: chunk at {list(c.offsets)} of shape {list(c.shape)} is not a run of whole rows; "
            "this release reads only row-chunked tensors"
        )
    item = itemsize(dtype_from_name(entry.dtype, entry.key))
    row_bytes = math.prod(shape[1:]) * item
    if c.length != c.shape[0] * row_bytes or c.offsets[0] + c.shape[0] > shape[0]:
        raise CorruptCheckpointError(f"tensor {entry.key!r}: chunk at {list(c.offsets)} has inconsistent size")
    return c.offsets[0] * row_bytes, c.length


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (no copy)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _direct_ok(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and type(t) in (torch.Tensor, torch.nn.Parameter)
    )


def _check_coverage(entry: TensorEntry) -> None:
    """The chunks tile the tensor exactly: no gap (uninitialised bytes), no overlap."""
    if len(entry.shape) == 0:
        ok = len(entry.chunks) == 1 and entry.chunks[0].length == itemsize(dtype_from_name(entry.dtype, entry.key))
    elif entry.numel == 0:
        ok = all(c.length == 0 for c in entry.chunks)
    else:
        rows = sorted((c.offsets[0], c.offsets[0] + c.shape[0]) for c in entry.chunks if c.shape[0])
        ok = bool(rows) and rows[0][0] == 0 and rows[-1][1] == entry.shape[0]
        ok = ok and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    if not ok:
        raise CorruptCheckpointError(
            f"tensor {entry.key!r}: its chunks do not cover shape {list(entry.shape)} exactly once"
        )


async def _fill(
    store: ObjectStore, prefix: str, m: Manifest, dests: dict[str, torch.Tensor], stats: IOStats
) -> None:
    """Read stored tensors ``dests`` (key -> contiguous CPU tensor of the stored dtype/shape)."""
    reads: list[ChunkRead] = []
    for key, dest in dests.items():
        entry = m.tensors[key]
        _check_coverage(entry)
        view = _byte_view(dest)
        for c in entry.chunks:
            start, n = _row_span(entry, c)
            reads.append(ChunkRead(key, c, layout.join(prefix, m.blobs[c.blob].name), view[start : start + n]))
    await read_chunks(store, reads, stats)


def _stored_key(m: Manifest, key: str) -> str:
    return m.tensors[key].alias_of or key


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
    tied tensors tied again).  With ``keys``, returns ``{key: value}`` for just
    those leaves and fetches only their bytes.
    """
    return _runtime.run(_read(uri, None if keys is None else list(keys), storage_options, allow_pickle, store))


async def _read(uri: str, keys: Optional[list[str]], storage_options: Any, allow_pickle: bool,
                store_override: Optional[ObjectStore]) -> Any:
    store, prefix = _open(uri, storage_options, store_override)
    stats = IOStats()
    m = await _fetch_manifest(store, prefix, uri, stats)
    leaves = dict(iter_leaves(m.tree))
    if keys is None:
        wanted = [k for k in m.tensors]
    else:
        missing = [k for k in keys if k not in leaves]
        if missing:
            raise MissingKeyError(
                f"key(s) {missing[:10]} not in checkpoint {uri!r} (it has {len(leaves)} keys, e.g. {list(leaves)[:5]})"
            )
        wanted = [k for k in keys if k in m.tensors]
    bufs: dict[str, torch.Tensor] = {}
    for k in wanted:
        sk = _stored_key(m, k)
        if sk not in bufs:
            e = m.tensors[sk]
            bufs[sk] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype, sk))
    await _fill(store, prefix, m, bufs, stats)

    def get_tensor(k: str) -> torch.Tensor:
        return bufs[_stored_key(m, k)]

    if keys is None:
        return decode_tree(m.tree, get_tensor, allow_pickle=allow_pickle, where=repr(uri))
    return {k: decode_tree(leaves[k], get_tensor, allow_pickle=allow_pickle, where=repr(uri)) for k in keys}


# --------------------------------------------------------------------------- load


def load(
    state_dict: Any,
    uri: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    strict: bool = True,
    allow_pickle: bool = False,
    store: Optional[ObjectStore] = None,
) -> LoadResult:
    """Fill ``state_dict``'s tensors in place (any device) from the checkpoint.

    Non-tensor values in dicts and lists are replaced by the saved ones.
    Dtype and shape must match exactly.  With ``strict`` (the default) keys
    missing from the checkpoint or not in ``state_dict`` are an error; otherwise
    they are reported in the result.  Only the needed bytes are fetched.
    """
    return _runtime.run(_load(state_dict, uri, storage_options, strict, allow_pickle, store))


async def _load(state: Any, uri: str, storage_options: Any, strict: bool, allow_pickle: bool,
                store_override: Optional[ObjectStore]) -> LoadResult:
    t0 = time.perf_counter()
    store, prefix = _open(uri, storage_options, store_override)
    stats = IOStats()
    m = await _fetch_manifest(store, prefix, uri, stats)
    leaves = dict(iter_leaves(m.tree))
    slots = list(template_slots(state))
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
    tensor_slots = []
    value_slots = []
    for s in slots:
        if s.key not in leaves:
            continue
        is_t = isinstance(s.value, torch.Tensor)
        in_ckpt_t = s.key in m.tensors
        if is_t != in_ckpt_t:
            problems.append(f"{s.key!r}: {'tensor' if is_t else 'value'} in state dict, "
                            f"{'tensor' if in_ckpt_t else 'value'} in checkpoint")
        elif is_t:
            e = m.tensors[s.key]
            dt = dtype_from_name(e.dtype, s.key)
            if s.value.dtype != dt or tuple(s.value.shape) != e.shape:
                problems.append(
                    f"{s.key!r}: state dict has {s.value.dtype} {list(s.value.shape)}, checkpoint has "
                    f"{dt} {list(e.shape)}"
                )
            else:
                tensor_slots.append(s)
        else:
            value_slots.append(s)
    if problems:
        raise StateDictMismatchError(f"cannot load {uri!r}: " + "; ".join(problems[:20]))

    # one read per stored tensor; tied destinations filled once
    reads: dict[str, torch.Tensor] = {}  # stored key -> buffer the bytes land in
    copies: list[tuple[torch.Tensor, str]] = []  # (destination, stored key) needing a copy
    seen: set[tuple] = set()
    for s in tensor_slots:
        dest: torch.Tensor = s.value
        sk = _stored_key(m, s.key)
        ident = (dest.device, dest.data_ptr(), tuple(dest.shape), tuple(dest.stride()), sk)
        if ident in seen and dest.numel():
            continue
        seen.add(ident)
        if sk not in reads and _direct_ok(dest):
            reads[sk] = dest
        else:
            if sk not in reads:
                reads[sk] = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=dest.is_cuda)
            if reads[sk] is not dest:
                copies.append((dest, sk))
    with torch.no_grad():
        await _fill(store, prefix, m, reads, stats)
        for dest, sk in copies:
            dest.copy_(reads[sk], non_blocking=dest.is_cuda)
        if any(d.is_cuda for d, _ in copies):
            torch.cuda.synchronize()
    for s in value_slots:
        if s.container is not None and not isinstance(s.container, tuple):
            s.container[s.index] = decode_tree(leaves[s.key], lambda k: None, allow_pickle=allow_pickle, where=repr(uri))
    return LoadResult(uri, stats.bytes, time.perf_counter() - t0, stats.requests, len(tensor_slots), missing, unexpected)
