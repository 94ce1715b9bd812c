"""``objckpt.copy(src, dst)``: a checkpoint from any store to any other, verified on the way.

Why not ``aws s3 cp --recursive``: that copies blobs a failed save left behind,
never looks at the crcs, and writes the manifest whenever its turn comes, so
a reader at DST can see a checkpoint whose blobs are still arriving.  Here:

* only what the source manifest names is copied: its blobs and (format v2)
  rank index objects, under the same names;
* blobs move as ranged GETs of one part each, streamed into a multipart
  writer at DST, many parts in flight but at most ``memory_bytes`` of them in
  memory at once;
* every chunk's bytes are checked against its crc32c as its parts pass (a crc
  per part-slice, combined in order when the chunk is complete) before the
  blob is completed at DST; a mismatch aborts the copy and deletes what it
  wrote: nothing is committed at DST;
* rank indexes are checked against the size and crc32c the manifest records;
* the manifest, byte for byte as at the source (its own crc32c still seals
  it), is written last and conditionally: an existing checkpoint at DST is an
  error unless ``overwrite``, which replaces it as an overwriting save does
  (the old checkpoint's blobs are deleted once the new manifest is in place).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..runtime import loop as _runtime
from ..errors import (BlobMissingError, BucketNotFoundError, CheckpointExistsError, CorruptCheckpointError,
                     NotFoundError, ObjckptError, StorageError)
from ..format import keys
from ..format.manifest import Manifest, RankIndexRef, TensorCount, decode
from ..load.session import ReadSession, open_location
from ..logs import get_logger
from ..results import IOStats
from ..save.commit import CommitState, commit_async
from . import mover as _mover
from ..storage import BlobWriter, ObjectStore
from ..runtime.memory import COPY_MEMORY_BYTES

log = get_logger("objckpt.copy")

#: bytes of one ranged GET / one part written at DST (raised to the DST's minimum part size)
PART_SIZE = _mover.PART_SIZE
#: parts held in memory at once, in bytes
MEMORY_BYTES = COPY_MEMORY_BYTES


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy` moved."""

    src: str
    dst: str
    tensors: int  # every tensor key, tied ones included (Manifest.tensor_count)
    blobs: int
    bytes: int  # blob bytes copied
    objects: int  # objects written at DST, manifest included
    chunks_verified: int
    seconds: float
    tied: int = 0  # of ``tensors``, those tied to another key (stored once)

    @property
    def count(self) -> TensorCount:
        """``tensors`` and ``tied`` as every command prints them: ``113 tensors (1 tied: stored once)``."""
        return TensorCount(self.tensors, self.tied)


@dataclass
class _BlobCopy:
    """One blob: where it is, its parts, and its chunk crcs (checked as the parts pass)."""

    name: str
    spread: str  # the blob's spread bucket ("" in the default key layout)
    size: int
    check: _mover.BlobCheck
    parts: list[tuple[int, int]]  # (offset, length)
    writer: Optional[BlobWriter] = None
    left: int = 0
    completed: bool = False


def _plan(m: Manifest, dst: ObjectStore, part_size: int, sprefix: str) -> list[_BlobCopy]:
    checks = _mover.blob_checks(m, [m.object_key(sprefix, b.name, b.spread) for b in m.blobs])
    out = []
    for b, check in zip(m.blobs, checks):
        ps = _mover.part_size(b.size, dst, part_size)
        parts = _mover.parts(b.size, ps)
        out.append(_BlobCopy(b.name, b.spread, b.size, check, parts, left=len(parts)))
    return out


async def _read_indexes(src: ObjectStore, sprefix: str, m: Manifest) -> dict[str, bytes]:
    out: dict[str, bytes] = {}

    async def one(ref: RankIndexRef) -> None:
        key = m.object_key(sprefix, ref.name, ref.spread)
        try:
            data = await src.get(key)
        except NotFoundError:
            raise BlobMissingError(f"rank index {key!r} is missing") from None
        _mover.check_index(data, ref, key)
        out[ref.name] = data

    await asyncio.gather(*(one(ref) for ref in m.rank_indexes))
    return {r.name: out[r.name] for r in m.rank_indexes}


