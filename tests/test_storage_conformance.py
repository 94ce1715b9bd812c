"""One conformance suite that every storage backend passes.

Each backend subclasses :class:`Conformance` and provides a ``store`` fixture;
S3 runs over real HTTP against moto and against the benchmark S3 server.
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from objckpt.runtime import loop as _runtime
from objckpt.errors import CorruptCheckpointError, NotFoundError, PreconditionFailed
from objckpt.storage.base import ObjectStore
from objckpt.storage.fsspec_store import FsspecStore
from objckpt.storage.local import LocalStore
from objckpt.storage.memory import MemoryStore
from objckpt.storage.s3 import S3Store

from conftest import make_bucket, s3_options

MiB = 1 << 20


def run(coro: Any) -> Any:
    return _runtime.run(coro)


class Conformance:
    def test_put_get_head(self, store: ObjectStore) -> None:
        run(store.put("a/b/c.bin", b"hello world"))
        assert run(store.get("a/b/c.bin")) == b"hello world"
        info = run(store.head("a/b/c.bin"))
        assert info is not None and info.size == 11
        assert run(store.head("a/b/none")) is None
        run(store.put("a/b/c.bin", memoryview(b"replaced")))
        assert run(store.get("a/b/c.bin")) == b"replaced"

    def test_missing_raises_not_found(self, store: ObjectStore) -> None:
        with pytest.raises(NotFoundError, match="nope"):
            run(store.get("nope"))
        with pytest.raises(FileNotFoundError):
            run(store.get_range_into("nope", 0, memoryview(bytearray(4))))

    def test_ranges(self, store: ObjectStore) -> None:
        data = os.urandom(100_000)
        run(store.put("r", data))
        assert run(store.get_range("r", 10, 20)) == data[10:30]
        assert run(store.get_range("r", 99_990, 100)) == data[99_990:]
        out = bytearray(5000)
        run(store.get_range_into("r", 1234, memoryview(out)))
        assert bytes(out) == data[1234:6234]
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            run(store.get_range_into("r", 99_000, memoryview(bytearray(2000))))
        assert run(store.get_range("r", 100_010, 5)) == b""  # starts past the end: nothing, on every path
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            run(store.get_range_into("r", 100_010, memoryview(bytearray(5))))

    def test_conditional_put(self, store: ObjectStore) -> None:
        run(store.put("m.json", b"first", if_absent=True))
        with pytest.raises(PreconditionFailed):
            run(store.put("m.json", b"second", if_absent=True))
        assert run(store.get("m.json")) == b"first"

    def test_list_and_delete(self, store: ObjectStore) -> None:
        for k in ["p/x/1", "p/x/2", "p/y/3", "q/4"]:
            run(store.put(k, k.encode()))
        assert [o.key for o in run(store.list("p/x/"))] == ["p/x/1", "p/x/2"]
        assert [o.key for o in run(store.list("p/"))] == ["p/x/1", "p/x/2", "p/y/3"]
        assert {o.size for o in run(store.list("p/"))} == {5}
        run(store.delete(["p/x/1", "p/y/3", "does/not/exist"]))
        assert [o.key for o in run(store.list("p/"))] == ["p/x/2"]

    def test_writer_parts_out_of_order(self, store: ObjectStore) -> None:
        sizes = [5 * MiB + 3, 5 * MiB, 1234]
        parts = [os.urandom(n) for n in sizes]
        total = sum(sizes)
        w = store.open_writer("blob/multi", total, len(parts))
        offsets = [0, sizes[0], sizes[0] + sizes[1]]

        async def go() -> None:
            import asyncio

            await asyncio.gather(*(w.write_part(i, offsets[i], memoryview(parts[i])) for i in (2, 0, 1)))
            await w.complete()

        run(go())
        assert run(store.get("blob/multi")) == b"".join(parts)

    def test_writer_single_part_and_abort(self, store: ObjectStore) -> None:
        w = store.open_writer("blob/one", 10, 1)
        run(w.write_part(0, 0, memoryview(b"0123456789")))
        run(w.complete())
        assert run(store.get("blob/one")) == b"0123456789"
        w = store.open_writer("blob/aborted", 6 * MiB, 2)
        run(w.write_part(0, 0, memoryview(os.urandom(5 * MiB))))
        run(w.abort())
        assert run(store.head("blob/aborted")) is None
        assert run(store.list_uploads("blob/")) == []


class TestMemory(Conformance):
    @pytest.fixture
    def store(self) -> ObjectStore:
        return MemoryStore()


class TestLocal(Conformance):
    @pytest.fixture
    def store(self, tmp_path: Any) -> ObjectStore:
        return LocalStore(str(tmp_path))

    def test_tallied_reads_hash_every_cell_across_pieces(self, store: ObjectStore) -> None:
        """A tallied read (the loads' and the device ring's path) scatters the bytes and hashes
        them as they land, in pieces smaller than the request: every cell's crc32c must be
        that of its bytes, across views and piece boundaries; a short read is an error."""
        from objckpt.checksum import CellCrcs, crc32c
        from objckpt.storage import local as local_mod

        data = os.urandom(9 * MiB + 777)
        run(store.put("t", data))
        off = 409
        sizes = [3, 5 * MiB, 123, 4 * MiB - 3]  # views crossing the 4 MiB pieces
        bufs = [bytearray(n) for n in sizes]
        total = sum(sizes)
        cuts = [1, 3 + 17, 4 * MiB + 5, 5 * MiB + 3, total - 1]
        tally = CellCrcs(cuts, total)
        run(store.get_range_tallied("t", off, [memoryview(b) for b in bufs], tally))
        assert b"".join(bufs) == data[off:off + total]
        cells = tally.cells()
        assert cells is not None and len(cells) == len(cuts) + 1
        for start, n, crc in cells:
            assert crc == crc32c(data[off + start:off + start + n]), (start, n)
        assert local_mod.TALLY_PIECE < total  # the pieces were really cut
        short = CellCrcs([10], 2 * MiB)
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            run(store.get_range_tallied("t", len(data) - MiB, [memoryview(bytearray(2 * MiB))], short))
        assert short.cells() is None


class TestFsspec(Conformance):
    @pytest.fixture
    def store(self, tmp_path: Any) -> ObjectStore:
        return FsspecStore("file", str(tmp_path))


class TestS3Moto(Conformance):
    @pytest.fixture
    def store(self, moto_s3: tuple[str, dict[str, Any]]) -> Iterator[ObjectStore]:
        bucket, opts = moto_s3
        s = S3Store(bucket, **opts)
        yield s
        run(s.close())


class TestS3MotoBotocore(Conformance):
    """The same contract with the direct HTTP path off (botocore does every request)."""

    @pytest.fixture
    def store(self, moto_s3: tuple[str, dict[str, Any]]) -> Iterator[ObjectStore]:
        bucket, opts = moto_s3
        s = S3Store(bucket, **opts, direct_http=False)
        yield s
        run(s.close())


class TestS3FastServer(Conformance):
    @pytest.fixture
    def store(self, fast_endpoint: str) -> Iterator[ObjectStore]:
        s = S3Store(make_bucket(fast_endpoint), **s3_options(fast_endpoint))
        yield s
        run(s.close())
