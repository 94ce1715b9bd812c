"""Two jobs sharing one ``local_dir``: each step folder names its root (objckpt.tier.owner),
and a job never restores, counts or deletes another root's steps.

Job A (root ``.../A``) saves steps 1-3 to the local tier only; job B (root ``.../B``, nothing
saved yet) then uses the same ``local_dir``.  Roots are moto S3 (one bucket, two prefixes);
the local folders are temporary directories (``{node}`` per node for the two-rank case)."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from mp import run_multiprocess
from objckpt.tier import backlog, owner
from objckpt.tier.errors import TierRestoreError, TierSettingsError

ROWS, COLS = 4, 333


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step
    per = math.ceil(ROWS / world)
    lo, hi = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    return {"w": objckpt.Shard(full[lo:hi].clone(), (ROWS, COLS), (lo, 0)),
            "b": torch.arange(11, dtype=torch.float64) + step}


def _zeros(rank: int, world: int) -> dict[str, Any]:
    st = _state(rank, world, 0)
    st["w"].local.zero_()
    st["b"].zero_()
    return st


def _manager(rank: int, root: str, local: str, opts: dict[str, Any], keep: int = 2) -> objckpt.CheckpointManager:
    # nothing drains: the local tier is A's only copy
    return objckpt.CheckpointManager(root, local_dir=local, persist_every=None, local_keep=keep,
                                     node_override=f"n{rank}", storage_options=opts)


def _job_a_saves(rank: int, world: int, root: str, local: str, opts: dict[str, Any],
                 steps: tuple[int, ...] = (1, 2, 3)) -> list[int]:
    with _manager(rank, root, local, opts, keep=4) as m:
        for s in steps:
            m.save(s, _state(rank, world, s))
        m.wait()
        return sorted(m.step_tiers())


def _job_a_restores(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> tuple[int, str]:
    with _manager(rank, root, local, opts, keep=4) as m:
        st = _zeros(rank, world)
        res = m.load(st)
        want = _state(rank, world, 3)
        assert torch.equal(st["w"].local, want["w"].local) and torch.equal(st["b"], want["b"]), \
            f"rank {rank}: not step 3's bytes"
        return res.step, res.source


def _job_b(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> dict[str, Any]:
    """B on A's local_dir: what it sees, what its save of A's step number and its retention do."""
    out: dict[str, Any] = {}
    with _manager(rank, root, local, opts) as m:
        out["latest"] = m.latest_step()
        out["tiers"] = m.step_tiers()
        with pytest.raises(TierRestoreError, match="nothing to restore"):
            m.load(_zeros(rank, world))
        with pytest.raises(TierSettingsError) as e:
            m.save(1, _state(rank, world, 101))
        out["collision"] = str(e.value)
        for s in (4, 5, 6):  # local_keep=2: B's retention runs, with A's three steps beside it
            m.save(s, _state(rank, world, s))
        m.wait()
        out["after"] = sorted(m.step_tiers())
    return out


def _roots(moto_s3: tuple[str, dict[str, Any]]) -> tuple[str, str, dict[str, Any]]:
    bucket, opts = moto_s3
    return f"s3://{bucket}/A", f"s3://{bucket}/B", opts


def _names(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("step-"))


def test_another_roots_steps_are_neither_restored_nor_the_latest(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    root_a, root_b, opts = _roots(moto_s3)
    local = str(tmp_path / "shm" / "ckpt")
    assert _job_a_saves(0, 1, root_a, local, opts) == [1, 2, 3]
    with caplog.at_level(logging.WARNING, logger="objckpt"), _manager(0, root_b, local, opts) as m:
        assert m.latest_step() is None
        assert m.step_tiers() == {}
        with pytest.raises(TierRestoreError, match="nothing to restore"):
            m.load(_zeros(0, 1))
    warned = [r.getMessage() for r in caplog.records if "not this manager's" in r.getMessage()]
    assert len(warned) == 1  # once per manager, naming the other root, its steps, the folder, the fix
    assert root_a in warned[0] and "[1, 2, 3]" in warned[0] and local in warned[0]
    assert "local_dir of its own" in warned[0]
    assert _job_a_restores(0, 1, root_a, local, opts) == (3, "local")


def test_saving_a_step_whose_folder_is_another_roots_is_refused_before_anything_is_written(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    root_a, root_b, opts = _roots(moto_s3)
    local = tmp_path / "shm" / "ckpt"
    _job_a_saves(0, 1, root_a, str(local), opts)
    before = {p: p.read_bytes() for p in (local / "step-0000000001").rglob("*") if p.is_file()}
    with _manager(0, root_b, str(local), opts) as m:
        with pytest.raises(TierSettingsError) as e:
            m.save(1, _state(0, 1, 101))
        text = str(e.value)
        assert root_a in text and root_b in text and str(local / "step-0000000001") in text
        assert "nothing written" in text and "local_dir of its own" in text
        # a folder of A's with no manifest yet (a save in progress, or killed) is A's too
        owner.write(local / "step-0000000007", owner.Owner(root_a))
        with pytest.raises(TierSettingsError, match="belongs to root"):
            m.save(7, _state(0, 1, 7))
        m.save(8, _state(0, 1, 8))  # a number of its own saves
    after = {p: p.read_bytes() for p in (local / "step-0000000001").rglob("*") if p.is_file()}
    assert after == before  # A's step 1 untouched, byte for byte
    assert os.listdir(local / "step-0000000007") == [owner.OWNER_NAME]
    assert owner.read(local / "step-0000000008") == owner.Owner(root_b)


def test_retention_and_a_restore_never_delete_another_roots_steps(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    root_a, root_b, opts = _roots(moto_s3)
    local = tmp_path / "shm" / "ckpt"
    _job_a_saves(0, 1, root_a, str(local), opts, (1, 2, 3, 20))
    # A's step 20 is not whole on this node (as where another node held the rest)
    (blob,) = [p for p in (local / "step-0000000020" / "blobs").rglob("*.bin")]
    blob.unlink()
    with _manager(0, root_b, str(local), opts) as m:
        for s in (11, 12, 13):
            m.save(s, _state(0, 1, s))
        m.wait()
        assert sorted(m.step_tiers()) == [12, 13]  # B's newest local_keep=2, A's never counted
    with _manager(0, root_b, str(local), opts) as m:
        # the restore removes the local steps newer than the one restored: B's own only
        assert m.load(_zeros(0, 1)).step == 13
    assert _names(local) == ["step-0000000001", "step-0000000002", "step-0000000003",
                             "step-0000000012", "step-0000000013", "step-0000000020"]
    assert _job_a_restores(0, 1, root_a, str(local), opts) == (3, "local")


def test_two_ranks_on_two_nodes_share_a_local_dir_template_with_another_job(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    root_a, root_b, opts = _roots(moto_s3)
    local = str(tmp_path / "{node}" / "ckpt")
    assert run_multiprocess(2, _job_a_saves, root_a, local, opts) == [[1, 2, 3]] * 2
    # each node's folder names its root: its ranks' shares and the replicas from the other node
    records = {(node, s): owner.read(tmp_path / node / "ckpt" / f"step-{s:010d}")
               for node in ("n0", "n1") for s in (1, 2, 3)}
    got = run_multiprocess(2, _job_b, root_b, local, opts)
    for r, out in enumerate(got):
        assert out["latest"] is None and out["tiers"] == {}, f"rank {r}: {out}"
        assert root_a in out["collision"] and root_b in out["collision"]
        assert out["after"] == [5, 6]
    for node in ("n0", "n1"):
        d = tmp_path / node / "ckpt"
        assert _names(d) == ["step-0000000001", "step-0000000002", "step-0000000003",
                             "step-0000000005", "step-0000000006"]
        assert owner.read(d / "step-0000000006").root == root_b
    assert run_multiprocess(2, _job_a_restores, root_a, local, opts) == [(3, "local")] * 2
    assert set(records.values()) == {owner.Owner(root_a, owner.job_identity())}


def test_another_roots_drain_records_survive_this_roots_drains(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    """A's step 3 was due and not drained yet (recorded in the shared folder): B's drains keep
    A's record, so A's restart still drains it."""
    root_a, root_b, opts = _roots(moto_s3)
    local = tmp_path / "shm" / "ckpt"
    _job_a_saves(0, 1, root_a, str(local), opts)
    backlog.mark(local, "step-0000000003", backlog.Undrained(3, {"loss": 1.5}, 0.0), root_a)
    with objckpt.CheckpointManager(root_b, local_dir=str(local), persist_every=1, storage_options=opts) as m:
        m.save(11, _state(0, 1, 11))  # drained to B's root, its own record reconciled
        m.wait()
        assert m.steps() == [11]
    record = local / backlog.PENDING_DIR / "step-0000000003.json"
    assert record.is_file() and json.loads(record.read_bytes())["root"] == root_a
    with _manager(0, root_a, str(local), opts, keep=4) as m:
        m.wait()  # A's restart drains its recorded step
        assert m.steps() == [3]
    got = objckpt.read(f"{root_a}/step-0000000003", storage_options=opts)
    assert torch.equal(got["w"], _state(0, 1, 3)["w"].local)


def test_a_folder_without_an_owner_record_is_ours_only_when_a_drain_record_says_so(tmp_path: Path) -> None:
    """An older release wrote no owner record: such a folder is never restored or deleted as
    ours, unless the folder's drain record names our root (then it is adopted)."""
    root = str(tmp_path / "root")
    local = tmp_path / "local"
    for s in (1, 2):
        objckpt.save({"x": torch.full((3,), float(s))}, str(local / f"step-{s:010d}"))
    (local / backlog.PENDING_DIR).mkdir()
    (local / backlog.PENDING_DIR / "step-0000000002.json").write_text(
        json.dumps({"step": 2, "metadata": {}, "saved_at": 0.0, "root": root}))
    with objckpt.CheckpointManager(root, local_dir=str(local), persist_every=None, local_keep=1) as m:
        assert sorted(m.step_tiers()) == [2]  # 1: no evidence it is ours
        assert owner.read(local / "step-0000000002") == owner.Owner(root, owner.job_identity())
        m.save(3, {"x": torch.ones(3)})
        m.wait()
    assert _names(local) == ["step-0000000001", "step-0000000003"]  # retention: 2 was ours, 1 left alone


