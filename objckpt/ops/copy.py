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
import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..runtime import loop as _runtime
from ..checksum import crc32c, crc32c_combine
from ..errors import (BlobMissingError, BucketNotFoundError, CheckpointExistsError, CorruptCheckpointError,
                     NotFoundError, ObjckptError, PreconditionFailed)
from ..format import keys
from ..format.manifest import Chunk, Manifest, RankIndexRef, decode
from ..load.session import ReadSession, open_location
from ..logs import get_logger
from ..save.commit import replaced_keys
from ..storage import BlobWriter, ObjectStore
from ..runtime.memory import COPY_MEMORY_BYTES
from ..units import MiB

log = get_logger("objckpt.copy")

#: bytes of one ranged GET / one part written at DST (raised to the DST's minimum part size)
PART_SIZE = 16 * MiB
#: parts held in memory at once, in bytes
MEMORY_BYTES = COPY_MEMORY_BYTES


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy` moved."""

    src: str
    dst: str
    tensors: int
    blobs: int
    bytes: int  # blob bytes copied
    objects: int  # objects written at DST, manifest included
    chunks_verified: int
    seconds: float


@dataclass
class _ChunkCheck:
    """One chunk's crc, assembled from the crcs of the part-slices that cover it."""

    key: str
    chunk: Chunk
    pieces: dict[int, tuple[int, int]] = field(default_factory=dict)  # start -> (length, crc)
    covered: int = 0


@dataclass
class _BlobCopy:
    """One blob: where it is, its parts, and the chunks to check in it."""

    name: str
    spread: str  # the blob's spread bucket ("" in the default key layout)
    size: int
    checks: list[_ChunkCheck]
    starts: list[int]  # chunk offsets in the blob, sorted (bisect)
    parts: list[tuple[int, int]]  # (offset, length)
    writer: Optional[BlobWriter] = None
    left: int = 0
    completed: bool = False


def _part_size(size: int, dst: ObjectStore, part_size: int) -> int:
    n = max(part_size, dst.min_part_size, -(-size // dst.max_parts), 1)
    return min(n, max(dst.max_part_size, 1))


def _plan(m: Manifest, dst: ObjectStore, part_size: int) -> list[_BlobCopy]:
    per_blob: list[list[_ChunkCheck]] = [[] for _ in m.blobs]
    for key, e in m.tensors.items():
        if e.alias_of is None:
            for c in e.chunks:
                per_blob[c.blob].append(_ChunkCheck(key, c))
    out = []
    for b, checks in zip(m.blobs, per_blob):
        checks.sort(key=lambda ch: ch.chunk.offset)
        ps = _part_size(b.size, dst, part_size)
        parts = [(o, min(ps, b.size - o)) for o in range(0, b.size, ps)] or [(0, 0)]
        out.append(_BlobCopy(b.name, b.spread, b.size, checks, [ch.chunk.offset for ch in checks], parts, left=len(parts)))
    return out


def _slice_crcs(bc: _BlobCopy, off: int, data: memoryview) -> list[tuple[int, int, int, int]]:
    """(check index, start in its chunk, length, crc32c) of every chunk slice inside
    ``data`` (bytes ``off``.. of the blob).  Pure: runs on a worker thread."""
    end = off + len(data)
    out = []
    i = max(0, bisect.bisect_right(bc.starts, off) - 1)
    while i < len(bc.checks) and bc.checks[i].chunk.offset < end:
        c = bc.checks[i].chunk
        a, b = max(off, c.offset), min(end, c.offset + c.length)
        if b > a:
            out.append((i, a - c.offset, b - a, crc32c(data[a - off : b - off])))
        i += 1
    return out


def _record(bc: _BlobCopy, found: list[tuple[int, int, int, int]], where: str) -> int:
    """Add slice crcs to their chunks (on the loop thread); check each chunk they complete.
    Returns the number of chunks completed."""
    done = 0
    for i, start, n, piece in found:
        ch = bc.checks[i]
        ch.pieces[start] = (n, piece)
        ch.covered += n
        c = ch.chunk
        if ch.covered != c.length:
            continue
        crc = 0
        for s in sorted(ch.pieces):
            length, part_crc = ch.pieces[s]
            crc = crc32c_combine(crc, part_crc, length)
        if crc != c.crc32c:
            raise CorruptCheckpointError(
                f"tensor {ch.key!r}: crc32c mismatch in blob {where!r} at offset {c.offset} (length {c.length}, "
                f"chunk at {list(c.offsets)}): stored {c.crc32c:#010x}, read {crc:#010x}; nothing was committed "
                "at the destination")
        done += 1
    return done


async def _read_indexes(src: ObjectStore, sprefix: str, m: Manifest) -> dict[str, bytes]:
    out: dict[str, bytes] = {}

    async def one(ref: RankIndexRef) -> None:
        key = m.object_key(sprefix, ref.name, ref.spread)
        try:
            data = await src.get(key)
        except NotFoundError:
            raise BlobMissingError(f"rank index {key!r} is missing") from None
        if len(data) != ref.size or crc32c(data) != ref.crc32c:
            raise CorruptCheckpointError(f"rank index {key!r}: size or crc32c differs from the manifest")
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
    blobs = _plan(m, dst, part_size)
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
            found = await _runtime.in_thread(_slice_crcs, bc, off, buf)  # not inside ``+=``: it would race
            verified[0] += _record(bc, found, src_key)
            if bc.writer is None:
                bc.writer = dst.open_writer(m.object_key(dprefix, bc.name, bc.spread), bc.size, len(bc.parts))
            async with requests:
                await bc.writer.write_part(index, off, buf)
        if progress is not None:
            progress(n, total)
        bc.left -= 1
        if bc.left == 0:
            short = [ch for ch in bc.checks if ch.covered != ch.chunk.length and ch.chunk.length]
            if short:
                raise CorruptCheckpointError(f"blob {src_key!r}: chunk of tensor {short[0].key!r} not fully read")
            verified[0] += sum(1 for ch in bc.checks if not ch.chunk.length and ch.chunk.crc32c == 0)
            bad = [ch for ch in bc.checks if not ch.chunk.length and ch.chunk.crc32c != 0]
            if bad:
                raise CorruptCheckpointError(f"tensor {bad[0].key!r}: an empty chunk with crc32c "
                                             f"{bad[0].chunk.crc32c:#010x} in blob {src_key!r}")
            await bc.writer.complete()
            bc.completed = True

    tasks: list["asyncio.Future[Any]"] = [asyncio.ensure_future(part(bc, i, off, n)) for bc in blobs
                                          for i, (off, n) in enumerate(bc.parts)]
    old: Optional[Manifest] = None
    try:
        await _runtime.gather_fail_fast(tasks)
        for ref in m.rank_indexes:
            await dst.put(m.object_key(dprefix, ref.name, ref.spread), indexes[ref.name])
        old = await _old_manifest(dst, mkey) if overwrite else None
        try:
            await dst.put(mkey, raw, if_absent=not overwrite)
        except PreconditionFailed:
            raise CheckpointExistsError(f"another writer committed a checkpoint at {dst_uri!r} first") from None
    except BaseException:
        await asyncio.gather(*(b.writer.abort() for b in blobs if b.writer is not None and not b.completed),
                             return_exceptions=True)
        now = await _old_manifest(dst, mkey)  # a racing copy of the same source may have committed these names
        keep = set() if now is None else set(now.object_keys(dprefix))
        done = [k for k in (m.object_key(dprefix, b.name, b.spread) for b in blobs if b.completed) if k not in keep]
        done += [k for k in (m.object_key(dprefix, r.name, r.spread) for r in m.rank_indexes) if k not in keep]
        try:
            await dst.delete(done)
        except Exception:
            pass  # unreferenced by any manifest: gc's
        raise
    if old is not None and old.attempt != m.attempt:
        try:
            await dst.delete(replaced_keys(dprefix, old, m))
        except Exception:
            pass
    nbytes = sum(b.size for b in m.blobs)
    rep = CopyReport(src_uri, dst_uri, sum(1 for e in m.tensors.values() if e.alias_of is None), len(m.blobs), nbytes,
                     len(m.blobs) + len(indexes) + 1, verified[0], time.perf_counter() - t0)
    log.info("copied %s -> %s: %d tensors, %d bytes in %d blob(s), %d chunk crc(s) verified, %.3f s", src_uri,
             dst_uri, rep.tensors, rep.bytes, rep.blobs, rep.chunks_verified, rep.seconds)
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
