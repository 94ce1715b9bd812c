"""The object-store seam.

Everything objckpt does to storage goes through :class:`ObjectStore`: a few
small async calls that every backend implements, plus richer calls
(:meth:`ObjectStore.open_writer`, :meth:`ObjectStore.get_range_into`) that get
default versions built on the small ones.  A backend overrides only what it can
do faster (multipart on S3, positional writes on local disk).

Keys are relative to the store's root (an S3 bucket, a directory, a memory
namespace) and always use ``/`` as separator.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import NotFoundError, CorruptCheckpointError
from ..units import MiB

GiB = 1 << 30


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or a HEAD tells about one object."""

    key: str
    size: int
    etag: Optional[str] = None
    mtime: Optional[float] = None  # last modified, seconds since the epoch (when the store says)


@dataclass(frozen=True)
class UploadInfo:
    """An unfinished multipart upload (only stores with multipart have them)."""

    key: str
    upload_id: str
    initiated: Optional[float] = None  # seconds since the epoch


class BlobWriter(abc.ABC):
    """Writes one object from parts that may arrive concurrently and out of order.

    ``write_part(index, offset, data)`` is given the part's index (0-based) and
    its byte offset inside the object; ``complete()`` makes the object visible;
    ``abort()`` throws everything away.  ``data`` is only borrowed for the
    duration of the call, so the caller may reuse its buffer afterwards.
    """

    #: whether the writer sends each part's crc32c (``crc32c=`` of :meth:`write_part_views`) for
    #: the store to check; a writer that ignores it says False, and the save does not build it
    uses_part_crc: bool = True

    @abc.abstractmethod
    async def write_part(self, index: int, offset: int, data: memoryview) -> None: ...

    async def write_part_views(self, index: int, offset: int, views: Sequence[memoryview],
                               crc32c: Optional[int] = None) -> None:
        """Write one part given as consecutive buffers (e.g. straight from tensors).

        ``crc32c``: the part's crc32c when the caller knows it already (combined from
        its chunks' crcs); a backend that has the server verify parts sends it
        instead of hashing the bytes again.  Default: one buffer is passed through,
        several are joined (one copy); backends with vectored writes override it.
        """
        if len(views) == 1:
            await self.write_part(index, offset, views[0])
        else:
            await self.write_part(index, offset, memoryview(b"".join(views)))

    @abc.abstractmethod
    async def complete(self) -> None: ...

    @abc.abstractmethod
    async def abort(self) -> None: ...


class _BufferingWriter(BlobWriter):
    """Default writer: gathers the parts in memory, then one ``put``.

    Only for backends without a native multi-part protocol (memory, fsspec);
    S3 and local files override :meth:`ObjectStore.open_writer`.
    """

    def __init__(self, store: "ObjectStore", key: str, size: int) -> None:
        self._store = store
        self._key = key
        self._buf = bytearray(size)

    async def write_part(self, index: int, offset: int, data: memoryview) -> None:
        self._buf[offset : offset + len(data)] = data

    async def complete(self) -> None:
        await self._store.put(self._key, memoryview(self._buf))
        self._buf = bytearray()

    async def abort(self) -> None:
        self._buf = bytearray()


class ObjectStore(abc.ABC):
    """Async object storage.  All methods run on objckpt's background event loop."""

    #: smallest part a multi-part upload accepts (all but the last part)
    min_part_size: int = 5 * MiB
    #: largest part
    max_part_size: int = 5 * GiB
    #: most parts in one object
    max_parts: int = 10_000
    #: how many requests this store likes in flight at once
    concurrency: int = 16
    #: True where ``put(if_absent=True)`` refuses an existing key by construction (local
    #: files: ``link()``; memory), so no save needs to ask.  False: whether the store
    #: honours it is probed once per store per process (:mod:`objckpt.save.store_check`),
    #: since some S3-compatible stores accept ``If-None-Match: *`` and ignore it.  A
    #: wrapper that passes ``if_absent`` through unchanged may copy its inner store's value
    if_absent_enforced: bool = False

    # -- the small calls every backend implements --------------------------
    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """Whole object; :class:`NotFoundError` if absent."""

    @abc.abstractmethod
    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset``; fewer only if the object is shorter."""

    @abc.abstractmethod
    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        """Write a whole object.  With ``if_absent`` raise :class:`PreconditionFailed`
        instead of replacing an existing object (the commit primitive)."""

    @abc.abstractmethod
    async def head(self, key: str) -> Optional[ObjectInfo]:
        """Size of ``key``, or None if it does not exist."""

    @abc.abstractmethod
    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Delete objects; absent keys are not an error."""

    # -- richer calls with default implementations -------------------------
    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        """A writer for an object of exactly ``size`` bytes sent as ``num_parts`` parts
        (each but the last at least :attr:`min_part_size`)."""
        return _BufferingWriter(self, key, size)

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short object is corruption."""
        data = await self.get_range(key, offset, len(out))
        if len(data) != len(out):
            raise CorruptCheckpointError(
                f"object {key!r} is truncated: wanted bytes {offset}..{offset + len(out)}, "
                f"got {len(data)} of {len(out)}"
            )
        out[:] = data

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill consecutive buffers ``outs`` with the bytes from ``offset`` on (one request).

        Lets one ranged GET land directly in several destinations (e.g. many small
        tensors stored back to back).  The default reads into a scratch buffer
        and copies; backends that can scatter natively override it.
        """
        total = sum(len(o) for o in outs)
        scratch = memoryview(bytearray(total))
        await self.get_range_into(key, offset, scratch)
        pos = 0
        for o in outs:
            o[:] = scratch[pos : pos + len(o)]
            pos += len(o)

    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        """Unfinished multipart uploads under ``prefix`` (none by default)."""
        return []

    async def abort_upload(self, upload: UploadInfo) -> None:
        """Abort an unfinished multipart upload."""

    async def close(self) -> None:
        """Release connections."""

    def describe(self) -> str:
        return type(self).__name__


def not_found(key: str) -> NotFoundError:
    return NotFoundError(f"object {key!r} does not exist")
