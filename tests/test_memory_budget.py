"""One memory budget per operation, and a pool whose cap no caller changes.

The pool: two callers with different budgets each get buffers within their own
budget, and neither shrinks nor grows what the pool keeps for the other.  A load:
its cast temporaries, read temporaries and (across real gloo ranks) its collective
batches draw from the one ``memory_bytes`` budget, whose recorded peak stays within
it even where each part's own default would have overshot it; a piece that cannot
fit is an error naming the budget.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import MemoryBudgetError, ObjckptError
from objckpt.runtime import memory
from objckpt.runtime.memory import Budget, HostPool, OperationBudget

from mp import run_multiprocess

KiB = 1 << 10


def _recording(monkeypatch: Any) -> list[OperationBudget]:
    """Every load budget ``objckpt.load`` makes, kept to read its peak afterwards."""
    import objckpt.api as api

    made: list[OperationBudget] = []

    def record(*args: Any, **kw: Any) -> OperationBudget:
        made.append(memory.load_budget(*args, **kw))
        return made[-1]

    monkeypatch.setattr(api, "load_budget", record)
    return made


# --------------------------------------------------------------------------- the pool


def test_two_callers_budgets_do_not_change_each_others_cap() -> None:
    pool = HostPool(pin=False, keep=512 * KiB)
    big, small = Budget(4 * 64 * KiB), Budget(16 * KiB)
    a = [pool.take(64 * KiB, big) for _ in range(4)]
    for buf in a:
        pool.give(buf)
    assert pool.allocated == 4 * 64 * KiB  # idle, kept for the next operation
    b = pool.take(8 * KiB, small)
    assert b.numel() <= small.nbytes  # the small caller is never handed the big caller's 64 KiB buffers
    pool.give(b)
    # the small caller's budget did not shrink the pool: the big caller's buffers are still there
    assert pool.keep == 512 * KiB
    assert sum(1 for f in pool._free if f.numel() == 64 * KiB) == 4
    again = [pool.take(64 * KiB, big) for _ in range(4)]
    assert {x.data_ptr() for x in again} == {x.data_ptr() for x in a}  # reused, not allocated anew
    for buf in again:
        pool.give(buf)
    # nor does a caller with a larger budget grow it: idle buffers make room for its buffer
    huge = pool.take(384 * KiB, Budget(1 << 30))
    assert pool.allocated <= pool.keep
    pool.give(huge)
    assert pool.keep == 512 * KiB and pool.allocated <= pool.keep


def test_pool_cap_is_read_once_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv(memory.POOL_KEEP_ENV, str(3 << 20))
    pool = HostPool(pin=False)
    assert pool.keep == 3 << 20
    monkeypatch.setenv(memory.POOL_KEEP_ENV, "1")
    pool.give(pool.take(1 << 20, Budget(1 << 20)))
    assert pool.keep == 3 << 20 and pool.allocated == 1 << 20  # set once, when the pool was made
    monkeypatch.setenv(memory.POOL_KEEP_ENV, "lots")
    with pytest.raises(ValueError, match=memory.POOL_KEEP_ENV):
        HostPool(pin=False)


# --------------------------------------------------------------------------- one load, one budget


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"c{i}": torch.randn(128, 256, generator=g) for i in range(6)}  # 128 KiB each, cast to bf16
    out["strided"] = torch.randn(256, 256, generator=g)  # read into a transposed view: through temporaries
    return out


def test_load_temporaries_stay_within_one_budget(tmp_path: Any, monkeypatch: Any) -> None:
    src = _state()
    uri = str(tmp_path / "ck")
    objckpt.save(src, uri, crc_block=16 * KiB)
    made = _recording(monkeypatch)
    budget = 320 * KiB  # less than the 768 KiB of cast temporaries the 256 MiB default batch holds at once
    tmpl: dict[str, torch.Tensor] = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in src.items()
                                     if k != "strided"}
    tmpl["strided"] = torch.zeros(256, 256).t()
    objckpt.load(tmpl, uri, cast=True, memory_bytes=budget)
    assert all(torch.equal(tmpl[k], src[k].to(torch.bfloat16)) for k in src if k != "strided")
    assert torch.equal(tmpl["strided"], src["strided"])
    (b,) = made
    assert b.strict and b.nbytes == budget
    assert 128 * KiB <= b.peak <= budget and b.held == 0


def test_a_piece_that_cannot_fit_names_the_budget(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.randn(512, 512)}, uri)  # 1 MiB stored as float32
    tmpl = {"w": torch.zeros(512, 512, dtype=torch.bfloat16)}
    with pytest.raises(MemoryBudgetError, match=r"memory_bytes=262144.*|'w'") as e:
        objckpt.load(tmpl, uri, cast=True, memory_bytes=256 * KiB)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, ObjckptError)
    assert "memory_bytes=262144" in str(e.value) and "'w'" in str(e.value) and "1048576" in str(e.value)
    with pytest.raises(ValueError, match="memory_bytes"):
        objckpt.load(tmpl, uri, memory_bytes=0)


def load_collective_in_budget(rank: int, world: int, uri: str, budget: int) -> dict[str, Any]:
    """Both ranks read the replicated state once per group (broadcast), rank 1 converting
    two tensors; the batch takes what every rank has left after its cast temporaries."""
    import objckpt.api as api

    made: list[OperationBudget] = []
    real = memory.load_budget

    def record(*args: Any, **kw: Any) -> OperationBudget:
        made.append(real(*args, **kw))
        return made[-1]

    api.load_budget = record  # type: ignore[assignment]
    src = {"big": torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) / 3,
           "c0": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256) / 5,
           "c1": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256) / 7}
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    tmpl = {"big": torch.zeros(512, 512), "c0": torch.zeros(256, 256, dtype=dtype),
            "c1": torch.zeros(256, 256, dtype=dtype)}
    res = objckpt.load(tmpl, uri, read_strategy="broadcast", cast=True, memory_bytes=budget)
    ok = all(torch.equal(tmpl[k], v.to(tmpl[k].dtype)) for k, v in src.items())
    return {"ok": ok, "strategy": res.strategy, "peak": made[0].peak, "held": made[0].held}


def test_collective_batch_and_cast_temporaries_share_one_budget(tmp_path: Any) -> None:
    src = {"big": torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512) / 3,
           "c0": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256) / 5,
           "c1": torch.arange(256 * 256, dtype=torch.float32).reshape(256, 256) / 7}
    uri = str(tmp_path / "ck")
    objckpt.save(src, uri)
    # rank 1's cast temporaries: 512 KiB; the group's items: 1.5 MiB, one batch under the
    # 256 MiB default (2 MiB held with the temporaries); the budget: 1.25 MiB
    budget = 1280 * KiB
    for out in run_multiprocess(2, load_collective_in_budget, uri, budget, timeout=120):
        assert out["ok"] and "broadcast" in out["strategy"], out
        assert 0 < out["peak"] <= budget and out["held"] == 0, out


def test_device_ring_takes_what_is_left_of_the_load_budget(tmp_path: Any) -> None:
    """The ring (CPU destinations: the same code as GPU ones, the copy engine aside) sizes its
    slots from what the rest of the load left of the budget, and holds them only while it runs."""
    from objckpt.load.device_stream import DeviceRead, stream_reads
    from objckpt.results import IOStats
    from objckpt.runtime import loop
    from objckpt.storage import open_store

    st, prefix = open_store(str(tmp_path / "ring"))
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    key = f"{prefix}/blob"
    loop.run(st.put(key, memoryview(data.numpy())))
    for other in (0, 120 * KiB, 150 * KiB):  # bytes the load's other parts hold meanwhile
        budget = OperationBudget(200 * KiB, "test budget")
        budget.draw(other, "another part")
        dest = torch.zeros(1 << 20, dtype=torch.uint8)
        reads = [DeviceRead("t", key, a, dest[a:b], crc32c_of(data[a:b]), "chunk")
                 for a, b in ((0, 300_000), (300_000, 700_000), (700_000, 1 << 20))]
        if other == 150 * KiB:  # 50 KiB left: less than the smallest slot (64 KiB), not a thousand tiny GETs
            with pytest.raises(MemoryBudgetError, match=r"device ring.*test budget"):
                loop.run(stream_reads(st, reads, IOStats(), slot_bytes=64 * KiB, memory=budget))
            assert budget.held == other
            continue
        loop.run(stream_reads(st, reads, IOStats(), slot_bytes=64 * KiB, memory=budget))
        assert torch.equal(dest, data)
        assert other < budget.peak <= budget.nbytes and budget.held == other, (other, budget)


def crc32c_of(t: torch.Tensor) -> int:
    from objckpt.checksum import crc32c

    return crc32c(memoryview(t.numpy()))


def load_over_budget(rank: int, world: int, uri: str) -> str:
    """Rank 1's cast temporary cannot fit; rank 0's load fits, yet both must stop alike."""
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    try:
        objckpt.load({"w": torch.zeros(512, 512, dtype=dtype)}, uri, read_strategy="broadcast", cast=True,
                     memory_bytes=768 * KiB)
    except MemoryBudgetError as e:
        return str(e)
    return "loaded"


def test_a_piece_that_cannot_fit_on_one_rank_stops_every_rank(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.randn(512, 512)}, uri)  # 1 MiB stored as float32
    errors = run_multiprocess(2, load_over_budget, uri, timeout=120)
    assert all("memory_bytes=786432" in e for e in errors), errors
