"""Multi-rank defects: plain tensors that differ between ranks, a save or load
called by one rank alone (no_dist, collective_timeout), and refusals that keep
their class on every rank.  Real gloo process groups (tests/mp.py), real files."""
from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import CollectiveLoadError, StateDictMismatchError, UnsupportedValueError

from mp import run_multiprocess

# --------------------------------------------------------------------------- plain tensors differing per rank


def save_per_rank_plain(rank: int, world: int, root: str) -> dict[str, str]:
    """Each rank's rng state (small) and a 8 MiB tensor holding the rank number (sampled)."""
    torch.manual_seed(rank)
    same = torch.arange(1000, dtype=torch.float32)
    out: dict[str, str] = {}
    for name, state in (("rng", {"rng": torch.get_rng_state(), "same": same}),
                        ("big", {"same": same, "ranked": torch.full((2048, 1024), float(rank))})):
        try:
            objckpt.save(state, f"{root}/{name}")
            out[name] = "saved"
        except UnsupportedValueError as e:
            out[name] = str(e)
    # the suggested per-rank wrapper: one row per rank, each rank gets its own back
    rng = torch.get_rng_state()
    objckpt.save({"rng": objckpt.Shard(rng.unsqueeze(0), (world, rng.numel()), (rank, 0))}, f"{root}/shard")
    back = objckpt.Shard(torch.zeros_like(rng).unsqueeze(0), (world, rng.numel()), (rank, 0))
    objckpt.load({"rng": back}, f"{root}/shard")
    out["shard_roundtrip"] = str(torch.equal(back.local[0], rng))
    return out


def test_plain_tensors_differing_between_ranks_are_refused_not_merged(tmp_path: Any) -> None:
    root = str(tmp_path)
    for out in run_multiprocess(2, save_per_rank_plain, root):
        assert "'rng'" in out["rng"] and "different values on different ranks" in out["rng"], out
        assert "objckpt.Shard" in out["rng"] and "no_dist=True" in out["rng"], out
        assert "'ranked'" in out["big"] and "'same'" not in out["big"], out
        assert out["shard_roundtrip"] == "True"
    for name in ("rng", "big"):  # refused on every rank: nothing committed
        with pytest.raises(objckpt.NotFoundError):
            objckpt.inspect(f"{root}/{name}")


