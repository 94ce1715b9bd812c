"""The transport seam of tier copies (objckpt/tier/wire.py): gloo from host buffers, or
pieces staged through device buffers (NCCL on GPUs; its CPU mirror over gloo here)."""
from __future__ import annotations

import os
import pathlib
import random
import shutil
from typing import Any

import pytest
import torch

import mp
from objckpt.tier.errors import TierSettingsError
from objckpt.tier.topology import NODE_ENV
from objckpt.tier.wire import resolve_backend

PIECE = 64 << 10


def _content(rank: int, i: int, size: int) -> bytes:
    return random.Random(rank * 1000 + i).randbytes(size)


def _files(rank: int) -> dict[str, bytes]:
    sizes = [0, 1000 + rank, 3 * PIECE + 7 * rank + 1]  # empty, small, several pieces (unaligned)
    return {f"blobs/att/r{rank:05d}-{i:04d}.bin": _content(rank, i, s) for i, s in enumerate(sizes)}


def test_auto_is_nccl_only_for_an_nccl_group_with_cuda_and_explicit_nccl_needs_cuda() -> None:
    assert resolve_backend("auto", "nccl", cuda=True) == "nccl"
    assert resolve_backend("auto", "cpu:gloo,cuda:nccl", cuda=True) == "nccl"
    assert resolve_backend("auto", "nccl", cuda=False) == "gloo"
    assert resolve_backend("auto", "gloo", cuda=True) == "gloo"
    assert resolve_backend("auto", "", cuda=False) == "gloo"
    assert resolve_backend("gloo", "nccl", cuda=True) == "gloo"
    assert resolve_backend("nccl", "gloo", cuda=True) == "nccl"
    with pytest.raises(TierSettingsError, match="tier_backend='nccl' needs CUDA"):
        resolve_backend("nccl", "gloo", cuda=False)
    with pytest.raises(TierSettingsError, match="tier_backend must be one of"):
        resolve_backend("mpi", "gloo", cuda=False)


def _replicate_and_fetch(rank: int, world: int, base: str, backend: str, device: str) -> dict[str, Any]:
    """Replicate each rank's files to the other node, lose rank 0's folder, get its files
    back into memory (and a range of rank 1's file straight into a caller's tensor): all
    through the wire ``tier_wire(comm, backend, device)`` registers."""
    from objckpt.distributed.comm import get_comm
    from objckpt.tier import wire as wire_mod
    from objckpt.tier.peers import Range, fetch, replicate
    from objckpt.tier.topology import Topology, tier_wire

    os.environ[NODE_ENV] = f"node{rank}"
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "60"
    comm = get_comm()
    topo = Topology.build(comm)
    wire = tier_wire(comm, backend, device)
    posts = []
    real_post = wire_mod._DeviceLink.post

    def counted(self: Any, slot: int, sends: Any, recvs: Any) -> Any:
        posts.append((len(sends), len(recvs)))
        return real_post(self, slot, sends, recvs)

    wire_mod._DeviceLink.post = counted  # type: ignore[method-assign]
    root = pathlib.Path(base)
    step = root / f"node{rank}" / "step-7"
    mine = _files(rank)
    for rel, data in mine.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    comm.barrier()
    out: dict[str, Any] = {"wire": type(wire_for_default(comm)).__name__, "stages": wire.stages}
    rep = replicate(comm, topo, step, list(mine), 1, piece_bytes=PIECE)
    out["sent"] = rep.bytes_sent
    other = root / f"node{1 - rank}" / "step-7"
    out["copied"] = all((other / rel).read_bytes() == data for rel, data in mine.items())
    out["replicate_posts"] = len(posts)
    comm.barrier()
    if rank == 0:
        shutil.rmtree(root / "node0")  # node0 is replaced: its folder is gone
    comm.barrier()
    theirs = next(rel for rel in _files(1) if rel.endswith("-0002.bin"))
    want = (list(mine), [Range(theirs, 5, 2 * PIECE + 3, torch.zeros(2 * PIECE + 3, dtype=torch.uint8))]) \
        if rank == 0 else ([], [])
    got = fetch(comm, topo, step, want[0], ranges=want[1], piece_bytes=PIECE)
    whole = {rel: b"".join(bytes(t.numpy()) for _o, t in sorted(segs, key=lambda s: s[0]))
             for rel, segs in got.segments.items() if rel in mine}
    out["fetched"] = rank == 1 or all(whole.get(rel, b"" if not data else None) == data for rel, data in mine.items())
    out["range"] = rank == 1 or bytes(want[1][0].dest.numpy()) == _files(1)[theirs][5: 5 + 2 * PIECE + 3]
    out["posts"] = len(posts)
    return out


def wire_for_default(comm: Any) -> Any:
    from objckpt.tier.topology import tier_comm
    from objckpt.tier.wire import wire_for

    return wire_for(comm.group, tier_comm(comm).group)


def _check(res: list[dict[str, Any]]) -> None:
    for r, out in enumerate(res):
        assert out["wire"] == "DeviceWire" and out["stages"], out
        assert out["copied"] and out["fetched"] and out["range"], (r, out)
        assert out["sent"] == sum(len(d) for rk in (0, 1) for d in _files(rk).values())
        # five rounds for replicate (the small file, then 3 pieces + the tail), then the fetch's: all staged
        assert out["replicate_posts"] == 5 and out["posts"] > out["replicate_posts"], out


def test_staged_wire_replicates_and_restores_bit_identically_cpu_mirror(tmp_path: pathlib.Path) -> None:
    """The NCCL wire's staging (host piece -> device bounce buffer -> wire -> device bounce
    buffer -> host) with CPU "device" buffers over a gloo group of its own."""
    _check(mp.run_multiprocess(2, _replicate_and_fetch, str(tmp_path), "gloo", "cpu", timeout=120))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs CUDA with at least 2 devices (NCCL ranks need one device each)")
