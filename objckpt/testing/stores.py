"""Test doubles for the storage seam: wrappers that count requests/bytes or inject faults.

Used by tests (to prove a read moves only what it should, and that a failed
save leaves nothing behind), by benchmarks and ``objckpt demo`` (to report
requests).  They wrap any store, real S3 included, so the proof runs over the
real protocol.  They live here, not in ``objckpt.storage``, because no save or
load path uses them.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Sequence

from ..storage.base import BlobWriter, ObjectInfo, ObjectStore, UploadInfo


class CountingStore(ObjectStore):
    """Counts requests per operation and bytes read/written."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.min_part_size = inner.min_part_size
        self.max_part_size = inner.max_part_size
        self.max_parts = inner.max_parts
        self.concurrency = inner.concurrency
        self.if_absent_enforced = inner.if_absent_enforced  # put passes if_absent through
        self.ops: Counter[str] = Counter()
        self.bytes_read = 0
        self.bytes_written = 0
        self.ranges: list[tuple[str, int, int]] = []
        self.keys_read: list[str] = []  # whole-object GETs

    def reset(self) -> None:
        self.ops.clear()
        self.bytes_read = self.bytes_written = 0
        self.ranges.clear()
        self.keys_read.clear()

    async def get(self, key: str) -> bytes:
        self.ops["get"] += 1
        self.keys_read.append(key)
        data = await self.inner.get(key)
        self.bytes_read += len(data)
        return data

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.ops["get_range"] += 1
        data = await self.inner.get_range(key, offset, length)
        self.bytes_read += len(data)
        self.ranges.append((key, offset, len(data)))
        return data

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        self.ops["get_range"] += 1
        await self.inner.get_range_into(key, offset, out)
        self.bytes_read += len(out)
        self.ranges.append((key, offset, len(out)))

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        self.ops["put"] += 1
        await self.inner.put(key, data, if_absent=if_absent)
        self.bytes_written += len(data)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        self.ops["head"] += 1
        return await self.inner.head(key)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        self.ops["list"] += 1
        return await self.inner.list(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        self.ops["delete"] += 1
        await self.inner.delete(keys)

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        outer = self
        inner = self.inner.open_writer(key, size, num_parts)

        class _W(BlobWriter):
            async def write_part(self, index: int, offset: int, data: memoryview) -> None:
                outer.ops["write_part"] += 1
                await inner.write_part(index, offset, data)
                outer.bytes_written += len(data)

            async def complete(self) -> None:
                outer.ops["complete"] += 1
                await inner.complete()

            async def abort(self) -> None:
                outer.ops["abort"] += 1
                await inner.abort()

        return _W()

    async def list_uploads(self, prefix: str) -> list[UploadInfo]:
        return await self.inner.list_uploads(prefix)

    async def abort_upload(self, upload: UploadInfo) -> None:
        await self.inner.abort_upload(upload)


class FaultyStore(CountingStore):
    """Raises ``error`` on the ``nth`` call (1-based) of operation ``op``
    (``write_part``, ``complete``, ``put``, ``get_range``, ``delete``)."""

    def __init__(self, inner: ObjectStore, op: str, nth: int = 1,
                 error: Callable[[], BaseException] = lambda: ConnectionError("injected fault")) -> None:
        super().__init__(inner)
        self.fail_op, self.fail_nth, self.error = op, nth, error
        self.seen: Counter[str] = Counter()

    def _maybe_fail(self, op: str) -> None:
        self.seen[op] += 1
        if op == self.fail_op and self.seen[op] == self.fail_nth:
            raise self.error()

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        self._maybe_fail("put")
        await super().put(key, data, if_absent=if_absent)

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        self._maybe_fail("get_range")
        await super().get_range_into(key, offset, out)

    async def delete(self, keys: Sequence[str]) -> None:
        self._maybe_fail("delete")  # a delete killed between its requests
        await super().delete(keys)

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        w = super().open_writer(key, size, num_parts)
        outer = self

        class _F(BlobWriter):
            async def write_part(self, index: int, offset: int, data: memoryview) -> None:
                outer._maybe_fail("write_part")
                await w.write_part(index, offset, data)

            async def complete(self) -> None:
                outer._maybe_fail("complete")
                await w.complete()

            async def abort(self) -> None:
                await w.abort()

        return _F()
