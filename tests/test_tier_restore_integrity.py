"""Tiered restores that skip damaged copies, count whole steps across nodes, and move only needed bytes.

Temporary directories stand for nodes (``local_dir`` with ``{node}``, ``node_override``);
moto stands for object storage; ranks are real gloo processes; the partial save of
a killed rank is made by a real SIGKILL inside the real save path.
"""
from __future__ import annotations

import os
import signal
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from mp import run_multiprocess
from objckpt.format import keys

from tier_state import equal as _equal
from tier_state import state as _state
from tier_state import zeros as _zeros


def _manager(rank: int, root: str, local: str, opts: dict[str, Any], **kw: Any) -> objckpt.CheckpointManager:
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "60"
    args: dict[str, Any] = dict(local_dir=local, replicas=1, persist_every=2, local_keep=2,
                                node_override=f"n{rank}", storage_options=opts)
    args.update(kw)
    return objckpt.CheckpointManager(root, **args)


def _save(rank: int, world: int, root: str, local: str, opts: dict[str, Any], steps: list[int]) -> Any:
    with _manager(rank, root, local, opts) as m:
        for s in steps:
            m.save(s, _state(rank, world, s))
        m.wait()
        return m.steps()


def _restore(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> dict[str, Any]:
    with _manager(rank, root, local, opts) as m:
        st = _zeros(rank, world)
        try:
            res = m.load(st)
        except objckpt.ObjckptError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        rep = m._tiers.last_restore
        return {"step": res.step, "tiers": res.tiers, "equal": _equal(st, rank, world, res.step),
                "skipped": res.skipped, "report_skipped": rep.skipped, "moved": rep.bytes_moved}


def _step_dir(tmp_path: Path, node: str, step: int) -> Path:
    return tmp_path / node / "ckpt" / f"step-{step:010d}"


def _own_blob(tmp_path: Path, node: str, rank: int, step: int) -> Path:
    (blob,) = (_step_dir(tmp_path, node, step) / "blobs").rglob(f"r{rank:05d}-*.bin")
    return blob


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def _damage(kind: str, tmp_path: Path) -> str:
    """Damage node n0's copy of step 2 (rank 0's own blob, or the folder's manifest); the file's name."""
    blob = _own_blob(tmp_path, "n0", 0, 2)
    if kind == "flip-blob":
        _flip(blob, blob.stat().st_size // 2)
    elif kind == "truncate-blob":
        os.truncate(blob, blob.stat().st_size // 2)
    elif kind == "delete-blob":
        blob.unlink()
    elif kind == "flip-manifest":
        manifest = _step_dir(tmp_path, "n0", 2) / keys.MANIFEST_NAME
        _flip(manifest, manifest.stat().st_size // 2)
        return keys.MANIFEST_NAME
    return blob.relative_to(_step_dir(tmp_path, "n0", 2)).as_posix()


@pytest.mark.parametrize("kind", ["flip-blob", "truncate-blob", "flip-manifest", "delete-blob"])
def test_a_damaged_local_copy_is_skipped_for_the_peers_on_every_restart(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]], kind: str) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    assert run_multiprocess(2, _save, root, local, opts, [1, 2]) == [[2], [2]]  # step 2 drained too
    name = _damage(kind, tmp_path)
    for restart in (1, 2):  # the damage stays: every restart restores alike
        got = run_multiprocess(2, _restore, root, local, opts)
        for r, out in enumerate(got):
            assert "error" not in out, f"restart {restart}, rank {r}: {out}"
            assert out["step"] == 2 and out["equal"], f"restart {restart}, rank {r} not bit-exact: {out}"
            assert out["tiers"] == {0: "peer", 1: "local"}, out["tiers"]
            if kind == "delete-blob":  # a missing file was always judged by the plan: nothing to skip
                assert out["skipped"] == [] and out["report_skipped"] == ()
                continue
            (skip,) = out["report_skipped"]
            assert (skip.rank, skip.step, skip.source, skip.file) == (0, 2, "local", name), skip
            reason = {"flip-blob": "crc32c mismatch", "truncate-blob": "truncated", "flip-manifest": "manifest"}[kind]
            assert skip.why.startswith("CorruptCheckpointError: ") and reason in skip.why, skip.why
            assert out["skipped"] == [str(skip)] and "rank 0: local copy of " + name in out["skipped"][0]


def test_damaged_local_and_peer_copies_are_skipped_for_object_storage(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    run_multiprocess(2, _save, root, local, opts, [1, 2])
    name = _damage("flip-blob", tmp_path)
    replica = _step_dir(tmp_path, "n1", 2) / name  # rank 0's share as its peer holds it
    _flip(replica, replica.stat().st_size // 2)
    m = objckpt.inspect(str(_step_dir(tmp_path, "n1", 2)))
    (chunk,) = m.tensors["b"].chunks  # the replicated tensor, in one writer's blob, read by both ranks
    # a file found damaged counts as absent on its node: whoever reads rank 0's blob reads it from object storage
    rank1 = "object" if m.blobs[chunk.blob].name == name else "local"
    for _restart in (1, 2):
        got = run_multiprocess(2, _restore, root, local, opts)
        for r, out in enumerate(got):
            assert "error" not in out and out["step"] == 2 and out["equal"], f"rank {r}: {out}"
            assert out["tiers"] == {0: "object", 1: rank1}, out["tiers"]
            assert [(s.rank, s.source, s.file) for s in out["report_skipped"]] == [(0, "local", name),
                                                                                   (0, "peer", name)]
            assert all("crc32c mismatch" in s.why for s in out["report_skipped"])


def test_the_plan_counts_a_folder_without_its_manifest_and_skips_a_source_that_failed() -> None:
    from objckpt.tier.local import LocalStep
    from objckpt.tier.restore import Holding, plan_restore

    every = ["manifest.json", "b0", "b1"]
    # rank 1 was killed before the spread: its folder holds its blob, no manifest; n0 holds the rest
    held = [Holding("n0", {3: LocalStep(3, every, ["manifest.json", "b0"]), 2: LocalStep(2, every, every)}),
            Holding("n1", {2: LocalStep(2, every, every)}, loose={3: ("b1",)})]
    plan = plan_restore(held, [2], peers=True)
    assert plan.step == 3 and plan.sources == ["peer", "peer"], plan  # no folder whole: both read through peers
    assert plan_restore([held[0], Holding("n1", {2: LocalStep(2, every, every)})], [2], True).step == 2
    # rank 0's local copy of step 2 failed its check, then its peer's: object storage next, then nothing
    assert plan_restore(held, [2], True, step=2, forbid={0: frozenset({"local"})}).sources == ["peer", "local"]
    assert plan_restore(held, [2], True, step=2, forbid={0: frozenset({"local", "peer"})}).sources == [
        "object", "local"]
    assert plan_restore(held, [], True, step=2, forbid={0: frozenset({"local", "peer"})}).step is None


# -- a step whose metadata did not reach every node -------------------------------------------------------

def _killed_before_the_spread(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> str:
    from objckpt.tier import local as tier_local

    real = tier_local.spread_metadata

    def spread(comm: Any, step_dir: Path, *a: Any, **k: Any) -> Any:
        if rank == 1 and Path(step_dir).name.endswith("3"):  # after rank 1's local save, before the spread
            os.kill(os.getpid(), signal.SIGKILL)
        return real(comm, step_dir, *a, **k)

    tier_local.spread_metadata = spread
    with _manager(rank, root, local, opts) as m:
        for s in (1, 2):
            m.save(s, _state(rank, world, s))
        m.wait()  # step 2 replicated and drained
        try:
            m.save(3, _state(rank, world, 3))
        except objckpt.ObjckptError as e:  # rank 0: its peer died in the spread
            return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_step_whose_metadata_missed_a_node_is_restored_whole_and_nothing_newer_is_deleted(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    with pytest.raises(AssertionError, match=r"rank\(s\) \[1\] died"):
        run_multiprocess(2, _killed_before_the_spread, root, local, opts, timeout=90)
    n0, n1 = _step_dir(tmp_path, "n0", 3), _step_dir(tmp_path, "n1", 3)
    # the real partial state: the manifest on n0 only; each node holds its own rank's blob, no replicas
    assert (n0 / keys.MANIFEST_NAME).is_file() and not (n1 / keys.MANIFEST_NAME).exists()
    assert _own_blob(tmp_path, "n0", 0, 3).is_file() and _own_blob(tmp_path, "n1", 1, 3).is_file()
    assert not list((n0 / "blobs").rglob("r00001-*.bin")) and not list((n1 / "blobs").rglob("r00000-*.bin"))

    got = run_multiprocess(2, _restore, root, local, opts)
    for r, out in enumerate(got):
        assert "error" not in out and out["step"] == 3 and out["equal"], f"rank {r}: {out}"
        assert out["tiers"] == {0: "local", 1: "peer"}, out["tiers"]
    assert (n0 / keys.MANIFEST_NAME).is_file(), "the restored step was not deleted"
    assert _step_dir(tmp_path, "n0", 2).is_dir() and _step_dir(tmp_path, "n1", 2).is_dir()
    # the restore wrote the metadata it received back to n1: the next restart reads it there, and
    # rank 1 receives only what its folder cannot have (no replication ran): the replicated tensor's
    # 296 bytes where rank 0 wrote it
    assert (n1 / keys.MANIFEST_NAME).read_bytes() == (n0 / keys.MANIFEST_NAME).read_bytes()
    m = objckpt.inspect(str(n1))
    (chunk,) = m.tensors["b"].chunks
    from_peer = m.blobs[chunk.blob].rank == 0
    again = run_multiprocess(2, _restore, root, local, opts)
    assert [(o["step"], o["tiers"], o["moved"], o["equal"]) for o in again] == [
        (3, {0: "local", 1: "peer" if from_peer else "local"}, 37 * 8 if from_peer else 0, True)] * 2


def test_a_folder_with_blobs_and_no_manifest_on_any_node_is_not_a_step(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    run_multiprocess(2, _save, root, local, opts, [1, 2, 3])
    for node in ("n0", "n1"):  # step 3 was never committed anywhere: blobs, no manifest
        (_step_dir(tmp_path, node, 3) / keys.MANIFEST_NAME).unlink()
    got = run_multiprocess(2, _restore, root, local, opts)
    assert [(o["step"], o["tiers"], o["equal"]) for o in got] == [(2, {0: "local", 1: "local"}, True)] * 2


# -- healthy restarts move nothing; a replaced node receives only what its ranks read ---------------------

def _rows(rank: int, world: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s rows only (nothing replicated: each rank reads its own share)."""
    return {"w": _state(rank, world, step)["w"], "step": step}


def _save_rows(rank: int, world: int, root: str, local: str) -> None:
    with _manager(rank, root, local, {}, persist_every=None) as m:
        for s in (1, 2):
            m.save(s, _rows(rank, world, s))
        m.wait()


def _restore_rows(rank: int, world: int, root: str, local: str) -> dict[str, Any]:
    with _manager(rank, root, local, {}, persist_every=None) as m:
        st = _rows(rank, world, 0)
        st["w"].local.zero_()
        res = m.load(st)
        rep = m._tiers.last_restore
        return {"step": res.step, "tiers": res.tiers, "moved": rep.bytes_moved, "by_rank": rep.bytes_by_rank,
                "received": rep.received, "equal": torch.equal(st["w"].local, _rows(rank, world, 2)["w"].local)}


def test_four_nodes_restart_healthy_moving_nothing_and_a_replaced_node_receives_only_its_reads(
        tmp_path: Path) -> None:
    root, local = str(tmp_path / "root"), str(tmp_path / "{node}" / "ckpt")
    run_multiprocess(4, _save_rows, root, local)
    step = _step_dir(tmp_path, "n0", 2)
    blobs = [p for p in (step / "blobs").rglob("*.bin")]
    assert len(blobs) == 2, "replicas=1 on 4 nodes: a folder holds its rank's blob and one peer's copy"

    healthy = run_multiprocess(4, _restore_rows, root, local)
    for out in healthy:
        assert out["equal"] and out["step"] == 2 and out["tiers"] == {r: "local" for r in range(4)}, out
        assert out["moved"] == 0 and out["received"] == {}

    shutil.rmtree(tmp_path / "n2")  # node n2 replaced
    lost = run_multiprocess(4, _restore_rows, root, local)
    assert all(out["equal"] and out["step"] == 2 for out in lost)
    assert lost[0]["tiers"] == {0: "local", 1: "local", 2: "peer", 3: "local"}
    m = objckpt.inspect(str(step))
    from objckpt.tier.local import files_of

    reads = ["manifest.json"] + files_of(m, 2)  # the manifest and rank 2's own share
    size = {b.name: b.size for b in m.blobs} | {"manifest.json": (step / "manifest.json").stat().st_size}
    size |= {i.name: (step / i.name).stat().st_size for i in m.rank_indexes if (step / i.name).exists()}
    assert lost[0]["by_rank"].keys() == {2}, lost[0]["by_rank"]
    assert lost[2]["moved"] <= sum(size[n] for n in reads) < sum(size.values())
    assert sorted(lost[2]["received"]) == sorted(reads)
