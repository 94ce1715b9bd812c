"""CheckpointManager with a local tier: local commit, replication, draining, restore across tiers.

Temporary directories stand for nodes (``local_dir`` with ``{node}``, ``node_override``);
moto stands for object storage; ranks are real gloo processes."""
from __future__ import annotations

import math
import os
import shutil
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from mp import run_multiprocess
from objckpt.format import manifest as _manifest
from objckpt.tier import step_files
from objckpt.tier.errors import DrainError, LocalTierError, TierSettingsError

from tier_state import state as _state
from tier_state import zeros as _zeros


def _check(st: dict[str, Any], rank: int, world: int, step: int) -> None:
    want = _state(rank, world, step)
    assert torch.equal(st["w"].local, want["w"].local), f"rank {rank}: w differs from step {step}"
    assert torch.equal(st["b"], want["b"]) and st["step"] == step



def _on_a_full_disk(fn: Any) -> Any:
    """``fn`` run as on a full disk: this process may write no file past one byte while it
    runs (RLIMIT_FSIZE; a write past it fails with EFBIG, SIGXFSZ ignored).  Call it on the
    main thread (signal handlers are set there); ``fn`` may then run on any thread."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def full(*a: Any, **k: Any) -> Any:
        before = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, before[1]))
        try:
            return fn(*a, **k)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, before)

    return full

def _manager(rank: int, root: str, local: str, opts: dict[str, Any], **kw: Any) -> objckpt.CheckpointManager:
    """A tiered manager; ``kw``: TierSettings fields and manager keywords alike."""
    tier: dict[str, Any] = dict(local_dir=local, replicas=1, persist_every=2, local_keep=2)
    args: dict[str, Any] = dict(node_override=f"n{rank}", storage_options=opts)
    for k, v in kw.items():
        (tier if k in objckpt.TierSettings.__dataclass_fields__ else args)[k] = v
    return objckpt.CheckpointManager(root, tier=objckpt.TierSettings(**tier), **args)


def _save_steps(rank: int, world: int, root: str, local: str, opts: dict[str, Any], steps: list[int],
                async_save: bool = False) -> Any:
    with _manager(rank, root, local, opts, async_save=async_save) as m:
        for s in steps:
            m.save(s, _state(rank, world, s))
        m.wait()
        return m.steps()


def _restore(rank: int, world: int, root: str, local: str, opts: dict[str, Any], node: str = "") -> Any:
    kw = {"node_override": node, "replicas": 0} if node else {}
    with _manager(rank, root, local, opts, **kw) as m:
        st = _zeros(rank, world)
        res = m.load(st)
        _check(st, rank, world, res.step)
        return res.step, res.source, res.tiers


def test_save_commits_locally_replicates_drains_every_second_step_and_restores_from_a_peer(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    # async: save() returns once staged; the local commit, replication and drains follow in the background
    assert run_multiprocess(2, _save_steps, root, local, opts, [1, 2, 3, 4], True) == [[2, 4], [2, 4]]
    for node in ("n0", "n1"):  # local_keep=2 per node; each folder is a whole checkpoint (its own + the peer's copy)
        d = tmp_path / node / "ckpt"
        assert sorted(os.listdir(d)) == ["step-0000000003", "step-0000000004"]
        back = objckpt.read(str(d / "step-0000000004"))
        assert torch.equal(back["w"], _state(0, 1, 4)["w"].local) and back["step"] == 4
    drained = objckpt.read(f"{root}/step-0000000004", storage_options=opts)
    assert torch.equal(drained["w"], _state(0, 1, 4)["w"].local)
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(f"{root}/step-0000000003", storage_options=opts)  # not drained: local only

    shutil.rmtree(tmp_path / "n1")  # node n1 replaced: its share comes from n0's replica
    got = run_multiprocess(2, _restore, root, local, opts)
    assert got[0] == (4, "local", {0: "local", 1: "peer"})
    assert got[1] == (4, "peer", {0: "local", 1: "peer"})


def test_every_local_dir_lost_restores_the_newest_drained_step_from_object_storage(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    run_multiprocess(2, _save_steps, root, local, opts, [1, 2, 3])  # 2 drained, 3 local only
    shutil.rmtree(tmp_path / "n0")
    shutil.rmtree(tmp_path / "n1")
    got = run_multiprocess(2, _restore, root, local, opts)
    assert [g[:2] for g in got] == [(2, "object"), (2, "object")]


def test_a_local_checkpoint_reshards_on_restore_world_2_to_3(tmp_path: Path) -> None:
    root, local = str(tmp_path / "store"), str(tmp_path / "node" / "ckpt")

    run_multiprocess(2, _save_one_node, root, local, [5])
    got = run_multiprocess(3, _restore, root, local, {}, "same")
    assert [g[:2] for g in got] == [(5, "local")] * 3


def _save_one_node(rank: int, world: int, root: str, local: str, steps: list[int]) -> None:
    with _manager(rank, root, local, {}, replicas=0, persist_every=None, node_override="same") as m:
        for s in steps:
            m.save(s, _state(rank, world, s))


# -- a rank killed while draining -------------------------------------------------------------------

def _kill_mid_drain(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> str:
    from objckpt.tier import drain as drain_mod

    with _manager(rank, root, local, opts, persist_every=1) as m:
        m.save(2, _state(rank, world, 2))
        m.wait()  # step 2 drained whole
        if rank == 1:
            real = drain_mod.upload_file

            def upload_then_die(*a: Any, **k: Any) -> int:
                n = real(*a, **k)
                os.kill(os.getpid(), signal.SIGKILL)  # one blob up, then the rank dies
                return n

            drain_mod.upload_file = upload_then_die  # type: ignore[assignment]
        try:
            m.save(4, _state(rank, world, 4))
            m.wait()
        except objckpt.ObjckptError as e:  # rank 0: its peer died mid-drain; it must not commit
            return f"{type(e).__name__}: {e}"
    return "drained"


def test_a_rank_killed_while_draining_leaves_the_object_copy_absent_never_partial(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] died"):
        run_multiprocess(2, _kill_mid_drain, root, local, opts, timeout=60)
    import boto3

    from conftest import s3_options

    listed = boto3.client("s3", **s3_options(opts["endpoint_url"])).list_objects_v2(
        Bucket=bucket, Prefix="run/step-0000000004/")
    assert listed.get("KeyCount", 0) >= 1  # the drain had started: blobs went up ...
    with pytest.raises(objckpt.NotFoundError):  # ... but no manifest: the step does not exist there
        objckpt.inspect(f"{root}/step-0000000004", storage_options=opts)
    st = _zeros(0, 1)
    objckpt.load(st, f"{root}/step-0000000002", storage_options=opts)  # the previous drain is whole
    _check(st, 0, 1, 2)
    # the job restarts: step 4 was due, is whole in the local tier, and is drained now
    assert run_multiprocess(2, _restart_and_wait, root, local, opts) == [[2, 4]] * 2
    st = _zeros(0, 1)
    objckpt.load(st, f"{root}/step-0000000004", storage_options=opts)
    _check(st, 0, 1, 4)
    assert not (tmp_path / "n0" / "ckpt" / ".objckpt-drains").exists()  # nothing left to drain


def _restart_and_wait(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> Any:
    with _manager(rank, root, local, opts, persist_every=1) as m:
        m.wait()
        return m.steps()


# -- bad input ----------------------------------------------------------------------------------------

def _construct(rank: int, world: int, local: str, kw: dict[str, Any], per_rank: dict[int, dict[str, Any]]) -> str:
    args = {**kw, **per_rank.get(rank, {})}
    try:
        fields = objckpt.TierSettings.__dataclass_fields__
        tier = objckpt.TierSettings(local_dir=local, **{k: v for k, v in args.items() if k in fields})
        objckpt.CheckpointManager(local + "-root", tier=tier, node_override=f"n{rank}",
                                  **{k: v for k, v in args.items() if k not in fields})
    except (TierSettingsError, LocalTierError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_bad_settings_are_refused_on_every_rank_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    local = str(tmp_path / "file" / "{node}")  # under a regular file: not a directory
    got = run_multiprocess(2, _construct, local, {"replicas": 0}, {})
    assert all(g.startswith("LocalTierError") and "not writable" in g and "rank 0" in g for g in got), got

    good = str(tmp_path / "{node}")
    got = run_multiprocess(2, _construct, good, {"replicas": 2}, {})
    assert all(g.startswith("TierSettingsError") and "replicas=2" in g for g in got), got

    got = run_multiprocess(2, _construct, good, {"replicas": 1}, {1: {"persist_every": 3}})
    assert all("persist_every: 10 on rank(s) [0], 3 on rank(s) [1]" in g for g in got), got
    assert not any((tmp_path / n).exists() and os.listdir(tmp_path / n) for n in ("n0", "n1"))


_FULL_DISK = r"""
import resource, signal, sys, torch, objckpt
from objckpt.tier.errors import LocalTierError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))  # files of at most 1 MiB
m = objckpt.CheckpointManager(sys.argv[1] + "/root", tier=objckpt.TierSettings(
    local_dir=sys.argv[1] + "/local", persist_every=None, replicas=0))
