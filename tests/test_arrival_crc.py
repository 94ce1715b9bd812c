"""crcs computed as bytes arrive (checksum.CellCrcs, load/arrival.py).

A load over the direct S3 path judges its crc checks from the crcs its
receiving threads computed while the bytes landed; these tests check that
every byte is still verified that way (a flipped byte anywhere in a chunk, or
in a crc block read only in part, fails the load) and that an intact load
does not hash its destinations a second time.
"""
from __future__ import annotations

import os
import random
from typing import Any, Iterator

import pytest
import torch

import objckpt
from objckpt.checksum import REHASH_BELOW, CellCrcs, block_crcs, combine_blocks, crc32c, crc32c_combine
from objckpt.load import arrival, ranged_get
from objckpt.planning.ranges import Request, RequestPiece, Span
from testkit.s3memstore import _Data
from testkit.s3server import S3Server

from conftest import make_bucket, s3_options


def test_cells_are_the_crcs_of_the_bytes_between_cuts() -> None:
    rng = random.Random(1)
    data = os.urandom(200_000)
    for _ in range(100):
        cuts = rng.sample(range(1, len(data)), rng.randint(0, 12))
        cells = CellCrcs(cuts + [0, len(data), len(data) + 5], len(data))
        pos = 0
        while pos < len(data):
            n = rng.randint(1, 40_000)
            cells.feed(memoryview(data)[pos : pos + n])
            pos += n
        got = cells.cells()
        assert got is not None and [s for s, _, _ in got] == [0] + sorted(set(cuts))
        assert all(crc32c(data[s : s + n]) == c for s, n, c in got)
        assert sum(n for _, n, _ in got) == len(data)


@pytest.mark.parametrize("block", [1, 3, 1024, 1000, 4096])
def test_block_crcs_combine_to_the_whole_crc(block: int) -> None:
    """Whole blocks combine through cached tables (powers of two too in crc32c_combine),
    the rest through the bit loop: both must give the crc of the bytes."""
    data = os.urandom(20 * 4096 + 17)
    for n in (block + 1, 3 * block, 7 * block + 5, len(data)):
        view = memoryview(data)[:n]
        total, blocks = block_crcs(view, block)
        assert total == crc32c(view) == combine_blocks(blocks, n, block)
        assert blocks == [crc32c(view[i : i + block]) for i in range(0, n, block)]
    for cut in (1, 4096, 8192, 65536, 12345):
        a, b = data[:-cut], data[-cut:]
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(data)


