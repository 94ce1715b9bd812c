"""A hard memory budget too small for the smallest collective batch is refused, on every rank.

A collective load cuts its batches from what every rank has left of its ``memory_bytes``.
Below a floor (the smallest batch the collective moves: ``MIN_SLOT_BYTES``, or one row of
its widest tensor when that is larger) the load used to crawl through 1-byte (or tiny)
batches; now every rank raises :class:`MemoryBudgetError` naming the budget and the piece,
before a byte of tensor data is read or exchanged (real gloo ranks, real files).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import objckpt
from objckpt.errors import MemoryBudgetError
from objckpt.runtime.memory import MIN_SLOT_BYTES

from mp import run_multiprocess

KiB = 1 << 10


def load_with_budgets(rank: int, world: int, uri: str, shape: tuple[int, ...],
                      budgets: list[Optional[int]], strategy: str) -> dict[str, Any]:
    """Load ``w`` (replicated: one replica group of every rank) under this rank's budget;
    report the error (or "loaded"), the data requests made and whether the template was touched."""
    from objckpt.storage import open_store
    from objckpt.testing.stores import CountingStore

    st, _ = open_store(uri)
    counting = CountingStore(st)
    tmpl = {"w": torch.zeros(shape)}
    try:
        objckpt.load(tmpl, uri, store=counting, read_strategy=strategy,
                     memory_bytes=budgets[rank])
        outcome = "loaded"
    except MemoryBudgetError as e:
        outcome = str(e)
    return {"outcome": outcome, "data_reads": counting.ops["get_range"],
            "untouched": bool((tmpl["w"] == 0).all())}


def _saved(tmp_path: Any, shape: tuple[int, ...]) -> str:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.randn(shape) + 1}, uri)  # no zero: an untouched template stays all zeros
    return uri


def test_a_budget_below_the_smallest_batch_is_refused_on_every_rank(tmp_path: Any) -> None:
    shape = (256, 256)  # 256 KiB, rows of 1 KiB: the old code moved it in 1-row (or 1-byte cap) batches
    uri = _saved(tmp_path, shape)
    # rank 0 gives a budget whose batches would be 28 KiB (< 64 KiB); rank 1 gives none at all
    budgets = [128 * KiB, None]
    outs = run_multiprocess(2, load_with_budgets, uri, shape, budgets, "broadcast", timeout=120)
    for rank, out in enumerate(outs):
        msg = out["outcome"]
        assert msg != "loaded", (rank, out)
        # the tightest budget (rank 0's), the floor, and what would do
        assert "memory_bytes=131072" in msg and "rank 0" in msg, msg
        assert str(MIN_SLOT_BYTES) in msg and "give memory_bytes of at least" in msg, msg
        assert out["data_reads"] == 0 and out["untouched"] and "partially overwritten" not in msg, (rank, out)


def test_a_row_wider_than_the_budgets_batch_is_refused_naming_it(tmp_path: Any) -> None:
    shape = (4, 64 * KiB)  # rows of 256 KiB: the smallest piece a collective can move
    uri = _saved(tmp_path, shape)
    budgets = [512 * KiB, 512 * KiB]  # batches of 199 KiB: not one row
    outs = run_multiprocess(2, load_with_budgets, uri, shape, budgets, "allgather", timeout=120)
    for out in outs:
        msg = out["outcome"]
        assert "memory_bytes=524288" in msg and "one row of 'w'" in msg and str(256 * KiB) in msg, out
        assert out["data_reads"] == 0 and out["untouched"], out
    # what the error asks for is enough: the same load then runs, collectively, on both ranks
    need = int(outs[0]["outcome"].split("give memory_bytes of at least ")[1].split()[0])
    for out in run_multiprocess(2, load_with_budgets, uri, shape, [need, need], "allgather", timeout=120):
        assert out["outcome"] == "loaded" and not out["untouched"], out


def test_a_budget_above_the_floor_still_loads_collectively(tmp_path: Any) -> None:
    shape = (256, 256)
    uri = _saved(tmp_path, shape)
    # 4/9 of (224 KiB - 64 KiB) is 71 KiB a batch: above the floor, the load runs in small batches
    outs = run_multiprocess(2, load_with_budgets, uri, shape, [224 * KiB, 224 * KiB], "broadcast", timeout=120)
    for out in outs:
        assert out["outcome"] == "loaded" and not out["untouched"], out
