"""Local filesystem store (``file://`` URIs and plain paths).

Blobs are written with positional writes from many threads at once (no
append-order constraint), fsync'ed before the manifest is committed.  The
manifest is committed atomically: written to a temporary file, fsync'ed, then
hard-linked into place when it must not exist yet (``link`` fails if the target
exists, so two writers can never both commit) or ``os.replace``d for an
overwrite.  Readers thus see either no manifest or a whole one.

Every filesystem error (a full disk, a read-only mount, a file where a
directory should be, a directory where a file should be) is raised as an
objckpt error naming the object, the file and the cause (:mod:`.fs_errors`);
a failed write removes the temporary or partial file it made.

``LocalStore(root, direct=True)`` writes blobs with ``O_DIRECT`` (node-local NVMe
for the local checkpoint tier, :mod:`objckpt.tier`): the bytes go through a few
reused, page-aligned host buffers straight to the device, so a checkpoint does
not grow the page cache (which would evict the training job's own cached data
and make the kernel write it back later, at a time nobody chose).  The aligned
middle of every part is written direct; an unaligned head (a part starting
mid-page) and an unaligned end that is not the end of the blob are written
buffered (at most two pages a part); the blob's last, partial page is written
padded to the alignment and the file truncated back to its true size when the
writer completes.  Where ``O_DIRECT`` is refused (tmpfs answers EINVAL, so does
a device that rejects the alignment) the writer falls back to buffered writes,
once logged, with the same results.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import stat
import threading
from typing import Any, Optional, Sequence

from ..runtime import loop as _runtime
from ..errors import ObjckptError, PreconditionFailed, StorageError
from ..format import keys as _keys, spread as _spread
from .base import BlobWriter, ObjectInfo, ObjectStore
from .fs_errors import is_absent, missing, storage_error


def fsync_dir(path: "str | os.PathLike[str]") -> None:
    """Make a rename or create in ``path`` durable (best effort: a folder that cannot be
    opened or synced, as on some filesystems, is left as it is).  Shared with the tier's
    copies between ranks (:mod:`objckpt.tier.transfer`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_IOV_MAX = 1024
#: bytes read before they are hashed, in a tallied read: small enough to be hashed from the cache
TALLY_PIECE = 4 << 20


def _preadv_all(fd: int, views: list[memoryview], at: int) -> int:
    """preadv until ``views`` are full or the file ends; the bytes read."""
    views = list(views)
    got = 0
    while views:
        n = os.preadv(fd, views[:_IOV_MAX], at + got)
        if n == 0:
            break
        got += n
        while views and n >= len(views[0]):  # drop what is filled
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return got


def _pieces(views: Sequence[memoryview], size: int) -> list[list[memoryview]]:
    """``views`` in order, cut into groups of at most ``size`` bytes (a large view is split)."""
    groups: list[list[memoryview]] = []
    cur: list[memoryview] = []
    room = size
    for v in views:
        while len(v):
            take = min(len(v), room)
            cur.append(v[:take])
            v = v[take:]
            room -= take
            if room == 0:
                groups.append(cur)
                cur, room = [], size
    if cur:
        groups.append(cur)
    return groups
log = logging.getLogger("objckpt.storage")

#: O_DIRECT offsets, lengths and buffer addresses are multiples of this (the page size
#: covers the logical block size of every device in practice: 512 or 4096)
DIRECT_ALIGN = 4096
#: bytes per aligned host buffer of the O_DIRECT path
DIRECT_BUFFER = 4 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _AlignedBuffers:
    """Page-aligned host buffers (anonymous mmaps), reused across writes and saves: the
    O_DIRECT path copies through them instead of allocating per write.  At most ``keep``
    stay allocated when idle; more are made while more threads write at once."""

    def __init__(self, size: int = DIRECT_BUFFER, keep: int = 16) -> None:
        self.size = size
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self.made = 0  # buffers ever allocated (tests check that they are reused)

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
        return mmap.mmap(-1, self.size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)
                return
        buf.close()


DIRECT_BUFFERS = _AlignedBuffers()
_refused_dirs: set[str] = set()


def _direct_refused(path: str, e: OSError) -> None:
    d = os.path.dirname(path)
    if d not in _refused_dirs:
        _refused_dirs.add(d)
        log.info("objckpt: O_DIRECT refused under %s (%s): writing buffered there", d, e.strerror or e)


def _round_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def _round_down(n: int) -> int:
    return n // DIRECT_ALIGN * DIRECT_ALIGN


def _take(views: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views`` (consumed from the list)."""
    out: list[memoryview] = []
    while n and views:
        v = views[0]
        if len(v) <= n:
            out.append(views.pop(0))
            n -= len(v)
        else:
            out.append(v[:n])
            views[0] = v[n:]
            n = 0
    return out


class _LocalWriter(BlobWriter):
    #: a file needs no crc32c of each part (only a store that has the server check a part
    #: does): the save skips building it (see objckpt.save.upload.direct_views)
    uses_part_crc = False

    def __init__(self, store: "LocalStore", key: str, size: int) -> None:
        self._store = store
        self._path = store._path(key)
        self._key = key
        self._size = size
        self._fd: Optional[int] = None
        self._dfd: Optional[int] = None  # the O_DIRECT descriptor (None: buffered writes)
        self._refused_dfd: Optional[int] = None  # one O_DIRECT refused mid-blob: closed at the end
        self._padded = False  # the last page was written padded: truncate at complete()
        try:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(self._fd, size)
        except OSError as e:
            err = store._error("creating", key, e)
            if self._fd is not None:  # created, then refused its size: no empty file left behind
                os.close(self._fd)
                self._fd = None
                _unlink_quietly(self._path)
            raise err from e
        if store.direct and _O_DIRECT and size >= DIRECT_ALIGN:
            try:
                self._dfd = os.open(self._path, os.O_WRONLY | _O_DIRECT)
            except OSError as e:  # tmpfs: EINVAL
                _direct_refused(self._path, e)

    @property
    def direct(self) -> bool:
        """Whether this writer writes with O_DIRECT (False once refused)."""
        return self._dfd is not None

    def _drop_direct(self, e: OSError) -> None:
        """Write buffered from now on.  The O_DIRECT descriptor stays open until
        complete/abort: other threads may be writing parts through it right now (closed
        here, its number could be reused by another file they would then write into)."""
        if self._dfd is not None:
            self._refused_dfd, self._dfd = self._dfd, None
            _direct_refused(self._path, e)

    def _direct(self, offset: int, buf: mmap.mmap, n: int) -> None:
        """``buf[:n]`` (n aligned) at ``offset`` with O_DIRECT; buffered if refused."""
        view = memoryview(buf)
        dfd = self._dfd  # one descriptor for this write, whatever another thread does meanwhile
        try:
            done = 0
            while done < n and dfd is not None:
                got = os.pwrite(dfd, view[done:n], offset + done)
                if got <= 0 or got % DIRECT_ALIGN:
                    break  # a short, unaligned write: the rest goes buffered
                done += got
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._drop_direct(e)
        if done < n:
            self._buffered(offset + done, [view[done:n]])
        view.release()

    def _buffered(self, offset: int, views: list[memoryview]) -> None:
        if views:
            self._pwritev(offset, views)

    def _write_direct(self, offset: int, views: list[memoryview]) -> None:
        """Write the contiguous ``views`` at ``offset``: the unaligned head buffered, the
        aligned body direct through reused aligned buffers, the end direct and padded
        when it is the blob's end (truncated at complete), else its unaligned rest buffered."""
        views = [v.cast("B") if v.format != "B" else v for v in views if len(v)]
        total = sum(len(v) for v in views)
        end = offset + total
        body_end = end if end == self._size else _round_down(end)
        head = min(total, _round_up(offset) - offset)
        if body_end <= offset + head:  # no whole aligned page in it: buffered
            self._buffered(offset, views)
            return
        self._buffered(offset, _take(views, head))
        pos = offset + head
        buf = DIRECT_BUFFERS.take()
        try:
            fill = 0
            for v in views:
                while len(v):
                    n = min(len(v), len(buf) - fill)
                    buf[fill:fill + n] = v[:n]
                    fill += n
                    v = v[n:]
                    if fill == len(buf):
                        self._direct(pos, buf, fill)
                        pos, fill = pos + fill, 0
            if fill:
                if pos + fill == self._size:
                    padded = _round_up(fill)
                    buf[fill:padded] = bytes(padded - fill)
                    if self._dfd is not None:
                        self._padded = True
                        self._direct(pos, buf, padded)
                    else:
                        self._buffered(pos, [memoryview(buf)[:fill]])
                else:
                    aligned = _round_down(fill)
                    if aligned:
                        self._direct(pos, buf, aligned)
                    self._buffered(pos + aligned, [memoryview(buf)[aligned:fill]])
        finally:
            DIRECT_BUFFERS.give(buf)

    def _pwrite(self, offset: int, data: memoryview) -> None:
        assert self._fd is not None
        if self._dfd is not None:
            self._write_direct(offset, [data])
            return
        view = data.cast("B") if data.format != "B" else data
        while len(view):
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    async def write_part(self, index: int, offset: int, data: memoryview) -> None:
        try:
            await _runtime.in_thread(self._pwrite, offset, data)
        except OSError as e:
            raise self._store._error(f"writing at offset {offset} of", self._key, e) from e

    def _pwritev(self, offset: int, views: Sequence[memoryview]) -> None:
        assert self._fd is not None
        vs = [v.cast("B") if v.format != "B" else v for v in views if len(v)]
        while vs:
            n = os.pwritev(self._fd, vs[:_IOV_MAX], offset)
            offset += n
            while vs and n >= len(vs[0]):
                n -= len(vs[0])
                vs.pop(0)
            if vs and n:
                vs[0] = vs[0][n:]

    async def write_part_views(self, index: int, offset: int, views: Sequence[memoryview],
                               crc32c: Optional[int] = None) -> None:
        try:
            write = self._write_direct if self._dfd is not None else self._pwritev
            await _runtime.in_thread(write, offset, list(views))
        except OSError as e:
            raise self._store._error(f"writing at offset {offset} of", self._key, e) from e

    def _take_direct(self) -> Optional[int]:
        """The O_DIRECT descriptor to close at the end (in use, or refused mid-blob)."""
        dfd, self._dfd = self._dfd, None
        refused, self._refused_dfd = self._refused_dfd, None
        return dfd if dfd is not None else refused

    async def complete(self) -> None:
        fd, self._fd = self._fd, None
        dfd = self._take_direct()
        if fd is None:
            return
        def finish() -> None:
            try:
                if dfd is not None:
                    os.close(dfd)
                if self._padded:  # the last page went out padded to the alignment
                    os.ftruncate(fd, self._size)
                os.fsync(fd)  # a full disk or a failing device can first show here
            finally:
                os.close(fd)
        try:
            await _runtime.in_thread(finish)
        except OSError as e:
            raise self._store._error("flushing", self._key, e) from e

    async def abort(self) -> None:
        fd, self._fd = self._fd, None
        dfd = self._take_direct()
        if dfd is not None:
            try:
                os.close(dfd)
            except OSError:
                pass
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass  # a delayed write error: the file goes anyway
        await self._store.delete([self._key])  # also tidies the emptied attempt directory


def _kept(key: str) -> int:
    """How many leading segments of ``key`` name folders that deleting it must leave even
    when emptied: the tidy after a delete removes only folders objckpt made for the object.
    ``<ck>/blobs/<attempt>/<file>`` and ``<ck>/manifest.json`` (or its temporary): up to the
    checkpoint folder ``<ck>``; ``<root>/.spread-<hh>/<rel>/spread/<attempt>/<file>``: up to
    ``.spread-<hh>``; any other key: none.  Folders above the checkpoint are the caller's
    (``/data/runs`` emptied of its last checkpoint stays; so does a manager's root)."""
    parts = key.split("/")
    name = parts[-1].split(".tmp-", 1)[0]
    if name == _keys.MANIFEST_NAME:
        return max(0, len(parts) - 2)
    sp = _spread.parse_key(key, allow_tmp=True)
    if sp is not None:
        return len(parts) - 4 - sp.up
    if len(parts) >= 3 and parts[-3] == _keys.BLOB_DIR and _spread.FILE_NAME.fullmatch(name):
        return max(0, len(parts) - 4)
    return len(parts) - 1


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class LocalStore(ObjectStore):
    min_part_size = 1
    max_part_size = 1 << 40
    max_parts = 1 << 30
    concurrency = 8
    if_absent_enforced = True  # a create-only write is a link(), refused by the OS when the name exists

    def __init__(self, root: str, *, direct: bool = False) -> None:
        """``direct``: write blobs with O_DIRECT (see the module docstring); reads and the
        small objects (manifest, indexes) stay buffered."""
        self.root = os.path.abspath(root)
        self.direct = bool(direct)

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad object key {key!r}")
        return os.path.join(self.root, *key.split("/"))

    def _error(self, doing: str, key: str, e: OSError) -> ObjckptError:
        """``e`` (met while ``doing`` object ``key``) as an objckpt error naming the file and the cause."""
        return storage_error(doing, self._path(key), self.root, e)

    def _read_error(self, key: str, e: OSError) -> ObjckptError:
        """A read's ``e``: the object is absent when its path is not a file, else a StorageError."""
        return missing(key, self._path(key), e) if is_absent(e) else self._error("reading", key, e)

    async def get(self, key: str) -> bytes:
        def read() -> bytes:
            try:
                with open(self._path(key), "rb") as f:
                    return f.read()
            except OSError as e:
                raise self._read_error(key, e) from None
        return await _runtime.in_thread(read)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        n = await self._read_into(key, offset, memoryview(buf))
        return bytes(buf[:n])

    def _read_into_sync(self, key: str, offset: int, outs: list[memoryview], tally: Optional[Any] = None) -> int:
        """Scatter-read with preadv: straight into every destination, no copy.  With ``tally``
        (a :class:`~objckpt.checksum.CellCrcs`) the bytes are read in pieces of at most
        :data:`TALLY_PIECE` and each piece is hashed right after it landed, in this thread,
        while it is still in the CPU's cache: no second pass, and no second hop to another
        thread for the checksum."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError as e:
            raise self._read_error(key, e) from None
        try:
            views = [o.cast("B") if o.format != "B" else o for o in outs if len(o)]
            if tally is None:
                return _preadv_all(fd, views, offset)
            got = 0
            for group in _pieces(views, TALLY_PIECE):
                want = sum(len(v) for v in group)
                n = _preadv_all(fd, list(group), offset + got)
                got += n
                if n != want:
                    break  # short: the caller raises; the tally stays incomplete
                for v in group:
                    tally.feed(v)
            return got
        except OSError as e:  # EISDIR: a directory opens, but does not read
            raise self._read_error(key, e) from None
        finally:
            os.close(fd)

    async def _read_into(self, key: str, offset: int, out: memoryview) -> int:
        return await _runtime.in_thread(self._read_into_sync, key, offset, [out])

    async def get_range_tallied(self, key: str, offset: int, outs: Sequence[memoryview], tally: Any) -> None:
        """:meth:`get_range_scatter`, hashing the bytes into ``tally`` as they land (see
        :meth:`_read_into_sync`); the readers then combine cells instead of hashing again."""
        await self._scatter(key, offset, outs, tally)

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self._scatter(key, offset, outs, None)

    async def _scatter(self, key: str, offset: int, outs: Sequence[memoryview], tally: Optional[Any]) -> None:
        want = sum(len(o) for o in outs)
        n = await _runtime.in_thread(self._read_into_sync, key, offset, list(outs), tally)
        if n != want:
            from ..errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"object {key!r} is truncated: wanted bytes {offset}..{offset + want}, got {n}"
            )

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        n = await self._read_into(key, offset, out)
        if n != len(out):
            from ..errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"object {key!r} is truncated: wanted bytes {offset}..{offset + len(out)}, got {n}"
            )

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        path = self._path(key)
        doing = "writing the manifest" if key.rsplit("/", 1)[-1] == "manifest.json" else "writing"

        def write() -> None:
            d = os.path.dirname(path)
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:  # FileExistsError here: a file stands where the directory should be
                raise self._error(doing, key, e) from e
            if os.path.isdir(path):
                raise self._error(doing, key, IsADirectoryError(errno.EISDIR, "Is a directory", path))
            if if_absent and os.path.lexists(path):
                raise PreconditionFailed(f"object {key!r} already exists")
            tmp = f"{path}.tmp-{secrets.token_hex(6)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as e:
                raise self._error(doing, key, e) from e
            try:
                try:
                    view = memoryview(data).cast("B")
                    while len(view):
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if if_absent:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        raise PreconditionFailed(f"object {key!r} already exists") from None
                else:
                    os.replace(tmp, path)
            except OSError as e:  # a full disk, a read-only remount, ...: the temporary goes too
                _unlink_quietly(tmp)
                if isinstance(e, ObjckptError):
                    raise
                raise self._error(doing, key, e) from e
            except BaseException:
                _unlink_quietly(tmp)
                raise
            if if_absent:
                _unlink_quietly(tmp)
            fsync_dir(d)

        await _runtime.in_thread(write)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        try:
            st = os.stat(self._path(key))
        except OSError as e:
            if is_absent(e):
                return None
            raise self._error("looking up", key, e) from e
        if not stat.S_ISREG(st.st_mode):
            return None  # a directory is a prefix, not an object
        return ObjectInfo(key, st.st_size, mtime=st.st_mtime)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        def walk() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
            start = os.path.join(self.root, *base.split("/")) if base else self.root

            def unreadable(e: OSError) -> None:
                if not is_absent(e):  # a directory that vanished is fine; an unreadable one is not
                    raise storage_error("listing", e.filename or start, self.root, e) from e

            for dirpath, _, files in os.walk(start, onerror=unreadable):
                for fn in files:
                    full = os.path.join(dirpath, fn)
                    key = os.path.relpath(full, self.root).replace(os.sep, "/")
                    if key.startswith(prefix):
                        try:
                            st = os.stat(full)
                            out.append(ObjectInfo(key, st.st_size, mtime=st.st_mtime))
                        except FileNotFoundError:
                            pass
            return sorted(out, key=lambda o: o.key)
        return await _runtime.in_thread(walk)

    async def delete(self, keys: Sequence[str]) -> None:
        def rm() -> None:
            floors: dict[str, str] = {}  # an emptied folder -> the folder its tidy stops at (see _kept)
            failed: list[ObjckptError] = []
            for k in keys:
                p = self._path(k)
                try:
                    os.unlink(p)
                    d, floor = os.path.dirname(p), os.path.join(self.root, *k.split("/")[:_kept(k)])
                    floors[d] = min(floors.get(d, floor), floor, key=len)
                except FileNotFoundError:
                    pass
                except OSError as e:  # keep going: delete what can be deleted, then report
                    if e.errno == errno.ENOTDIR:
                        continue  # a file where a directory should be: the object cannot exist
                    failed.append(self._error("deleting", k, e))
            for d, floor in sorted(floors.items(), key=lambda f: len(f[0]), reverse=True):
                while len(d) > len(floor):  # tidy the folders objckpt made, once empty
                    try:
                        os.rmdir(d)
                    except OSError:
                        break  # not empty (another attempt's files), or cannot: an empty folder is harmless
                    d = os.path.dirname(d)
            if failed:
                more = f" ({len(failed) - 1} more object(s) not deleted)" if len(failed) > 1 else ""
                err = StorageError(f"{failed[0]}{more}")
                err.errno = failed[0].errno  # type: ignore[attr-defined]
                raise err
        await _runtime.in_thread(rm)

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        return _LocalWriter(self, key, size)

    def describe(self) -> str:
        return f"file://{self.root}"
