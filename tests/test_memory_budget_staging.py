"""A save's ``staging_bytes`` is a hard limit when the caller gives one.

A part that must be staged whole in host memory (a GPU or strided tensor, or any part of
an async save) and is larger than ``staging_bytes`` used to be staged anyway, past the
budget.  Now it is a :class:`MemoryBudgetError` naming the budget and the part, raised
before anything is written: no blob, no manifest, and the checkpoint already at the URI
still loads.  Without ``staging_bytes`` the defaults stay lenient (a part larger than the
default budget is staged alone, as before).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import MemoryBudgetError, ObjckptError
from objckpt.runtime import memory

KiB = 1 << 10


def _files(root: Any) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_part_larger_than_staging_bytes_is_refused_and_nothing_is_written(tmp_path: Any, how: str) -> None:
    uri = str(tmp_path / "ck")
    old = {"w": torch.randn(64, 64)}
    objckpt.save(old, uri)
    before = _files(tmp_path)
    # a strided tensor (a sync save stages it; an async save stages everything) in parts of 256 KiB
    new = {"w": torch.randn(256, 512).t()}
    with pytest.raises(MemoryBudgetError) as e:
        if how == "save":
            objckpt.save(new, uri, overwrite=True, part_size=256 * KiB, staging_bytes=100 * KiB)
        else:
            objckpt.async_save(new, uri, overwrite=True, part_size=256 * KiB, staging_bytes=100 * KiB).result(60)
    msg = str(e.value)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, ObjckptError)
    assert "staging_bytes=102400" in msg and "'w'" in msg and str(256 * KiB) in msg and uri in msg, msg
    assert "give staging_bytes of at least 262144" in msg, msg
    assert _files(tmp_path) == before  # nothing written, nothing of the old checkpoint touched
    assert torch.equal(objckpt.read(uri)["w"], old["w"])
    # what the error asks for is enough
    objckpt.save(new, uri, overwrite=True, part_size=256 * KiB, staging_bytes=256 * KiB)
    assert torch.equal(objckpt.read(uri)["w"], new["w"])


def test_parts_that_need_no_staging_are_not_held_against_the_budget(tmp_path: Any) -> None:
    """A synchronous save uploads contiguous CPU tensors from their own memory: a budget
    smaller than their parts refuses nothing."""
    uri = str(tmp_path / "ck")
    sd = {"w": torch.randn(256, 512)}  # 512 KiB, contiguous
    objckpt.save(sd, uri, part_size=256 * KiB, staging_bytes=16 * KiB)
    assert torch.equal(objckpt.read(uri)["w"], sd["w"])


def test_the_default_staging_budget_stays_lenient() -> None:
    b = memory.save_budget(None)
    assert not b.strict and b.nbytes == memory.SAVE_STAGING_BYTES
    assert "default" in b.name
    b.draw(b.nbytes + 1, "a part larger than the default")  # staged alone, as before: recorded
    assert b.peak == b.nbytes + 1
    given = memory.save_budget(4096)
    assert given.strict and given.name == "save staging budget (staging_bytes=4096)"


def save_with_staging(rank: int, world: int, uri: str) -> str:
    """Each rank saves its own tensor; rank 1's strided part cannot fit its staging budget."""
    sd = {f"r{rank}": torch.randn(256, 512).t() if rank == 1 else torch.randn(256, 512)}
    try:
        objckpt.save(sd, uri, overwrite=True, part_size=256 * KiB, staging_bytes=100 * KiB if rank == 1 else None)
    except MemoryBudgetError as e:
        return str(e)
    return "saved"


def test_one_ranks_refusal_fails_the_save_on_every_rank(tmp_path: Any) -> None:
    from mp import run_multiprocess

    uri = str(tmp_path / "ck")
    old = {"w": torch.randn(64, 64)}
    objckpt.save(old, uri)
    before = _files(tmp_path)
    for msg in run_multiprocess(2, save_with_staging, uri, timeout=120):
        assert "rank 1" in msg and "staging_bytes=102400" in msg and "'r1'" in msg, msg
    assert _files(tmp_path) == before  # rank 0's blobs are gone again, the old checkpoint untouched
    assert torch.equal(objckpt.read(uri)["w"], old["w"])


# --------------------------------------------------------------------------- one helper each


def _shape(b: memory.OperationBudget) -> tuple[int, str, bool]:
    return b.nbytes, b.name, b.strict


@pytest.mark.parametrize("given", [None, 3 << 20])
def test_one_factory_builds_every_given_or_default_budget(given: Any) -> None:
    """``given_or_default`` builds what each operation's own factory builds (names, sizes,
    strictness), so the factories can be one helper without a change in behaviour."""
    from objckpt.tier.drain import drain_budget
    from objckpt.tier.transfer import copy_budget

    assert _shape(drain_budget(given)) == _shape(
        memory.given_or_default("drain memory budget", given, memory.DRAIN_MEMORY_BYTES))
    assert _shape(copy_budget(given)) == _shape(
        memory.given_or_default("tier copy memory budget", given, memory.TIER_COPY_BYTES, strict_default=True))
    total = memory.LOAD_MEMORY_BYTES
    assert _shape(memory.load_budget(given)) == (given or total, "load memory budget " + (
        f"(memory_bytes={given})" if given else f"(default {total} bytes)"), given is not None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64"])
def test_one_check_of_a_positive_byte_count(bad: Any) -> None:
    from objckpt.options import LoadOptions
    from objckpt.tier.drain import drain_budget
    from objckpt.tier.transfer import copy_budget

    with pytest.raises(ValueError) as mine:
        memory.positive_bytes(bad, "memory_bytes")
    for build in (drain_budget, copy_budget):
        with pytest.raises(ValueError) as theirs:
            build(bad)
        assert str(theirs.value) == str(mine.value)
    with pytest.raises(ValueError) as opt:
        LoadOptions(memory_bytes=bad)
    assert str(opt.value) == str(mine.value).replace("bytes, got", "bytes or None, got")
    assert memory.positive_bytes(None, "memory_bytes", optional=True) is None
    assert memory.positive_bytes(7, "memory_bytes") == 7
