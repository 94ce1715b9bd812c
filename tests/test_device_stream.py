"""Whole chunks through the ring of reused host buffers (objckpt.load.device_stream).

On a GPU machine device destinations take this path; here the same code runs
with CPU destinations (the copy engine's plain branch) against moto over HTTP:
segmenting, packing, slot reuse, crc combining and the errors are the same.
The CUDA run is in test_cuda.py.
"""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.checksum import crc32c
from objckpt.errors import BlobMissingError, CorruptCheckpointError
from objckpt.load import device_stream, fill
from objckpt.load.device_stream import DeviceRead, segments, stream_reads
from objckpt.runtime.memory import host_pool
from objckpt.results import IOStats
from objckpt.storage import open_store


def _read(key: str, blob: str, offset: int, dest: torch.Tensor, crc: Optional[int] = None) -> DeviceRead:
    return DeviceRead(key, blob, offset, dest, crc, "chunk")


def test_segments_cut_large_reads_and_pack_neighbours() -> None:
    e = torch.empty
    reads = [
        _read("big", "b0", 0, e(250, dtype=torch.uint8)),
        _read("small", "b0", 250, e(30, dtype=torch.uint8)),  # follows "big": shares its last GET
        _read("far", "b0", 1000, e(10, dtype=torch.uint8)),  # a gap larger than allowed: a GET of its own
        _read("other", "b1", 0, e(20, dtype=torch.uint8)),  # another blob: never shares
        _read("empty", "b1", 20, e(0, dtype=torch.uint8)),  # nothing to fetch
    ]
    segs = segments(reads, slot=100, merge_gap=16)
    assert [(s.blob_key, s.offset, s.length) for s in segs] == [
        ("b0", 0, 100), ("b0", 100, 100), ("b0", 200, 80), ("b0", 1000, 10), ("b1", 0, 20)]
    assert segs[2].pieces == ((0, 200, 250, 0), (1, 0, 30, 50))
    # every byte of every read is served exactly once
    served = {i: 0 for i in range(len(reads))}
    for s in segs:
        for i, a, b, at in s.pieces:
            assert 0 <= at and at + (b - a) <= s.length
            served[i] += b - a
    assert served == {i: r.dest.numel() for i, r in enumerate(reads)}
    # a gap small enough is read and dropped rather than cost a request
    packed = segments([reads[1], _read("near", "b0", 290, e(8, dtype=torch.uint8))], slot=100, merge_gap=16)
    assert [(s.offset, s.length) for s in packed] == [(250, 48)]
    assert packed[0].pieces[1] == (1, 0, 8, 40)


@pytest.fixture
def blob_store(moto_s3: tuple[str, dict[str, Any]]) -> Any:
    bucket, opts = moto_s3
    st, prefix = open_store(f"s3://{bucket}/ring", opts)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    key = f"{prefix}/blob"
    _runtime.run(st.put(key, memoryview(data.numpy())))
    return st, key, data


def _layout(key: str, data: torch.Tensor, dest: torch.Tensor) -> list[DeviceRead]:
    """Four chunks of the blob (a large one, two small neighbours, one after a gap),
    each checked against its crc, into consecutive parts of ``dest``."""
    spans = [(0, 300_000), (300_000, 300_007), (300_007, 300_100), (310_000, 1 << 20)]
    out, pos = [], 0
    for n, (a, b) in enumerate(spans):
        out.append(_read(f"t{n}", key, a, dest[pos : pos + b - a], crc32c(memoryview(data[a:b].numpy()))))
        pos += b - a
    return out


def test_stream_reads_fills_and_checks_through_few_reused_slots(blob_store: Any) -> None:
    st, key, data = blob_store
    dest = torch.zeros(data.numel(), dtype=torch.uint8)
    reads = _layout(key, data, dest)
    stats = IOStats()
    pool = host_pool()
    _runtime.run(stream_reads(st, reads, stats, slot_bytes=64 << 10, ring_bytes=3 * (64 << 10)))
    for r in reads:
        assert torch.equal(r.dest, data[r.offset : r.offset + r.dest.numel()]), r.key
    assert stats.requests == len(segments(reads, 64 << 10))
    assert stats.bytes == sum(s.length for s in segments(reads, 64 << 10))
    assert pool._lent == 0  # every slot is back in the pool, to serve the next load or save


