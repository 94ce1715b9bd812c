"""Building and committing the manifest of a (multi-rank) save.

The manifest is the commit record: written last, by rank 0 only, after every
rank's blobs are up.  The conditional write makes two writers unable to both
commit; an error on the write is examined before anything is cleaned up,
because a PUT can land even when its reply is lost.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from .. import __version__, _runtime
from ..errors import NotFoundError, PreconditionFailed
from ..format import layout
from ..format.manifest import Blob, Chunk, Layout, Manifest, Mesh, RankIndexRef, TensorEntry, decode, encode
from ..planning.layout import TensorDesc
from ..planning.shard import TensorMeta
from ..storage import ObjectStore
from .stats import IOStats


def build_manifest(gathered: list, results: list, attempt: str, meta: dict, crc_block: int, world: int) -> Manifest:
    metas0: dict[str, TensorMeta] = {}
    for g in gathered:
        for k, t in g[0].items():
            metas0.setdefault(k, t)
    dtypes: dict[str, str] = {}
    for g in gathered:
        for k, d in g[3].items():
            dtypes.setdefault(k, d)
    aliases = gathered[0][2]
    blobs: list[Blob] = []
    entries: dict[str, TensorEntry] = {}
    for k in dtypes:
        if k in aliases:
            target = metas0[aliases[k]]
            entries[k] = TensorEntry(k, target.dtype, target.shape, alias_of=aliases[k])
        else:
            t = metas0[k]
            entries[k] = TensorEntry(k, t.dtype, t.shape)
    for rank, (records, rblobs, _) in enumerate(results):
        base = len(blobs)
        blobs.extend(Blob(n, size, rank) for n, size in rblobs)
        for key, offs, shape, b, off, length, total, blocks in records:
            entries[key].chunks.append(Chunk(tuple(offs), tuple(shape), base + b, off, length, total, tuple(blocks)))
    for e in entries.values():
        e.chunks.sort(key=lambda c: c.offsets)
    trees = [g[1] for g in gathered]
    same = all(json.dumps(t, sort_keys=True) == json.dumps(trees[0], sort_keys=True) for t in trees)
    return Manifest(
        tensors=entries, blobs=blobs, tree=trees[0], metadata=meta, attempt=attempt, world_size=world,
        writer=f"objckpt {__version__}", crc_block=crc_block, rank_trees=None if same else trees,
    )


def build_manifest_v2(descs: list[TensorDesc], meshes: list[Mesh], layouts: dict[str, Layout],
                      dtypes: dict[str, str], aliases: dict[str, str], tree: Any, rank_trees: Optional[list],
                      results: list, attempt: str, meta: dict, crc_block: int) -> Manifest:
    """The manifest of a symbolic save: layouts instead of chunks, one index object per rank."""
    by_key = {d.key: d for d in descs}
    entries: dict[str, TensorEntry] = {}
    for k, dt in dtypes.items():
        if k in aliases:
            d = by_key[aliases[k]]
            entries[k] = TensorEntry(k, dt, d.shape, alias_of=aliases[k])
        else:
            d = by_key[k]
            entries[k] = TensorEntry(k, dt, d.shape, layout=layouts[k])
    blobs: list[Blob] = []
    refs: list[RankIndexRef] = []
    for rank, ((size, crc), rblobs, _) in enumerate(results):
        blobs.extend(Blob(n, sz, rank) for n, sz in rblobs)
        refs.append(RankIndexRef(layout.index_name(attempt, rank), size, crc))
    return Manifest(
        tensors=entries, blobs=blobs, tree=tree, metadata=meta, attempt=attempt, world_size=len(results),
        writer=f"objckpt {__version__}", crc_block=crc_block, rank_trees=rank_trees, format_version=2,
        meshes=list(meshes), rank_indexes=refs,
    )


def commit(st: ObjectStore, prefix: str, mkey: str, m: Manifest, overwrite: bool, uri: str,
            keys: list[str], stats: IOStats, errors: list[BaseException]) -> tuple[str, str, int]:
    """Write the manifest (rank 0).  Returns (status, message, manifest bytes);
    the exception behind a failure is appended to ``errors``."""
    data = encode(m)

    async def go() -> tuple[str, str, int]:
        old: Optional[Manifest] = None
        if overwrite:
            try:
                old = decode(await st.get(mkey), mkey)
            except Exception:
                old = None  # absent or unreadable: nothing of it to clean up
        try:
            await st.put(mkey, data, if_absent=not overwrite)
        except BaseException as e:
            # The PUT may have landed even though we saw an error (a lost reply,
            # then a retry answered 412): look before deleting anything.
            committed = await _committed_attempt(st, mkey)
            if committed != m.attempt:
                errors.append(e)
                if committed != "?":  # ours is certainly not referenced
                    await _delete_async(st, keys)
                if isinstance(e, PreconditionFailed):
                    return ("exists-clean", f"another writer committed a checkpoint at {uri!r} first", 0)
                return ("failed-clean" if committed != "?" else "failed",
                        f"committing {uri!r} failed: {type(e).__name__}: {e}", 0)
        stats.add(len(data))
        if old is not None and old.attempt != m.attempt:  # the replaced checkpoint's blobs are garbage now
            live = {b.name for b in m.blobs} | {r.name for r in m.rank_indexes}
            dead = [b.name for b in old.blobs] + [r.name for r in old.rank_indexes]
            await _delete_async(st, [layout.join(prefix, n) for n in dead if n not in live])
        return ("ok", "", len(data))

    return _runtime.run(go())


async def _committed_attempt(store: ObjectStore, mkey: str) -> Optional[str]:
    """The attempt id of the manifest now at ``mkey``; None if absent, "?" if unknown."""
    try:
        return decode(await store.get(mkey), mkey).attempt
    except NotFoundError:
        return None
    except Exception:
        return "?"


async def _delete_async(store: ObjectStore, keys: list[str]) -> None:
    try:
        await store.delete(keys)
    except Exception:
        pass  # unreferenced: gc sweeps them


def delete_quietly(store: ObjectStore, keys: list[str]) -> None:
    if keys:
        _runtime.run(_delete_async(store, keys))