def test_fingerprints_see_small_and_sampled_differences() -> None:
    from objckpt.save.fingerprint import SAMPLES, WINDOW, differing, fingerprint

    a = torch.zeros(4 << 20, dtype=torch.uint8)
    b = a.clone()
    b[-1] = 1  # the last window is sampled
    c = a.clone()
    c[3 * ((4 << 20) - WINDOW) // (SAMPLES - 1) + 10] = 1  # inside the 4th strided window
    assert fingerprint(a) == fingerprint(a.clone()) and fingerprint(a) != fingerprint(b)
    assert fingerprint(a) != fingerprint(c)
    assert fingerprint(torch.tensor([1.0])) != fingerprint(torch.tensor([2.0]))
    assert fingerprint(torch.zeros(4, 4).t()) == fingerprint(torch.zeros(4, 4))  # non-contiguous: same bytes
    assert differing([{"x": 1, "y": 2}, {"x": 1, "y": 3}, {"x": 1}]) == ["y"]


# --------------------------------------------------------------------------- one rank alone


def one_rank_alone(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from objckpt import RanksDidNotJoinError

    out: dict[str, Any] = {}
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 7}
    if rank == 0:
        objckpt.save(state, f"{root}/solo", no_dist=True)
        objckpt.async_save(state, f"{root}/solo-async", no_dist=True).result(timeout=60)
        tmpl = {"w": torch.zeros(64), "step": 0}
        objckpt.load(tmpl, f"{root}/solo", no_dist=True)
        out["loaded"] = torch.equal(tmpl["w"], state["w"]) and tmpl["step"] == 7
        t0 = time.monotonic()
        try:
            objckpt.save(state, f"{root}/forgot", collective_timeout=2)
            out["save_error"] = "no error"
        except RanksDidNotJoinError as e:
            out["save_error"] = str(e)
        out["save_seconds"] = time.monotonic() - t0
        try:
            objckpt.async_save(state, f"{root}/forgot-async", collective_timeout=1).result(timeout=60)
            out["async_error"] = "no error"
        except RanksDidNotJoinError as e:
            out["async_error"] = str(e)
        os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "2"
        t0 = time.monotonic()
        try:
            objckpt.load(tmpl, f"{root}/solo")
            out["load_error"] = "no error"
        except RanksDidNotJoinError as e:
            out["load_error"] = str(e)
        out["load_seconds"] = time.monotonic() - t0
        del os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"]
    else:
        out["read"] = None
    dist.barrier()  # rank 1 waited here; rank 0's own saves, loads and failures are over
    if rank == 1:
        out["read"] = objckpt.read(f"{root}/solo", no_dist=True)["step"]
    # the cancelled operations left the group in step: a collective save and load work as before
    objckpt.save({"w": torch.arange(64, dtype=torch.float32)}, f"{root}/together", collective_timeout=60)
    tmpl2 = {"w": torch.zeros(64)}
    objckpt.load(tmpl2, f"{root}/together")
    out["together"] = torch.equal(tmpl2["w"], torch.arange(64, dtype=torch.float32))
    return out


def test_one_rank_alone_no_dist_and_timeout(tmp_path: Any) -> None:
    root = str(tmp_path)
    r0, r1 = run_multiprocess(2, one_rank_alone, root, timeout=float(os.environ.get("MP_TIMEOUT", "240")))
    assert r0["loaded"] and r0["together"] and r1["together"] and r1["read"] == 7
    assert "async save" in r0["async_error"] and "no_dist=True" in r0["async_error"], r0
    for what in ("save", "load"):
        msg = r0[f"{what}_error"]
        assert "not every rank of the process group called it" in msg and "no_dist=True" in msg, msg
        assert 1.5 < r0[f"{what}_seconds"] < 60  # a generous bound: it fails, it does not hang
    for name in ("solo", "solo-async"):  # loadable by a fresh process
        assert objckpt.read(f"{root}/{name}")["step"] == 7
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(f"{root}/forgot")


def test_join_unit() -> None:
    from objckpt.distributed.comm import LocalComm
    from objckpt.distributed.join import collective_timeout, join

    join(LocalComm(), "save", None)  # no group: nothing to wait for
    assert collective_timeout(3) == 3.0
    with pytest.raises(ValueError, match="collective_timeout"):
        collective_timeout(0)
    with pytest.raises(ValueError, match="collective_timeout"):
        objckpt.save({"x": torch.zeros(1)}, "memory://x", collective_timeout=-1)


# --------------------------------------------------------------------------- refusals keep their class


class _Snapshot:
    """A Stateful object whose state_dict() can fail (on one rank only, in the test)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("snapshot refused here")
        return {"epoch": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def refuse_on_rank_1(rank: int, world: int, root: str) -> dict[str, str]:
    out: dict[str, str] = {}
    state: dict[str, Any] = {"w": torch.zeros(8)}
    if rank == 1:
        state["bad"] = object()  # not storable without pickle
    try:
        objckpt.save(state, f"{root}/refused")
        out["save"] = "no error"
    except UnsupportedValueError as e:
        out["save"] = f"{type(e).__name__}: {e}"
    # async, and a Stateful object whose state_dict() fails on rank 1 only
    stateful: dict[str, Any] = {"w": torch.zeros(8), "sched": _Snapshot(fail=rank == 1)}
    try:
        objckpt.async_save(stateful, f"{root}/refused-async").result()
        out["async"] = "no error"
    except UnsupportedValueError as e:
        out["async"] = f"{type(e).__name__}: {e}"
    objckpt.save({"w": torch.zeros(8)}, f"{root}/good")
    tmpl = {"w": torch.zeros(9 if rank == 1 else 8)}
    try:
        objckpt.load(tmpl, f"{root}/good")
        out["load"] = "no error"
    except StateDictMismatchError as e:
        out["load"] = f"{type(e).__name__}: {e}"
    return out


def test_refusals_keep_their_class_on_every_rank(tmp_path: Any) -> None:
    r0, r1 = run_multiprocess(2, refuse_on_rank_1, str(tmp_path))
    for out in (r0, r1):
        assert out["save"].startswith("UnsupportedValueError") and "rank 1" in out["save"], out
        assert out["async"].startswith("UnsupportedValueError") and "'sched'" in out["async"], out
        assert "snapshot refused here" in out["async"] and "rank 1" in out["async"], out
        assert out["load"].startswith("StateDictMismatchError") and "'w'" in out["load"], out
    assert "rank(s) [1]" in r0["load"], r0


def test_refusal_class_unit() -> None:
    from objckpt.distributed.comm import RemoteError, refusal_class

    e = refusal_class("UnsupportedValueError", RemoteError)("UnsupportedValueError", "no")
    assert isinstance(e, UnsupportedValueError) and isinstance(e, RemoteError) and isinstance(e, TypeError)
    e2 = refusal_class("StateDictMismatchError", CollectiveLoadError)("m", {1: "x"})
    assert isinstance(e2, StateDictMismatchError) and e2.failures == {1: "x"}
    assert refusal_class("KeyError", RemoteError) is RemoteError  # only objckpt's own classes
    e3 = refusal_class("CollectiveLoadError", RemoteError)("CollectiveLoadError", "m")  # more than a message
    assert isinstance(e3, CollectiveLoadError) and isinstance(e3, RemoteError) and e3.failures == {}
    assert refusal_class("UnsupportedValueError", RemoteError) is type(e)  # made once


def test_join_generations_with_a_real_store(monkeypatch: Any) -> None:
    """Two 'ranks' as threads over one real c10d HashStore: a lone rank's operation is
    cancelled, and the next operation of both ranks (a new generation) pairs them up."""
    import threading

    import torch.distributed as dist

    from objckpt.distributed import join as join_mod
    from objckpt.distributed.comm import TorchComm

    store = dist.HashStore()
    monkeypatch.setattr(join_mod, "_default_store", lambda: store)
    monkeypatch.setattr(join_mod, "_seq", {})

    class FakeGroup(TorchComm):  # a 2-rank group's identity, without a process group
        def __init__(self, rank: int) -> None:
            self.rank, self.world_size, self.group = rank, 2, None

    def attempt(rank: int, timeout: float, out: dict[int, str]) -> None:
        try:
            join_mod.join(FakeGroup(rank), "save", timeout)
            out[rank] = "joined"
        except objckpt.RanksDidNotJoinError:
            out[rank] = "refused"

    out: dict[int, str] = {}
    attempt(0, 0.2, out)  # rank 0 alone: cancelled
    assert out == {0: "refused"}
    # both sequence counters stay at 0 (one process stands for both ranks here)
    threads = [threading.Thread(target=attempt, args=(r, 10, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: "joined", 1: "joined"}