try:
    m.save(1, {"big": torch.zeros(1 << 20)})  # 4 MiB
except LocalTierError as e:
    print("refused:", e)
"""


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert "refused:" in out.stdout and "RLIMIT_FSIZE" in out.stdout, out.stdout + out.stderr
    assert os.listdir(tmp_path / "local") == []  # nothing written


def test_advice_is_young_daly_from_measured_stalls(tmp_path: Path) -> None:
    m = objckpt.CheckpointManager(str(tmp_path / "root"), failure_rate=2.0, tier=objckpt.TierSettings(
        local_dir=str(tmp_path / "local"), replicas=0, persist_every=1, direct=True))  # O_DIRECT where it is taken
    for s in (1, 2):
        m.save(s, {"x": torch.arange(10_007.0) + s})
    m.wait()
    assert torch.equal(objckpt.read(str(tmp_path / "local" / "step-0000000002"))["x"], torch.arange(10_007.0) + 2)
    a = m.advice()
    assert a.saves_measured == 2 and a.mtbf_s == 1800.0 and a.drain_s is not None
    assert a.interval_s == pytest.approx(max(math.sqrt(2 * a.stall_s * 1800.0), a.drain_s))
    assert m.steps() == [1, 2]
    m.close()


# -- a rank killed while replicating ------------------------------------------------------------------

def _kill_mid_replicate(rank: int, world: int, root: str, local: str) -> str:
    from objckpt.tier import peers

    with _manager(rank, root, local, {}, persist_every=None) as m:
        m.save(2, _state(rank, world, 2))
        m.wait()  # step 2 replicated
        if rank == 1:
            def die(*a: Any, **k: Any) -> Any:
                os.kill(os.getpid(), signal.SIGKILL)

            peers.replicate = die  # type: ignore[assignment]
        try:
            m.save(4, _state(rank, world, 4))  # committed locally on both nodes, never replicated
            m.wait()
        except objckpt.ObjckptError as e:
            return f"{type(e).__name__}: {e}"
    return "replicated"


def test_a_rank_killed_while_replicating_leaves_the_previous_replicated_step_restorable(tmp_path: Path) -> None:
    root, local = str(tmp_path / "store"), str(tmp_path / "{node}" / "ckpt")
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] died"):
        run_multiprocess(2, _kill_mid_replicate, root, local, timeout=60)
    shutil.rmtree(tmp_path / "n1")  # and its node is lost: step 4's rank-1 share is gone everywhere
    got = run_multiprocess(2, _restore_no_drain, root, local)
    assert got == [(2, "local"), (2, "peer")]
    # step 4 could not be restored (rank 1's share died with n1): its remains are gone, so the
    # training can save step 4 again
    assert sorted(os.listdir(tmp_path / "n0" / "ckpt")) == ["step-0000000002"]


def _restore_no_drain(rank: int, world: int, root: str, local: str) -> Any:
    with _manager(rank, root, local, {}, persist_every=None) as m:
        st = _zeros(rank, world)
        res = m.load(st)
        _check(st, rank, world, res.step)
        return res.step, res.source


def test_persist_every_seconds_drains_by_the_managers_clock_and_latest_step_sees_every_tier(tmp_path: Path) -> None:
    now = [1000.0]
    m = objckpt.CheckpointManager(str(tmp_path / "root"), clock=lambda: now[0], tier=objckpt.TierSettings(
        local_dir=str(tmp_path / "local"), replicas=0, persist_every=None, persist_every_seconds=60, local_keep=5))
    for step, t in ((1, 1000.0), (2, 1030.0), (3, 1061.0), (4, 1100.0)):
        now[0] = t
        m.save(step, {"x": torch.full((3,), float(step))})
    m.wait()
    assert m.steps() == [3]  # the one save 60 s after the last drain (the manager's start)
    assert m.latest_step() == 4  # local only, but restorable
    assert m.step_tiers() == {1: ["local"], 2: ["local"], 3: ["local", "object"], 4: ["local"]}
    m.close()
    # objckpt ls shows the same tiers from the command line ({node} resolved as the manager does)
    from objckpt.cli import main

    out = subprocess.run([sys.executable, "-m", "objckpt", "ls", str(tmp_path / "root"), "--local-dir",
                                 str(tmp_path / "{node}"), "--node", "local"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = {int(line.split()[0]): line.split() for line in out.stdout.splitlines()[1:-1]}
    assert sorted(rows) == [1, 2, 3, 4]
    assert "local,object" in rows[3] and "local" in rows[1] and "object" not in " ".join(rows[4])
    assert main(["ls", str(tmp_path / "root")]) == 0  # without --local-dir: the index only, as before
    assert main(["ls", str(tmp_path / "root"), "--local-dir", str(tmp_path / "nowhere")]) == 2  # named, not empty


def test_ls_with_a_local_dir_shows_local_steps_before_anything_is_drained(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiered root with nothing drained yet has no index: ``ls --local-dir`` still lists the
    node's steps (it printed nothing), and a plain ``ls`` of an empty prefix says so."""
    from objckpt.cli import main

    m = objckpt.CheckpointManager(str(tmp_path / "root"), tier=objckpt.TierSettings(
        local_dir=str(tmp_path / "local"), replicas=0, persist_every=None))
    m.save(7, {"x": torch.ones(3)})
    m.wait()
    m.close()
    assert main(["ls", str(tmp_path / "root"), "--local-dir", str(tmp_path / "local")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "TIERS" in out[0] and out[1].split()[0] == "7" and "local" in out[1].split()
    assert main(["ls", str(tmp_path / "root")]) == 0
    got = capsys.readouterr()
    assert got.out == "" and "no committed checkpoint under" in got.err


def test_the_drain_cap_paces_uploads(monkeypatch: pytest.MonkeyPatch) -> None:
    from objckpt.tier import drain as drain_mod

    clock, slept = [0.0], []
    monkeypatch.setattr(drain_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(drain_mod.time, "sleep", lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))
    t = drain_mod.Throttle(100.0)  # bytes per second
    for _ in range(4):
        t.account(50)  # 200 bytes in all: 2 s at the cap
    assert sum(slept) == pytest.approx(2.0)
    unlimited = drain_mod.Throttle(None)
    unlimited.account(10 ** 12)
    assert sum(slept) == pytest.approx(2.0)


def test_a_step_already_drained_or_local_is_never_saved_again(tmp_path: Path) -> None:
    # replicas left to its default: none on a single node (there is no other node to copy to)
    m = objckpt.CheckpointManager(str(tmp_path / "root"),
                                  tier=objckpt.TierSettings(local_dir=str(tmp_path / "local"), persist_every=1))
    m.save(1, {"x": torch.ones(3)})
    m.wait()
    shutil.rmtree(tmp_path / "local" / "step-0000000001")  # only the drained copy is left
    with pytest.raises(objckpt.CheckpointExistsError, match="already committed under"):
        m.save(1, {"x": torch.zeros(3)})
    m.save(2, {"x": torch.ones(3)})
    with pytest.raises(objckpt.CheckpointExistsError, match="local tier"):
        m.save(2, {"x": torch.zeros(3)})
    m.close()
    assert torch.equal(objckpt.read(str(tmp_path / "root" / "step-0000000001"))["x"], torch.ones(3))


def _two_per_node(rank: int, world: int, root: str, local: str, restore: bool) -> Any:
    with _manager(rank, root, local, {}, node_override=f"n{rank // 2}") as m:
        if restore:
            st = _zeros(rank, world)
            res = m.load(st)
            _check(st, rank, world, res.step)
            return res.step, res.source
        for s in (1, 2, 3):
            m.save(s, _state(rank, world, s))
        m.wait()
        return m.steps()


def test_four_ranks_on_two_nodes_restore_a_lost_nodes_shares_from_its_peers(tmp_path: Path) -> None:
    root, local = str(tmp_path / "root"), str(tmp_path / "{node}" / "ckpt")
    assert run_multiprocess(4, _two_per_node, root, local, False) == [[2]] * 4
    blobs = tmp_path / "n1" / "ckpt" / "step-0000000003" / "blobs"
    (attempt,) = os.listdir(blobs)  # n1 holds its own ranks' blobs and the copies of n0's
    assert sorted(os.listdir(blobs / attempt)) == [f"r0000{r}-0000.bin" for r in range(4)]
    for node in ("n0", "n1"):  # each node's first rank wrote the step's file list, the manifest's own
        d = tmp_path / node / "ckpt" / "step-0000000003"
        data = (d / "manifest.json").read_bytes()
        listed = step_files.read(d, data)
        assert listed is not None and listed == step_files.of_manifest(_manifest.decode(data))
        assert sorted(listed.by_rank) == [0, 1, 2, 3] and all(listed.of_rank(r) for r in range(4))
    shutil.rmtree(tmp_path / "n0")
    assert run_multiprocess(4, _two_per_node, root, local, True) == [(3, "peer")] * 2 + [(3, "local")] * 2


def test_the_local_tier_saves_and_restores_while_object_storage_is_unreachable(tmp_path: Path) -> None:
    down = {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "x", "aws_secret_access_key": "y",
            "region_name": "us-east-1"}  # nothing listens on port 9: every request is refused
    m = objckpt.CheckpointManager("s3://bucket/run", storage_options=down,
                                  tier=objckpt.TierSettings(local_dir=str(tmp_path / "local"), persist_every=1))
    reads = []
    real = m._known_steps
    m._known_steps = lambda: (reads.append(1), real())[1]  # type: ignore[method-assign]
    m.save(1, {"x": torch.full((5,), 1.0)})  # its drain fails in the background ...
    m.save(2, {"x": torch.full((5,), 2.0)})  # ... and the saves go on
    assert len(reads) == 1  # the failed read of the steps is not repeated at every save
    st = {"x": torch.zeros(5)}
    res = m.load(st)
    assert (res.step, res.source) == (2, "local") and torch.equal(st["x"], torch.full((5,), 2.0))
    with pytest.raises(DrainError, match="step 1") as err:  # wait() reports the failed drains ...
        m.wait()
    assert "[1, 2]" in str(err.value) and err.value.retryable  # ... and the steps that wait for another attempt
    with pytest.raises(DrainError, match=r"\[1, 2\]"):  # still down at close(): tried once more, reported again
        m.close()
    with pytest.raises(DrainError, match=r"\[1, 2\]"):  # after close(): reported, no attempt (no thread left)
        m.wait()
    # kept for a retry, and recorded as due, for a job that restarts
    assert sorted(os.listdir(tmp_path / "local")) == [".objckpt-drains", "step-0000000001", "step-0000000002"]


def test_tier_errors_are_public_objckpt_errors() -> None:
    """A training loop catches what wait()/close()/load() raise by its public name."""
    for name, builtin in (("DrainError", OSError), ("LocalTierError", OSError), ("PeerCopyError", OSError),
                          ("TierRestoreError", FileNotFoundError), ("TierSettingsError", ValueError),
                          ("TopologyError", ValueError)):
        cls = getattr(objckpt, name)
        assert name in objckpt.__all__ and issubclass(cls, objckpt.ObjckptError) and issubclass(cls, builtin)
    assert objckpt.DrainError is DrainError and objckpt.TierSettingsError is TierSettingsError


def test_async_tiered_saves_commit_locally_and_drain_in_the_background(tmp_path: Path) -> None:
    """async_save=True: save() returns once staged; the local commit, the drain and local
    retention follow in save order, and a fresh manager restores the newest step."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    m = objckpt.CheckpointManager(root, async_save=True,
                                  tier=objckpt.TierSettings(local_dir=local, persist_every=2, local_keep=2))
    for step in range(1, 6):
        m.save(step, {"x": torch.full((1000,), float(step)), "step": step})
    m.close()
    assert m.steps() == [2, 4]
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step-0000000004", "step-0000000005"]
    fresh = objckpt.CheckpointManager(root, tier=objckpt.TierSettings(local_dir=local))
    st = {"x": torch.zeros(1000), "step": 0}
    res = fresh.load(st)
    assert (res.step, res.source, st["step"]) == (5, "local", 5) and torch.equal(st["x"], torch.full((1000,), 5.0))
    fresh.close()



# -- a node that cannot take a step's metadata ----------------------------------------------------------

def _spread_fails_on_n1(rank: int, world: int, root: str, local: str) -> Any:

    from objckpt.tier import local as tier_local

    node = Path(local.replace("{node}", f"n{rank}"))
    with _manager(rank, root, local, {}, persist_every=None) as m:
        m.save(1, _state(rank, world, 1))
        m.wait()
        real = tier_local.spread_metadata
        if rank == 1:  # n1's disk takes no more bytes from here on
            tier_local.spread_metadata = _on_a_full_disk(real)  # type: ignore[assignment]
        try:
            m.save(2, _state(rank, world, 2))  # committed on n0, then n1 cannot write rank 0's metadata
            got = "saved"
        except LocalTierError as e:
            got = str(e)
        finally:
            tier_local.spread_metadata = real  # type: ignore[assignment]
        after = sorted(os.listdir(node))
        previous = objckpt.read(str(node / "step-0000000001"))  # whole on both nodes (own blobs + replica)
        m.save(2, _state(rank, world, 2))  # the disk is back: the same step saves
        m.wait()
        st = _zeros(rank, world)
        res = m.load(st, step=2)
        _check(st, rank, world, 2)
        return got, after, torch.equal(previous["w"], _state(0, 1, 1)["w"].local), res.source


def test_a_node_that_cannot_write_a_steps_metadata_fails_the_save_on_every_rank_and_leaves_no_step(
        tmp_path: Path) -> None:
    root, local = str(tmp_path / "root"), str(tmp_path / "{node}" / "ckpt")
    got = run_multiprocess(2, _spread_fails_on_n1, root, local, timeout=90)  # before: rank 0 waited for ever
    for why, after, previous_whole, source in got:
        assert "rank 1 on node 'n1'" in why and "File too large" in why, why
        assert str(tmp_path / "n1" / "ckpt" / "step-0000000002") in why, why
        assert after == ["step-0000000001"]  # the failed step is on no node; the previous one untouched
        assert previous_whole and source == "local"


# -- the manager's known steps are object storage's ------------------------------------------------------

def _save_drop_save_again(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> Any:
    import torch.distributed as dist

    with _manager(rank, root, local, opts, replicas=0) as m:  # persist_every=2: only step 2 drains
        for s in (1, 2, 3):
            m.save(s, _state(rank, world, s))
        m.wait()
        dist.barrier()
        if rank == 1:  # n1 lost step 3's share (no replica): step 3 cannot be restored
            shutil.rmtree(Path(local.replace("{node}", "n1")) / "step-0000000003")
        dist.barrier()
        st = _zeros(rank, world)
        first = m.load(st).step  # 2; the remains of step 3 are dropped
        m.save(3, _state(rank, world, 3))  # the training saves step 3 again (drained: the 4th save)
        m.wait()
        st = _zeros(rank, world)
        res = m.load(st)
        _check(st, rank, world, res.step)
        return first, res.step, m.steps()


def test_a_local_step_dropped_by_a_restore_is_saved_again_and_restored(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    assert run_multiprocess(2, _save_drop_save_again, root, local, opts) == [(2, 3, [2, 3])] * 2
    st = _zeros(0, 1)
    objckpt.load(st, f"{root}/step-0000000003", storage_options=opts)  # the new step 3, whole in S3
    _check(st, 0, 1, 3)


# -- drains that failed are retried; a failed replication does not stop the drain ----------------------

def _drain_while_s3_comes_back(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> Any:
    import torch.distributed as dist

    from testkit.campaign_io import FaultProxy

    proxy = None
    if rank == 0:  # every request through it is reset before it reaches the server: object storage is down
        proxy = FaultProxy(opts["endpoint_url"], kind="reset", probability=1.0, max_offset=0, direction="up")
    url = [proxy.url if proxy is not None else None]
    dist.broadcast_object_list(url, 0)
    node = Path(local.replace("{node}", f"n{rank}"))
    with _manager(rank, root, local, {**opts, "endpoint_url": url[0]}, persist_every=1, local_keep=1) as m:
        m.save(1, _state(rank, world, 1))
        m.save(2, _state(rank, world, 2))
        try:
            m.wait()
            down = "drained?"
        except DrainError as e:
            down = str(e)
        kept = sorted(os.listdir(node))  # local_keep=1, but both wait to be drained
        dist.barrier()
        if proxy is not None:
            proxy.probability = 0.0  # object storage is back
        dist.barrier()
        m.save(3, _state(rank, world, 3))  # retries steps 1 and 2, oldest first, then drains 3
        m.wait()
        steps, after = m.steps(), sorted(os.listdir(node))
    if proxy is not None:
        proxy.close()
    return down, kept, steps, after


def test_failed_drains_are_retried_oldest_first_once_object_storage_is_back(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    got = run_multiprocess(2, _drain_while_s3_comes_back, root, local, opts)
    for down, kept, steps, after in got:
        assert "step(s) [1, 2] are not in object storage yet" in down, down
        assert kept == [".objckpt-drains", "step-0000000001", "step-0000000002"]  # both kept and recorded as due
        assert steps == [1, 2, 3]
        assert after == ["step-0000000003"]  # drained, so local retention lets them go, and their records
    for s in (1, 2, 3):  # each one complete in S3, bit for bit
        st = _zeros(0, 1)
        objckpt.load(st, f"{root}/step-{s:010d}", storage_options=opts)
        _check(st, 0, 1, s)


def _replication_fails_on_n1(rank: int, world: int, root: str, local: str) -> Any:

    from objckpt.tier import peers

    with _manager(rank, root, local, {}, persist_every=1) as m:
        m.save(1, _state(rank, world, 1))
        m.wait()
        real = peers.replicate
        if rank == 1:  # n1 cannot take rank 0's copy (background thread)
            peers.replicate = _on_a_full_disk(real)  # type: ignore[assignment]
        m.save(2, _state(rank, world, 2))
        try:
            m.wait()
            why = "replicated?"
        except objckpt.PeerCopyError as e:
            why = f"{type(e).__name__}: {e}"
        finally:
            peers.replicate = real  # type: ignore[assignment]
        return why, m.steps()


def test_a_failed_replication_still_drains_the_step(tmp_path: Path) -> None:
    root, local = str(tmp_path / "root"), str(tmp_path / "{node}" / "ckpt")
    got = run_multiprocess(2, _replication_fails_on_n1, root, local)
    for why, steps in got:
        assert why.startswith("PeerCopyError"), why
        assert steps == [1, 2]  # the drain ran although the copy to the peer failed
    st = _zeros(0, 1)
    objckpt.load(st, str(tmp_path / "root" / "step-0000000002"))
    _check(st, 0, 1, 2)


def test_the_error_class_comes_from_the_problem_kind_not_its_text(tmp_path: Path) -> None:
    # a full disk under a folder whose name says "already committed" is still a full disk
    local = tmp_path / "step already committed"
    m = objckpt.CheckpointManager(str(tmp_path / "root"),
                                  tier=objckpt.TierSettings(local_dir=str(local), persist_every=None))
    huge = {"x": torch.zeros(1).expand(1 << 50)}  # 4 PiB by its size, no memory
    with pytest.raises(LocalTierError, match="disk is"):
        m.save(1, huge)
    m.save(1, {"x": torch.ones(3)})
    with pytest.raises(objckpt.CheckpointExistsError):
        m.save(1, {"x": torch.ones(3)})
    m.close()


def test_a_restarted_manager_drains_the_due_steps_its_previous_run_could_not(tmp_path: Path) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    root.write_text("a file where the root's folder should be: every drain fails")
    m = objckpt.CheckpointManager(str(root), tier=objckpt.TierSettings(local_dir=str(local), persist_every=1,
                                                                       local_keep=1))
    for s in (1, 2):
        m.save(s, {"x": torch.full((4,), float(s))}, metadata={"loss": 1.0 / s})
    with pytest.raises(DrainError, match=r"\[1, 2\]"):
        m.close()
    other = objckpt.CheckpointManager(str(tmp_path / "elsewhere"),
                                      tier=objckpt.TierSettings(local_dir=str(local), persist_every=1))
    other.close()  # the records name their root: a manager of another root drains none of them
    assert other.steps() == [] and sorted(os.listdir(local))[0] == ".objckpt-drains"
    root.unlink()  # object storage is back; the job restarts
    fresh = objckpt.CheckpointManager(str(root), tier=objckpt.TierSettings(local_dir=str(local), persist_every=1,
                                                                           local_keep=1))
    shutil.rmtree(local / "step-0000000001")  # and step 1 is lost meanwhile: nothing to drain there
    fresh.wait()  # step 2 drained; step 1 dropped with a warning, not an error
    assert fresh.steps() == [2] and fresh.entries().get(2).metadata == {"loss": 0.5}
    assert torch.equal(objckpt.read(str(root / "step-0000000002"))["x"], torch.full((4,), 2.0))
    assert sorted(os.listdir(local)) == ["step-0000000002"]  # no record left
    fresh.close()
