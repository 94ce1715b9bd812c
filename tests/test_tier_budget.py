"""The tier's copies hold their buffers inside a memory budget (objckpt.runtime.memory).

Replication and repair (objckpt.tier.transfer) and the drain (objckpt.tier.drain) take
their buffers from the process-wide HostPool and draw them from one OperationBudget: a
small budget still completes, in smaller pieces, with the pool's peak within it; a
budget below one minimal piece is a MemoryBudgetError naming it, before a byte moves.
Real gloo ranks (tests/mp.py), temporary directories standing for nodes, real moto S3.
"""
from __future__ import annotations

import os
import pathlib
import random
from typing import Any

import pytest

import mp
from objckpt.runtime.memory import TIER_MIN_PIECE_BYTES
from objckpt.tier.topology import NODE_ENV

MiB = 1 << 20


def _data(rank: int) -> bytes:
    return random.Random(rank).randbytes(5 * MiB + 3 + rank)  # several pieces, unaligned


def _copy_in_budget(rank: int, world: int, base: str) -> dict[str, Any]:
    from objckpt.distributed.comm import get_comm
    from objckpt.errors import MemoryBudgetError
    from objckpt.runtime.memory import host_pool
    from objckpt.tier.peers import repair, replicate
    from objckpt.tier.topology import Topology

    os.environ[NODE_ENV] = f"node{rank}"
    comm = get_comm()
    topo = Topology.build(comm)
    root = pathlib.Path(base)
    step = root / f"node{rank}" / "step-3"
    step.mkdir(parents=True)
    (step / f"share-{rank}.bin").write_bytes(_data(rank))
    out: dict[str, Any] = {}
    too_small = 4 * TIER_MIN_PIECE_BYTES - 1  # k=1: one partner each way, two buffers each
    try:
        replicate(comm, topo, step, [f"share-{rank}.bin"], 1, memory_bytes=too_small)
        out["refused"] = "no error"
    except MemoryBudgetError as e:
        out["refused"] = str(e)
    comm.barrier()
    out["after refusal"] = sorted(p.name for p in step.iterdir())
    comm.barrier()
    budget = 6 * MiB
    pool = host_pool()
    pool.reset_peak()
    rep = replicate(comm, topo, step, [f"share-{rank}.bin"], 1, memory_bytes=budget)
    out["pool peak"] = pool.peak
    out["buffers"] = rep.ranks[rank].buffer_bytes
    out["copied"] = (root / f"node{1 - rank}" / "step-3" / f"share-{rank}.bin").read_bytes() == _data(rank)
    comm.barrier()
    if rank == 1:
        (step / "share-1.bin").unlink()  # node1 lost its own share; node0 holds the replica
    comm.barrier()
    pool.reset_peak()
    fixed = repair(comm, topo, step, [f"share-{r}.bin" for r in range(world)], memory_bytes=budget)
    out["repair pool peak"] = pool.peak
    out["repaired"] = fixed.complete and (step / "share-1.bin").read_bytes() == _data(1)
    return out


def test_peer_copies_stay_within_the_memory_budget_and_refuse_one_too_small(tmp_path: pathlib.Path) -> None:
    res = mp.run_multiprocess(2, _copy_in_budget, str(tmp_path), timeout=120)
    for rank, out in enumerate(res):
        assert "tier copy memory budget (memory_bytes=4194303)" in out["refused"], out["refused"]
        assert f"rank {rank}" in out["refused"] and "TIER_MIN_PIECE_BYTES" in out["refused"]
        assert out["after refusal"] == [f"share-{rank}.bin"], "a refused copy wrote nothing"
        # four buffers (send and receive, two each) of the piece the budget allows: 6 MiB // 4
        assert out["buffers"] == 4 * (6 * MiB // 4), out
        assert 0 < out["pool peak"] <= 6 * MiB, out
        assert out["repair pool peak"] <= 6 * MiB, out
        assert out["copied"] and out["repaired"]


def test_a_drain_uploads_within_its_budget_and_refuses_one_below_the_smallest_part(
        tmp_path: pathlib.Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    import boto3

    from conftest import s3_options
    from objckpt.errors import MemoryBudgetError
    from objckpt.runtime.memory import host_pool
    from objckpt.storage import open_store
    from objckpt.tier import drain

    bucket, opts = moto_s3
    data = os.urandom((11 << 20) + 3)  # larger than the budget: parts of the budget's size
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    store, prefix = open_store(f"s3://{bucket}/run/step", opts)
    pool = host_pool()
    pool.reset_peak()
    budget = drain.drain_budget(6 * MiB)
    assert drain.upload_file(src, store, prefix + "/blobs/a/r00000-0000.bin", drain.Throttle(None), budget) == len(data)
    assert 5 * MiB <= pool.peak <= 6 * MiB and budget.peak <= 6 * MiB and budget.held == 0
    got = boto3.client("s3", **s3_options(opts["endpoint_url"])).get_object(
        Bucket=bucket, Key="run/step/blobs/a/r00000-0000.bin")
    assert got["Body"].read() == data
    with pytest.raises(MemoryBudgetError, match=r"drain memory budget \(memory_bytes=4194304\)"):
        drain.upload_file(src, store, prefix + "/blobs/a/r00000-0001.bin", drain.Throttle(None),
                          drain.drain_budget(4 * MiB))