async def copy_checkpoint(source: ReadSession, dst: ObjectStore, dprefix: str, dst_uri: str, *,
                          overwrite: bool = False, part_size: int = PART_SIZE, memory_bytes: int = MEMORY_BYTES,
                          progress: Optional[Callable[[int, int], None]] = None) -> CopyReport:
    """The copy, on the I/O loop (see the module docstring), of ``source``'s checkpoint (a read
    session whose manifest is fetched: :meth:`ReadSession.open`); ``progress(n, total)`` is
    told of every ``n`` blob bytes that reached DST (of ``total``)."""
    t0 = time.perf_counter()
    src, sprefix, src_uri = source.store, source.prefix, source.uri
    raw, m = source.manifest_raw, source.manifest
    if m.spread_up and len([p for p in dprefix.split("/") if p]) <= m.spread_up:
        raise ValueError(f"{src_uri!r} uses the spread key layout with its spread root {m.spread_up} level(s) above "
                         f"the checkpoint; {dst_uri!r} needs at least {m.spread_up + 1} path segments below the "
                         "bucket or root to hold the same layout")
    mkey = keys.manifest_key(dprefix)
    if not overwrite and await dst.head(mkey) is not None:
        raise CheckpointExistsError(f"a checkpoint already exists at {dst_uri!r}; pass overwrite=True to replace it")
    there = await _old_manifest(dst, mkey) if overwrite else None
    if there is not None and there.attempt == m.attempt:
        # the same objects under the same names: rewriting them in place would break the
        # committed copy while it is rewritten (and for good if the source turned out damaged)
        raise CheckpointExistsError(
            f"{dst_uri!r} already holds this checkpoint (attempt {m.attempt}); check it with `objckpt verify`, "
            "or delete it and copy again")
    indexes, _ = await asyncio.gather(_read_indexes(src, sprefix, m), source.resolver.resolve_all())
    blobs = _plan(m, dst, part_size, sprefix)
    total = sum(b.size for b in m.blobs)
    slots = asyncio.Semaphore(max(1, memory_bytes // max(max((n for b in blobs for _, n in b.parts), default=1), 1)))
    requests = asyncio.Semaphore(max(1, min(src.concurrency, dst.concurrency)))
    verified = [0]

    async def part(bc: _BlobCopy, index: int, off: int, n: int) -> None:
        src_key = m.object_key(sprefix, bc.name, bc.spread)
        async with slots:
            buf = memoryview(bytearray(n))
            async with requests:
                try:
                    if n:
                        await src.get_range_into(src_key, off, buf)
                except BucketNotFoundError:
                    raise
                except NotFoundError:
                    raise BlobMissingError(f"blob {src_key!r} of {src_uri!r} is missing") from None
            found = await _runtime.in_thread(bc.check.slices, off, buf)  # not inside ``+=``: it would race
            try:
                verified[0] += bc.check.record(found)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{e}; nothing was committed at the destination") from None
            if bc.writer is None:
                bc.writer = dst.open_writer(m.object_key(dprefix, bc.name, bc.spread), bc.size, len(bc.parts))
            async with requests:
                await bc.writer.write_part(index, off, buf)
        if progress is not None:
            progress(n, total)
        bc.left -= 1
        if bc.left == 0:
            verified[0] += bc.check.finish()
            await bc.writer.complete()
            bc.completed = True

    tasks: list["asyncio.Future[Any]"] = [asyncio.ensure_future(part(bc, i, off, n)) for bc in blobs
                                          for i, (off, n) in enumerate(bc.parts)]
    unknown = False  # whether the manifest PUT failed in a way that may have landed all the same
    try:
        await _runtime.gather_fail_fast(tasks)
        for ref in m.rank_indexes:
            await dst.put(m.object_key(dprefix, ref.name, ref.spread), indexes[ref.name])
        # the one conditional manifest write (save/commit): byte for byte the source's; an
        # overwrite deletes what the replaced checkpoint no longer names once this one is in place
        errors: list[BaseException] = []
        status = await commit_async(dst, dprefix, m, overwrite, dst_uri, [], IOStats(), errors, data=raw)
        if status.state is CommitState.EXISTS:
            raise CheckpointExistsError(f"another writer committed a checkpoint at {dst_uri!r} first")
        if status.state is not CommitState.OK:
            unknown = status.state is CommitState.FAILED
            if errors:
                raise errors[-1]
            raise StorageError(status.message)
    except BaseException:
        await asyncio.gather(*(b.writer.abort() for b in blobs if b.writer is not None and not b.completed),
                             return_exceptions=True)
        if unknown:  # the manifest may be there: nothing it could name is deleted (gc's, if not)
            raise
        now = await _old_manifest(dst, mkey)  # a racing copy of the same source may have committed these names
        keep = set() if now is None else set(now.object_keys(dprefix))
        done = [k for k in (m.object_key(dprefix, b.name, b.spread) for b in blobs if b.completed) if k not in keep]
        done += [k for k in (m.object_key(dprefix, r.name, r.spread) for r in m.rank_indexes) if k not in keep]
        try:
            await dst.delete(done)
        except Exception:
            pass  # unreferenced by any manifest: gc's
        raise
    nbytes = sum(b.size for b in m.blobs)
    count = m.tensor_count()
    rep = CopyReport(src_uri, dst_uri, count.tensors, len(m.blobs), nbytes, len(m.blobs) + len(indexes) + 1,
                     verified[0], time.perf_counter() - t0, count.tied)
    log.info("copied %s -> %s: %s, %d bytes in %d blob(s), %d chunk crc(s) verified, %.3f s", src_uri,
             dst_uri, rep.count, rep.bytes, rep.blobs, rep.chunks_verified, rep.seconds)
    return rep


async def _old_manifest(st: ObjectStore, mkey: str) -> Optional[Manifest]:
    try:
        return decode(await st.get(mkey), mkey)
    except Exception:
        return None  # absent or unreadable: nothing of it to clean up


def copy(src: str, dst: str, *, storage_options: Optional[dict[str, Any]] = None,
         dst_storage_options: Optional[dict[str, Any]] = None, overwrite: bool = False,
         part_size: int = PART_SIZE, memory_bytes: int = MEMORY_BYTES,
         progress: Optional[Callable[[int, int], None]] = None, src_store: Optional[ObjectStore] = None,
         dst_store: Optional[ObjectStore] = None) -> CopyReport:
    """Copy the checkpoint at ``src`` to ``dst`` (any two stores: S3, local, fsspec),
    checking every chunk's crc32c on the way and committing at ``dst`` last.

    ``storage_options`` open ``src`` (and ``dst``, unless ``dst_storage_options``
    is given).  An existing checkpoint at ``dst`` raises
    :class:`CheckpointExistsError` unless ``overwrite``.  Damage at the source
    (a crc mismatch, a missing or short blob) raises
    :class:`CorruptCheckpointError` and leaves nothing committed at ``dst``.
    At most ``memory_bytes`` of parts (``part_size`` each) are held at once."""
    if part_size < 1 or memory_bytes < 1:
        raise ValueError(f"copy: part_size and memory_bytes must be positive, got {part_size}, {memory_bytes}")
    dopts = dst_storage_options if dst_storage_options is not None else storage_options
    source = ReadSession(src, storage_options, src_store)
    d_st, d_prefix = open_location(dst, dopts, dst_store)
    if source.store is d_st and source.prefix == d_prefix:
        raise ObjckptError(f"copy: source and destination are the same checkpoint ({src!r})")
    source.refresh()
    return _runtime.run(copy_checkpoint(source, d_st, d_prefix, dst, overwrite=overwrite,
                                        part_size=part_size, memory_bytes=memory_bytes, progress=progress))