@pytest.mark.parametrize("n", [REHASH_BELOW - 1, REHASH_BELOW, 3 * REHASH_BELOW + 7])
def test_block_crcs_hash_again_below_the_threshold_and_combine_above(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small data: the whole crc is hashed again (cheaper than combining in Python); large
    data: combined from the blocks. Either way it is the crc of the bytes."""
    import objckpt.checksum as ck

    data = memoryview(os.urandom(n))
    combined: list[int] = []
    real = ck.combine_blocks

    def counting(blocks: Any, length: int, block: int) -> int:
        combined.append(length)
        return real(blocks, length, block)

    monkeypatch.setattr(ck, "combine_blocks", counting)
    total, blocks = ck.block_crcs(data, 4096)
    assert total == crc32c(data) and blocks == [crc32c(data[i : i + 4096]) for i in range(0, n, 4096)]
    assert combined == ([] if n < REHASH_BELOW else [n])


def test_cells_of_a_stream_fed_in_part_are_none_and_overfeeding_fails() -> None:
    cells = CellCrcs([10], 100)
    cells.feed(memoryview(bytes(50)))
    assert cells.cells() is None
    cells.feed(memoryview(bytes(50)))
    assert cells.cells() is not None
    with pytest.raises(ValueError):
        cells.feed(memoryview(bytes(1)))


class _R:
    def __init__(self, checks: Any) -> None:
        self.checks = checks


def test_verdict_combines_cells_and_refuses_checks_it_cannot_tile() -> None:
    data = os.urandom(3000)
    # one read, two block checks [0, 1000) and [1000, 3000), served by two requests
    read = _R(((0, 1000, crc32c(data[:1000]), "b0"), (1000, 2000, crc32c(data[1000:]), "b1")))
    t = arrival.Tallies([read])
    span = Span("blob", 0, 3000, 0)
    reqs = [Request("blob", 0, 1500, [RequestPiece(span, 0, 0, 1500)]),
            Request("blob", 1500, 1500, [RequestPiece(span, 0, 1500, 1500)])]
    for req in reqs:
        tally = t.for_request(req)
        assert tally is not None
        start = reqs[0].length if req is reqs[1] else 0
        tally.feed(memoryview(data)[start : start + req.length])
        t.record(req, tally)
    assert t.verdict(0) == (True, None)
    # a flipped byte in the second block: judged, and that check named
    bad = bytearray(data)
    bad[2999] ^= 1
    t = arrival.Tallies([read])
    for req, start in zip(reqs, (0, 1500)):
        tally = t.for_request(req)
        assert tally is not None
        tally.feed(memoryview(bytes(bad))[start : start + req.length])
        t.record(req, tally)
    judged, mismatch = t.verdict(0)
    assert judged and mismatch is not None and mismatch[0][3] == "b1"
    # only one request tallied: the second block is not covered, so not judged
    t = arrival.Tallies([read])
    tally = t.for_request(reqs[0])
    assert tally is not None
    tally.feed(memoryview(data)[:1500])
    t.record(reqs[0], tally)
    assert t.verdict(0) == (False, None)


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    s = S3Server()
    s.start()
    yield s
    s.stop()


def _flip(server: S3Server, bucket: str, blob_name: str, at: int) -> None:
    def flip() -> None:
        objects = server.state.buckets[bucket].objects
        (key,) = [k for k in objects if k.endswith(blob_name)]
        o = objects[key]
        raw = bytearray(b"".join(bytes(c) for c in o.data.chunks))
        raw[at] ^= 0x40
        o.data = _Data([bytes(raw)])

    server._call(flip)


@pytest.fixture
def no_second_pass(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record reads that were hashed after arrival (the fallback)."""
    hashed: list[str] = []
    real = ranged_get.first_mismatch

    def spy(r: Any) -> Any:
        hashed.append(r.key)
        return real(r)

    monkeypatch.setattr(ranged_get, "first_mismatch", spy)
    return hashed


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 40 MiB: split into 8 MiB GETs; many small tensors: merged into scatter GETs
    out = {"big": torch.randn(10 << 20, generator=g)}
    out.update({f"small{i}": torch.randn(100 + i, generator=g) for i in range(40)})
    return out


def test_intact_load_is_judged_on_arrival(server: S3Server, no_second_pass: list[str]) -> None:
    opts = s3_options(server.endpoint_url)
    uri = f"s3://{make_bucket(server.endpoint_url)}/ck"
    sd = _state()
    objckpt.save(sd, uri, storage_options=opts)
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    objckpt.load(dst, uri, storage_options=opts)
    assert all(torch.equal(dst[k], v) for k, v in sd.items())
    assert no_second_pass == []


@pytest.mark.parametrize("key, at", [("big", 0), ("big", (20 << 20) + 3), ("big", (40 << 20) - 1),
                                     ("small7", 5), ("small39", 4 * 139 - 1)])
def test_flipped_byte_fails_the_load(server: S3Server, key: str, at: int) -> None:
    opts = s3_options(server.endpoint_url)
    bucket = make_bucket(server.endpoint_url)
    uri = f"s3://{bucket}/ck"
    sd = _state()
    objckpt.save(sd, uri, storage_options=opts)
    m = objckpt.inspect(uri, storage_options=opts)
    for c in sorted(m.tensors[key].chunks, key=lambda c: tuple(c.offsets)):  # the chunk holding byte ``at``
        if at < c.length:
            break
        at -= c.length
    _flip(server, bucket, m.blobs[c.blob].name, c.offset + at)
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    with pytest.raises(objckpt.CorruptCheckpointError, match=f"'{key}'.*crc32c mismatch"):
        objckpt.load(dst, uri, storage_options=opts)


@pytest.mark.parametrize("where", ["before", "inside", "after", None])
def test_partly_read_blocks_are_judged_on_arrival(server: S3Server, no_second_pass: list[str],
                                                  where: Any) -> None:
    """Rows starting and ending inside crc blocks, read over S3: verified from the cells
    between block boundaries, and a flipped byte of a touched block fails the load."""
    opts = s3_options(server.endpoint_url)
    bucket = make_bucket(server.endpoint_url)
    uri = f"s3://{bucket}/ck"
    full = torch.randn(512, 64)  # 128 KiB in 256-byte rows
    objckpt.save({"w": full}, uri, storage_options=opts)
    m = objckpt.inspect(uri, storage_options=opts)
    (c,) = m.tensors["w"].chunks
    block, row = m.crc_block, 256
    assert row < block < full.numel() * 4
    r0 = block // row + 1
    r1 = r0 + 3 * block // row
    lo, hi = (r0 * row) // block * block, -(-(r1 * row) // block) * block
    dst = objckpt.Shard(torch.zeros(r1 - r0, 64), (512, 64), (r0, 0))
    if where is None:
        objckpt.load({"w": dst}, uri, storage_options=opts)
        assert torch.equal(dst.local, full[r0:r1]) and no_second_pass == []
        return
    _flip(server, bucket, m.blobs[c.blob].name, c.offset + {"before": lo + 5, "inside": r0 * row + 7,
                                                            "after": hi - 3}[where])
    with pytest.raises(objckpt.CorruptCheckpointError, match="crc32c mismatch"):
        objckpt.load({"w": dst}, uri, storage_options=opts)
