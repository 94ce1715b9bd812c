"""read(keys=[k]) and load() move only the bytes they need."""
from __future__ import annotations

from typing import Any

import torch

import objckpt
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore


def _big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(8):
        sd[f"h{i}.w"] = torch.randn(512, 1024, generator=g)  # 2 MiB each
        sd[f"h{i}.ln"] = torch.randn(1024, generator=g)
    return sd


def test_read_one_key_moves_only_its_bytes_s3(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/ck"
    sd = _big_state()
    objckpt.save(sd, uri, storage_options=opts)
    counting = CountingStore(open_store(uri, opts)[0])
    m = objckpt.inspect(uri, storage_options=opts)
    manifest_bytes = len(objckpt.format.manifest.encode(m))
    counting.reset()
    out = objckpt.read(uri, keys=["h3.w"], store=counting)
    assert torch.equal(out["h3.w"], sd["h3.w"])
    tensor_bytes = sd["h3.w"].numel() * 4
    moved = counting.bytes_read
    assert moved <= 1.05 * tensor_bytes + manifest_bytes, (moved, tensor_bytes)
    assert counting.ops["get"] == 1  # one GET for the manifest
    assert all(length <= tensor_bytes for _, _, length in counting.ranges)

    counting.reset()
    out = objckpt.read(uri, keys=["h5.ln"], store=counting)
    assert torch.equal(out["h5.ln"], sd["h5.ln"])
    assert counting.bytes_read - manifest_bytes <= 4096 + (256 << 10)  # tiny tensor: at most merge slack


def test_non_strict_load_of_a_subset_reads_subset(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    sd = _big_state()
    objckpt.save(sd, uri)
    counting = CountingStore(open_store(uri)[0])
    target = {"h0.w": torch.zeros(512, 1024), "h7.w": torch.zeros(512, 1024)}
    res = objckpt.load(target, uri, strict=False, store=counting)
    assert torch.equal(target["h7.w"], sd["h7.w"])
    assert counting.bytes_read <= 2 * 512 * 1024 * 4 * 1.05 + (64 << 10)
    assert res.bytes == counting.bytes_read


def test_large_tensor_is_fetched_with_concurrent_ranges(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    t = torch.randn(4096, 2048)  # 32 MiB
    objckpt.save({"t": t}, uri, part_size=4 << 20)
    counting = CountingStore(open_store(uri)[0])
    out = objckpt.read(uri, store=counting)
    assert torch.equal(out["t"], t)
    # merged into requests of at most 16 MiB, fetched concurrently
    assert counting.ops["get_range"] >= 2
    assert max(n for _, _, n in counting.ranges) <= 16 << 20


def test_strided_and_partial_targets_are_filled_in_bounded_batches(tmp_path: Any) -> None:
    """Destinations that need temporaries are filled batch by batch under the budget."""
    from objckpt.load import fill
    from objckpt.runtime.memory import Budget
    from objckpt.results import IOStats

    uri = str(tmp_path / "ck")
    sd = _big_state()
    objckpt.save(sd, uri)
    store, prefix = open_store(uri)
    m = objckpt.inspect(uri)
    dests = {k: torch.zeros(v.shape[::-1]).t() if v.dim() == 2 else torch.zeros(v.shape) for k, v in sd.items()}
    targets = [fill.FillTarget(k, (tuple(0 for _ in v.shape), tuple(v.shape)), dests[k]) for k, v in sd.items()]
    calls = []
    real = fill.read_ranges

    async def counting(*a: Any, **kw: Any) -> None:
        calls.append(len(a[1]))
        await real(*a, **kw)

    fill.read_ranges = counting  # type: ignore[assignment]
    try:
        fill.fill_boxes(store, prefix, m, targets, IOStats(), budget=Budget(3 << 20))
    finally:
        fill.read_ranges = real  # type: ignore[assignment]
    assert len(calls) >= 5  # 16 MiB of strided destinations, at most ~3 MiB of temporaries at a time
    assert all(torch.equal(dests[k], sd[k]) for k in sd)


def test_read_plan_is_data_before_any_byte_moves(tmp_path: Any) -> None:
    """A load's read plan can be built, inspected and printed without reading tensor bytes:
    whole chunks into contiguous CPU destinations go in place, strided ones through
    temporaries, batched under the budget."""
    from objckpt.layout import resolver_for
    from objckpt.load.fill import FillTarget, plan_fill
    from objckpt.runtime.memory import Budget

    uri = str(tmp_path / "ck")
    sd = {"a": torch.randn(256, 1024), "b": torch.randn(512, 512)}
    objckpt.save(sd, uri, part_size=256 << 10)  # chunks of 256 KiB
    store, prefix = open_store(uri)
    counting = CountingStore(store)
    m = objckpt.inspect(uri)
    targets = [FillTarget("a", ((0, 0), (256, 1024)), torch.empty(256, 1024)),  # in place
               FillTarget("b", ((0, 0), (512, 512)), torch.empty(512, 512).t())]  # strided: staged
    plan = plan_fill(m, resolver_for(m, counting, prefix), targets, Budget(512 << 10))
    assert counting.ops.get("get_range", 0) == 0 and counting.ops.get("get", 0) == 0
    direct = [r for b in plan.batches for r in b.direct]
    staged = [r for b in plan.batches for r in b.staged]
    assert {r.target for r in direct} == {0} and {r.target for r in staged} == {1}
    assert sum(r.chunk.length for r in direct) == 256 * 1024 * 4
    assert plan.fetched_bytes == (256 * 1024 + 512 * 512) * 4
    assert len(plan.batches) >= 2 and all(b.temp_bytes <= 512 << 10 or len(b.staged) == 1 for b in plan.batches)
    assert "ReadPlan: 2 target(s)" in str(plan)