def test_stream_reads_names_the_tensor_of_a_corrupt_chunk(blob_store: Any) -> None:
    st, key, data = blob_store
    dest = torch.zeros(data.numel(), dtype=torch.uint8)
    reads = _layout(key, data, dest)
    bad = reads[3]
    reads[3] = DeviceRead(bad.key, bad.blob_key, bad.offset, bad.dest, bad.crc ^ 1, bad.what)  # type: ignore[operator]
    with pytest.raises(CorruptCheckpointError, match=r"tensor 't3'.*crc32c mismatch.*offset 310000"):
        _runtime.run(stream_reads(st, reads, IOStats(), slot_bytes=64 << 10, ring_bytes=2 * (64 << 10)))
    assert host_pool()._lent == 0


def test_stream_reads_names_the_tensors_of_a_missing_blob(blob_store: Any) -> None:
    st, key, _ = blob_store
    reads = [_read("model.w", key + "-gone", 0, torch.zeros(1000, dtype=torch.uint8), 0)]
    with pytest.raises(BlobMissingError, match=r"blob-gone.*missing.*'model.w'"):
        _runtime.run(stream_reads(st, reads, IOStats(), slot_bytes=256))
    assert host_pool()._lent == 0


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "emb": torch.randn(3000, 64, generator=g),
        "layers": [{"w": torch.randn(257, 33, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16)}
                   for _ in range(3)],
        "scale": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "step": 7,
    }


def test_load_routes_whole_chunks_through_the_ring(moto_s3: tuple[str, dict[str, Any]], monkeypatch: Any) -> None:
    """A full load with every contiguous destination sent through the ring, as device
    destinations are: small slots, fresh tensors, a resharded shard beside it."""
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/ck"
    sd = _state()
    objckpt.save(sd, uri, storage_options=opts)
    calls: list[int] = []
    real = fill.stream_reads

    async def spy(st: Any, reads: Any, stats: Any, **kw: Any) -> None:
        calls.append(len(reads))
        await real(st, reads, stats, **kw)

    monkeypatch.setattr(fill, "through_ring", lambda t: t.is_contiguous())
    monkeypatch.setattr(fill, "stream_reads", spy)
    monkeypatch.setattr(device_stream, "SLOT_BYTES", 96 << 10)  # the 768 KB embedding takes 8 slots
    monkeypatch.setattr(device_stream, "RING_BYTES", 3 * (96 << 10))
    fresh = {
        "emb": torch.empty(3000, 64),
        "layers": [{"w": torch.empty(257, 33), "b": torch.empty(33, dtype=torch.bfloat16)} for _ in range(3)],
        "scale": torch.empty(()),
        "empty": torch.empty(0, 4),
        "step": 0,
    }
    res = objckpt.load(fresh, uri, storage_options=opts)
    assert calls and sum(calls) == 8  # every non-empty tensor, none through the host path
    assert res.tensors == 9
    assert torch.equal(fresh["emb"], sd["emb"]) and torch.equal(fresh["scale"], sd["scale"])
    for a, b in zip(fresh["layers"], sd["layers"]):
        assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
    assert fresh["step"] == 7
    # a shard that cuts the stored chunk still goes through a temporary; both kinds in one load
    calls.clear()
    shard = objckpt.Shard(torch.zeros(1000, 64), (3000, 64), (1000, 0))
    objckpt.load({"emb": shard, "scale": torch.empty(())}, uri, storage_options=opts, strict=False)
    assert torch.equal(shard.local, sd["emb"][1000:2000])
    assert calls == [1]  # the 0-d tensor, whole; the shard's rows are staged
    assert host_pool()._lent == 0
