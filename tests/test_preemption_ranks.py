"""Preemption with real gloo ranks, real signals and moto S3 over HTTP: every rank saves the
same step, exits 0, and a new job (fresh processes, the same or another world size) restores
that step bit-exact.  The ranks run the loop the docs show (tests/preemption_ranks.py); each
signalled rank sends itself SIGTERM at a known step, so the agreed step is known in advance."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest

import preemption_ranks as pr
from preemption_ranks import restart, train


def _args(tmp_path: Path, moto_s3: tuple[str, dict[str, Any]], **kw: Any) -> dict[str, Any]:
    bucket, opts = moto_s3
    return {"dir": str(tmp_path), "root": f"s3://{bucket}/run", "opts": opts, **kw}


def _manifest_in_s3(moto_s3: tuple[str, dict[str, Any]], step: int) -> bool:
    bucket, opts = moto_s3
    s3 = boto3.client("s3", **opts)
    got = s3.list_objects_v2(Bucket=bucket, Prefix=f"run/step-{step:010d}/").get("Contents", [])
    return any(o["Key"].endswith("/manifest.json") for o in got)


def _local_steps(local: str) -> dict[str, list[str]]:
    base = Path(local.replace("{node}", ""))
    return {d.name: sorted(p.name for p in d.glob("step-*") if (p / "manifest.json").exists())
            for d in sorted(base.parent.glob(base.name + "*")) if d.is_dir()}


def _restored(a: dict[str, Any], world: int, step: int, **kw: Any) -> list[dict[str, Any]]:
    codes, res = pr.run(restart, {**a, **kw}, world)
    assert codes == [0] * world, (codes, res)
    for r in res:
        assert r is not None and r["latest"] == step and r["loaded"] == step and r["exact"], res
    return res  # type: ignore[return-value]


def test_sigterm_to_one_rank_of_four_every_rank_saves_that_step_and_a_job_of_two_restores_it(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    a = _args(tmp_path, moto_s3, signal_at={2: 7}, user_handler=True)
    codes, res = pr.run(train, a, 4)
    assert codes == [0, 0, 0, 0], res
    assert [r["preemption_step"] for r in res] == [7, 7, 7, 7]  # type: ignore[index]
    assert [r["preempted"] for r in res] == [False, False, True, False]  # type: ignore[index]
    # the script's own handler, installed before the manager, still ran (on the rank signalled only)
    assert [r["user_calls"] for r in res] == [0, 0, 1, 0]  # type: ignore[index]
    assert _manifest_in_s3(moto_s3, 7)  # no tier: straight to object storage, off the save_every interval
    assert "preemption save of step 7: committed in object storage" in pr.logs(a, train, 0)
    _restored(a, 2, 7)


def test_sigterm_to_every_rank_at_different_steps_agrees_at_the_next_check(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    """preemption_check_every=5: reached_preemption communicates at its calls 1, 6, 11, ...;
    with save_every=4 the loop calls it at steps 1, 2, 3, 5, 6, 7 (step 4 is a save step:
    ``should_save(4) or ...`` does not call it), so its 6th call is step 7: every rank was
    signalled before (steps 2, 3, 5, 6) and every rank saves step 7."""
    a = _args(tmp_path, moto_s3, signal_at={0: 3, 1: 5, 2: 6, 3: 2}, check_every=5)
    codes, res = pr.run(train, a, 4)
    assert codes == [0, 0, 0, 0], res
    assert [r["preemption_step"] for r in res] == [7, 7, 7, 7]  # type: ignore[index]
    assert all(r["preempted"] and r["signals"] == 1 for r in res)  # type: ignore[index]
    _restored(a, 4, 7)


def test_a_second_sigterm_during_the_save_is_only_recorded(tmp_path: Path,
                                                           moto_s3: tuple[str, dict[str, Any]]) -> None:
    a = _args(tmp_path, moto_s3, signal_at={1: 6}, second_signal=True, user_handler=True)
    codes, res = pr.run(train, a, 2)
    assert codes == [0, 0], res
    assert [r["preemption_step"] for r in res] == [6, 6]  # type: ignore[index]
    # rank 1: the first signal and the one sent from inside the save; rank 0: the one from inside its save
    assert [r["signals"] for r in res] == [1, 2] and [r["user_calls"] for r in res] == [1, 2]  # type: ignore[index]
    _restored(a, 2, 6)


def test_tiered_preemption_commits_locally_replicates_and_drains_then_restores_at_another_world_size(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    local = str(tmp_path / "node-{node}")
    a = _args(tmp_path, moto_s3, local=local, signal_at={3: 6})
    codes, res = pr.run(train, a, 4)
    assert codes == [0, 0, 0, 0], res
    assert [r["preemption_step"] for r in res] == [6, 6, 6, 6]  # type: ignore[index]
    assert _manifest_in_s3(moto_s3, 6)  # persist_every=None: drained because it is the preemption step
    assert not _manifest_in_s3(moto_s3, 4)  # an ordinary tiered save: local only
    assert {n: "step-0000000006" in s for n, s in _local_steps(local).items()} == {"node-n0": True, "node-n1": True}
    log0 = pr.logs(a, train, 0)
    assert "preemption save of step 6: committed in the local tier" in log0 and "replicated to 1 peer" in log0
    assert "drained to" in log0 and "cut the drain" not in log0
    _restored(a, 2, 6)


def test_tiered_preemption_whose_drain_the_deadline_cut_restores_from_the_local_tier_and_drains_later(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    """A deadline of a millisecond has passed before the drain starts (the save alone takes
    longer): wait() returns, the process exits 0, the step is in the node folders only; the
    next job restores it from there, and its first save's wait() drains it too (the step was
    recorded as due in the node's folder right after its local commit)."""
    local = str(tmp_path / "node-{node}")
    a = _args(tmp_path, moto_s3, local=local, signal_at={0: 5}, deadline=0.001)
    codes, res = pr.run(train, a, 2)
    assert codes == [0, 0], res
    assert [r["preemption_step"] for r in res] == [5, 5]  # type: ignore[index]
    assert not _manifest_in_s3(moto_s3, 5)
    assert "the preemption deadline cut the drain of step 5" in pr.logs(a, train, 0)
    res2 = _restored(a, 2, 5, deadline=25.0, save_after=True)
    assert res2[0]["object_steps"] == [5]  # step 6, an ordinary save (persist_every=None), stays local
    assert _manifest_in_s3(moto_s3, 5)


@pytest.mark.parametrize("point,latest", [("local_write", 4), ("drain_upload", 6), ("drain_commit", 6)])
def test_sigkill_during_the_preemption_save_leaves_a_whole_step(point: str, latest: int, tmp_path: Path,
                                                                moto_s3: tuple[str, dict[str, Any]]) -> None:
    """Every rank SIGKILLed at a point of the preemption save of step 6 (testkit's kill hook,
    the grace period's end): the new job restores the newest whole step, bit-exact (step 4, the
    last ordinary save, when the kill came before step 6's local commit)."""
    local = str(tmp_path / "node-{node}")
    a = _args(tmp_path, moto_s3, local=local, signal_at={1: 6}, point=point, victims=[0, 1], triggers=[0])
    codes, res = pr.run(train, a, 2)
    assert codes == [-9, -9], (codes, res)
    assert Path(tmp_path, "fired").exists()
    _restored({k: v for k, v in a.items() if k not in ("point", "victims", "triggers")}, 2, latest)
