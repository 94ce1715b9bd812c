"""CUDA paths: saving from and loading into GPU tensors (skipped without a GPU).

The CPU paths they mirror are covered by test_roundtrip.py and test_partial_read.py.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_save_from_gpu_load_into_gpu(tmp_path: Any) -> None:
    uri = str(tmp_path / "gpu")
    sd = {
        "w": torch.randn(1024, 512, device="cuda"),
        "h": torch.randn(300, 7, device="cuda", dtype=torch.bfloat16),
        "t": torch.randn(64, 32, device="cuda").t(),  # strided on the device
        "cpu": torch.arange(10),
    }
    objckpt.save(sd, uri, part_size=1 << 20)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    objckpt.load(target, uri)
    for k in sd:
        assert target[k].device == sd[k].device
        assert torch.equal(target[k].cpu(), sd[k].cpu()), k
    back = objckpt.read(uri)
    assert torch.equal(back["w"], sd["w"].cpu())


def test_partial_chunk_into_gpu_shard(tmp_path: Any) -> None:
    uri = str(tmp_path / "gpu-shard")
    full = torch.randn(100, 64)
    objckpt.save({"w": full}, uri, crc_block=4096)
    shard = objckpt.Shard(torch.zeros(30, 64, device="cuda"), (100, 64), (35, 0))
    objckpt.load({"w": shard}, uri)
    assert torch.equal(shard.local.cpu(), full[35:65])


def test_async_save_from_gpu_on_side_stream_with_pinned_reused_pool(tmp_path: Any) -> None:
    from objckpt.runtime.memory import host_pool

    a = torch.randn(2048, 2048, device="cuda")
    sd = {"w": torch.randn(4096, 1024, device="cuda"), "h": torch.randn(1000, device="cuda", dtype=torch.bfloat16)}
    ref = {k: v.cpu() for k, v in sd.items()}
    budget = 8 << 20
    host_pool().reset_peak()
    for i in range(2):
        busy = a @ a  # a kernel running on the default stream while staging copies on the side stream
        h = objckpt.async_save(sd, str(tmp_path / f"g{i}"), staging_bytes=budget, part_size=4 << 20)
        sd["w"].mul_(2)  # after return the caller may mutate
        h.result(timeout=120)
        back = objckpt.read(str(tmp_path / f"g{i}"))
        assert torch.equal(back["w"], ref["w"] * (2 ** i))
        assert torch.equal(back["h"], ref["h"])
        del busy
        torch.cuda.synchronize()
    pool = host_pool()
    assert pool.pin and pool.peak <= budget + (4 << 20)  # pinned buffers, reused (not grown) by the second save


def test_load_into_gpu_streams_through_a_pinned_ring(tmp_path: Any, monkeypatch: Any) -> None:
    """Whole chunks go through a few reused pinned slots, copied on the side stream while
    the next bytes arrive; the caller's stream (not the default one) sees the data."""
    from objckpt.load import device_stream
    from objckpt.runtime.memory import host_pool

    uri = str(tmp_path / "ring")
    sd = {"emb": torch.randn(4096, 1024), "b": torch.randn(1000).to(torch.bfloat16), "s": torch.tensor(3.0)}
    objckpt.save(sd, uri)
    monkeypatch.setattr(device_stream, "SLOT_BYTES", 1 << 20)  # 16 MiB embedding: 16 slots' worth
    monkeypatch.setattr(device_stream, "RING_BYTES", 4 << 20)
    a = torch.randn(2048, 2048, device="cuda")
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        target = {k: torch.zeros_like(v, device="cuda") for k, v in sd.items()}  # written on the caller's stream
        busy = a @ a
        objckpt.load(target, uri)
        sums = {k: v.float().sum() for k, v in target.items()}  # queued on the caller's stream
    torch.cuda.synchronize()
    assert busy.shape == (2048, 2048)
    for k in sd:
        assert torch.equal(target[k].cpu(), sd[k]), k
        assert torch.allclose(sums[k].cpu(), sd[k].float().sum()), k
    pool = host_pool()
    assert pool.pin and pool._lent == 0