def test_the_job_identity_comes_from_the_launcher() -> None:
    assert owner.job_identity({}) is None
    assert owner.job_identity({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "42"}) == "SLURM_JOB_ID=42"
    assert owner.job_identity({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "42"}) == "TORCHELASTIC_RUN_ID=abc"


def test_a_local_root_given_relative_then_absolute_is_one_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted job that names its local root relative to another working directory (or
    absolute) owns the same step folders: ownership compares the folder, not the spelling."""
    local = str(tmp_path / "shm")
    monkeypatch.chdir(tmp_path)
    tier = objckpt.TierSettings(local_dir=local, replicas=0, persist_every=None)
    with objckpt.CheckpointManager("root", tier=tier) as m:
        m.save(1, {"x": torch.full((3,), 1.0)})
    assert owner.read(Path(local) / "step-0000000001") == owner.Owner(str(tmp_path / "root"), owner.job_identity())
    with objckpt.CheckpointManager(str(tmp_path / "root") + "/", tier=tier) as again:
        assert again.latest_step() == 1
        back = {"x": torch.zeros(3)}
        assert again.load(back).step == 1 and torch.equal(back["x"], torch.full((3,), 1.0))


def test_ls_with_a_local_dir_lists_only_the_roots_own_local_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``objckpt ls ROOT --local-dir DIR`` shows ROOT's local steps as its manager sees them,
    not another job's in the same folder."""
    from objckpt.cli import main

    local = str(tmp_path / "local")
    for root, steps in (("A", (1, 2)), ("B", (5,))):
        tier = objckpt.TierSettings(local_dir=local, replicas=0, persist_every=None, local_keep=4)
        with objckpt.CheckpointManager(str(tmp_path / root), tier=tier) as m:
            for s in steps:
                m.save(s, {"x": torch.full((3,), float(s))})
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "B"), "--local-dir", local]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split()[0] for line in out[1:] if "step(s) under" not in line]
    assert rows == ["5"] and out[-1].endswith(f"1 in {local}"), out