def test_nccl_wire_replicates_and_restores_bit_identically(tmp_path: pathlib.Path) -> None:
    _check(mp.run_multiprocess(2, _replicate_and_fetch, str(tmp_path), "nccl", None, timeout=120, backend="nccl"))


def _manager_backends(rank: int, world: int, base: str) -> dict[str, Any]:
    import objckpt

    torch.cuda.is_available = lambda: False  # a machine without CUDA, on any machine (this rank's process)
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "60"
    out: dict[str, Any] = {}
    kw: dict[str, Any] = dict(local_dir=str(pathlib.Path(base) / "{node}"), replicas=1, persist_every=None,
                              node_override=f"n{rank}")
    try:
        objckpt.CheckpointManager(str(pathlib.Path(base) / "root"), tier_backend="nccl", **kw)
    except TierSettingsError as e:
        out["nccl"] = str(e)
    out["after_refusal"] = sorted(p.name for p in pathlib.Path(base).glob("n*/*"))
    with objckpt.CheckpointManager(str(pathlib.Path(base) / "root"), **kw) as m:
        tiers: Any = m._tiers
        out["auto"] = (tiers.wire.backend, type(tiers.wire).__name__)
        m.save(1, {"x": torch.arange(10)})
        m.wait()
    steps = [pathlib.Path(base) / f"n{r}" / "step-0000000001" for r in (0, 1)]
    out["replica"] = [sorted(p.relative_to(s).as_posix() for p in s.rglob("*") if p.is_file()) for s in steps]
    return out


def test_manager_auto_is_gloo_on_a_gloo_group_and_nccl_without_cuda_is_refused_first(
        tmp_path: pathlib.Path) -> None:
    for out in mp.run_multiprocess(2, _manager_backends, str(tmp_path), timeout=120):
        assert "tier_backend='nccl' needs CUDA" in out["nccl"], out
        assert out["after_refusal"] == [], "nothing written or sent before the refusal"
        assert out["auto"] == ("gloo", "HostWire"), out
        assert out["replica"][0] and out["replica"][0] == out["replica"][1], "rank 0's blob replicated to n1"


def test_an_unknown_tier_backend_is_a_settings_error(tmp_path: pathlib.Path) -> None:
    import objckpt

    with pytest.raises(TierSettingsError, match="tier_backend must be one of"):
        objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), tier_backend="tcp",
                                  no_dist=True)


def _die_while_staging(rank: int, world: int, base: str) -> dict[str, Any]:
    import test_tier_peers as tp
    from objckpt.distributed.comm import get_comm
    from objckpt.tier.topology import tier_wire

    tier_wire(get_comm(), "gloo", "cpu")
    return tp._die_while_replicating(rank, world, base)


def test_a_rank_killed_mid_copy_through_the_staged_wire_is_a_collective_error_and_no_partial_file(
        tmp_path: pathlib.Path) -> None:
    import signal

    import test_tier_peers as tp

    results, exitcodes = mp.run_allowing_death(2, _die_while_staging, str(tmp_path), timeout=90)
    assert exitcodes[1] == -signal.SIGKILL
    out = results[0]
    assert out["error"].startswith("objckpt.errors.CollectiveError: replicate: rank 0 of 2: moving pieces "
                                   "to/from rank 1 over gloo (staged through device buffers) failed"), out
    assert out["files"] == ["r00000.bin"], "rank 1's file is not under its final name, nor left as a temp"


def _mixed_wires(rank: int, world: int) -> str:
    from objckpt.distributed.comm import get_comm
    from objckpt.tier.topology import tier_wire

    try:
        tier_wire(get_comm(), "gloo", "cpu" if rank == 1 else None)
    except TierSettingsError as e:
        return str(e)
    return "no error"


def test_ranks_that_chose_different_wires_are_refused_on_every_rank() -> None:
    for out in mp.run_multiprocess(2, _mixed_wires, timeout=60):
        assert "the ranks chose different transports" in out and "rank 1: gloo on cpu" in out, out


def _device_full_on_rank1(rank: int, world: int, base: str) -> dict[str, Any]:
    from objckpt.distributed.comm import get_comm
    from objckpt.tier import wire as wire_mod
    from objckpt.tier.peers import PeerCopyError, replicate
    from objckpt.tier.topology import Topology, tier_wire

    os.environ[NODE_ENV] = f"node{rank}"
    comm = get_comm()
    topo = Topology.build(comm)
    tier_wire(comm, "gloo", "cpu")
    if rank == 1:
        def full(*a: Any, **kw: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

        wire_mod._DeviceLink.__init__ = full  # type: ignore[method-assign]
    step = pathlib.Path(base) / f"node{rank}" / "step-1"
    mine = _files(rank)
    for rel, data in mine.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    try:
        replicate(comm, topo, step, list(mine), 1, piece_bytes=PIECE)
        err = "no error"
    except PeerCopyError as e:
        err = f"{e} {sorted(e.failures)}"
    return {"error": err, "files": sorted(p.name for p in step.rglob("*") if p.is_file())}


def test_device_buffers_that_cannot_be_had_on_one_rank_fail_every_rank_before_a_piece_moves(
        tmp_path: pathlib.Path) -> None:
    for rank, out in enumerate(mp.run_multiprocess(2, _device_full_on_rank1, str(tmp_path), timeout=60)):
        assert out["error"].startswith("replicate failed before a piece moved: rank 1: the gloo wire's buffers: "
                                       "OutOfMemoryError: CUDA out of memory"), out
        assert out["error"].endswith("[1]"), out
        assert out["files"] == sorted(pathlib.Path(r).name for r in _files(rank)), "only this rank's own files"
