"""CheckpointManager from an orbax user's view: argument order, older steps, save interval,
time-based keep, the best step, entries(), and why each retention delete happened (moto S3 over HTTP)."""
from __future__ import annotations

import logging
import os
import re
from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt.manager.index import InvalidStepError
from objckpt.manager.naming import SwappedArgumentsError
from objckpt.manager.retention import RetentionPolicy, RetentionPolicyError, StepOrderError, steps_to_keep
from testkit.http_count import CountingProxy
from conftest import assert_same


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, generator=g), "step": step}


def _step_folders(bucket: str, opts: dict[str, Any], prefix: str = "run/") -> set[str]:
    r = boto3.client("s3", **opts).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):].split("/")[0] for o in r.get("Contents", [])} - {"_objckpt_index"}


def test_swapped_arguments_are_a_short_error_and_step_is_a_keyword(tmp_path: Any) -> None:
    """save(state, step) / load(step, state) name which argument is which in a short message,
    not the repr of a 50-layer model (2,918 characters before); ``step=`` works everywhere."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)])
    state = {"model": model, "step": 3}
    with objckpt.CheckpointManager(str(tmp_path / "run"), keep_last=2) as m:
        with pytest.raises(SwappedArgumentsError) as ei:
            m.save(state, 5)  # type: ignore[arg-type]
        msg = str(ei.value)
        assert len(msg) < 300, msg
        assert "swapped" in msg and "5 (int) was passed as the state" in msg and "step first" in msg
        assert isinstance(ei.value, TypeError) and isinstance(ei.value, InvalidStepError)
        with pytest.raises(SwappedArgumentsError, match="state first, then the step") as ei:
            m.load(5, state)  # type: ignore[arg-type]
        assert len(str(ei.value)) < 300
        with pytest.raises(SwappedArgumentsError, match=r"load\(state, step=N\)"):
            m.load(5)
        with pytest.raises(InvalidStepError, match="got a Sequential") as ei2:
            m.save(model, {"w": torch.zeros(1)})  # type: ignore[arg-type]
        assert len(str(ei2.value)) < 300
        assert not (tmp_path / "run").exists() or os.listdir(tmp_path / "run") in ([], ["_objckpt_index"])
        # by keyword, in any order
        m.save(state=state, step=5)
        assert m.should_save(step=6) and m.step_uri(step=5).endswith("step-0000000005")
        st: dict[str, Any] = {"model": torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(50)]), "step": 0}
        m.load(step=5, state=st)
        assert st["step"] == 3 and torch.equal(st["model"][49].weight, model[49].weight)  # type: ignore[arg-type]
        m.delete(step=5)
        assert m.steps() == []


def test_older_step_that_retention_would_delete_is_refused_before_upload(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with objckpt.CheckpointManager(root, keep_last=2, keep_every=10, storage_options=opts) as m:
        for step in range(11, 16):
            m.save(step, _state(step))
    with CountingProxy(moto_endpoint) as proxy:
        m = objckpt.CheckpointManager(root, keep_last=2, keep_every=10,
                                      storage_options={**opts, "endpoint_url": proxy.url})
        with pytest.raises(StepOrderError, match=r"step 12 is older than the latest step 15.*keep_last=2.*not saved"):
            m.save(12, _state(12))
        with pytest.raises(StepOrderError, match="step 3 is older"):
            m.save(3, _state(3))
        assert not [r for r in proxy.requests if r.method in ("PUT", "POST")], proxy.requests  # nothing uploaded
        m.save(10, _state(10))  # older, but keep_every=10 keeps it: saved and kept
        m.save(16, _state(16))
        m.wait()
        assert m.steps() == [10, 15, 16]
        m.close()
    # without a rule that deletes, an older step is harmless: saved (latest_step() stays the newest)
    with objckpt.CheckpointManager(root, storage_options=opts) as keep_all:
        keep_all.save(12, _state(12))
        assert keep_all.latest_step() == 16 and 12 in keep_all.steps()
    # a resumed job knows the steps from the index: refused there too (in a fresh process:
    # tests/test_manager_naming.py)
    resumed = objckpt.CheckpointManager(root, keep_last=1, storage_options=opts)
    with pytest.raises(StepOrderError, match="step 14 is older than the latest step 16"):
        resumed.save(14, _state(14))
    resumed.close()
    assert "step-0000000014" not in _step_folders(bucket, opts)


def test_retention_deletes_are_logged_at_info_with_the_step_and_why(
        moto_s3: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    losses = {1: 0.5, 2: 0.1, 3: 0.4, 4: 0.3, 5: 0.2}
    with caplog.at_level(logging.INFO, logger="objckpt.manager"):
        with objckpt.CheckpointManager(root, keep_last=2, keep_best=1, best_key="loss", best_mode="min",
                                       storage_options=opts) as m:
            for step, loss in losses.items():
                m.save(step, _state(step), metadata={"loss": loss})
            m.wait()
            assert m.steps() == [2, 4, 5]
    deletes = {int(found.group(1)): r.getMessage() for r in caplog.records
               if r.name == "objckpt.manager" and r.levelno == logging.INFO
               and (found := re.search(r"retention deleted step (\d+) ", r.getMessage()))}
    assert sorted(deletes) == [1, 3], caplog.text
    assert "step-0000000003" in deletes[3]
    assert "not among the 2 newest (keep_last=2: 4, 5)" in deletes[3]
    assert "not among the 1 best by 'loss' (min" in deletes[3] and "(loss=0.4)" in deletes[3]
    # a step dropped at once because another writer saved newer steps is a warning naming it
    caplog.clear()
    other = objckpt.CheckpointManager(root, storage_options=opts)
    small = objckpt.CheckpointManager(f"s3://{bucket}/run", keep_last=1, storage_options=opts)
    assert small.should_save(6)  # knows 5 as the newest
    other.save(50, _state(50))
    with caplog.at_level(logging.INFO, logger="objckpt.manager"):
        small.save(6, _state(6))
        small.wait()
    assert any(r.levelno == logging.WARNING and "step 6" in r.getMessage() and "dropped it at once" in r.getMessage()
               for r in caplog.records), caplog.text
    assert small.steps() == [50]
    other.close()
    small.close()


def test_save_every_and_should_save(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with CountingProxy(moto_endpoint) as proxy:
        m = objckpt.CheckpointManager(root, save_every=5, storage_options={**opts, "endpoint_url": proxy.url})
        assert [s for s in range(1, 21) if m.should_save(s)] == [5, 10, 15, 20]
        assert len(proxy.requests) <= 3, proxy.requests  # one look for an index (none yet: a LIST), then none
        for step in range(1, 13):
            m.save(step, _state(step))  # off the interval: skipped, nothing written
        assert m.steps() == [5, 10]
        assert not m.should_save(10) and not m.should_save(5) and m.should_save(15)
        assert m.save(12, _state(12), force=True) is None and m.steps() == [5, 10, 12]
        proxy.reset()
        for step in range(13, 200):
            m.should_save(step)
        assert proxy.requests == []  # no request per step
        m.close()
    with pytest.raises(RetentionPolicyError, match="save_every"):
        objckpt.CheckpointManager(root, save_every=0, storage_options=opts)
    with CountingProxy(moto_endpoint) as proxy:
        resumed = objckpt.CheckpointManager(root, save_every=5, storage_options={**opts, "endpoint_url": proxy.url})
        assert not resumed.should_save(10) and resumed.should_save(15)
        assert [s for s in range(13, 100) if resumed.should_save(s)] == list(range(15, 100, 5))
        assert len(proxy.requests) <= 3 and "LIST" not in proxy.counts(), proxy.requests  # the index: two GETs
        resumed.close()


def test_keep_every_seconds_keeps_one_step_per_interval_for_ever(moto_s3: tuple[str, dict[str, Any]]) -> None:
    """A step every 20 minutes (an injected clock: no sleeping) with keep_last=2 and one step
    an hour kept for ever: 0, 3, 6, 9 stay, with the two newest."""
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    now = [1_700_000_000.0]
    with objckpt.CheckpointManager(root, keep_last=2, keep_every_seconds=3600, clock=lambda: now[0],
                                   storage_options=opts) as m:
        for step in range(0, 14):
            m.save(step, _state(step))
            m.wait()
            now[0] += 1200
            hourly = {s for s in range(step + 1) if s % 3 == 0}
            assert set(m.steps()) == hourly | {max(step - 1, 0), step}, (step, m.steps())
        assert [e.time - 1_700_000_000.0 for e in m.entries()] == [0, 3600, 7200, 10800, 14400, 14400 + 1200]
    # the times are the index's: a fresh manager's prune keeps the same steps
    again = objckpt.CheckpointManager(root, keep_last=2, keep_every_seconds=3600, storage_options=opts)
    assert again.prune(dry_run=True).deleted == [] and again.steps() == [0, 3, 6, 9, 12, 13]
    again.close()
    with pytest.raises(RetentionPolicyError, match="keep_every_seconds"):
        RetentionPolicy(keep_every_seconds=0)
    # pure: a step kept by the time rule stays kept as later steps arrive
    entries: list[tuple[int, dict[str, Any], float]] = [(s, {}, 100.0 * s) for s in range(40)]
    kept = steps_to_keep(RetentionPolicy(keep_every_seconds=250), entries[:20])
    assert {0, 3, 6, 9, 12, 15, 18} <= kept and kept <= steps_to_keep(RetentionPolicy(keep_every_seconds=250),
                                                                      entries) | {19}


def test_best_step_and_iterable_entries(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    metrics = {1: (0.9, 0.1), 2: (0.3, 0.7), 3: (0.5, 0.8), 4: (0.6, 0.2)}
    with objckpt.CheckpointManager(root, best_key="loss", best_mode="min", storage_options=opts) as m:
        assert m.best_step() is None
        for step, (loss, acc) in metrics.items():
            m.save(step, _state(step), metadata={"loss": loss, "acc": acc})
        m.save(5, _state(5), metadata={"note": "no metrics"})
        assert m.best_step() == 2
        assert m.best_step("acc", "max") == 3 and m.best_step(key="loss", mode="max") == 1
        entries = m.entries()
        assert [e.step for e in entries] == [1, 2, 3, 4, 5] and len(entries) == 5
        assert all(e.bytes > 0 and e.time > 0 for e in entries)
        assert [e.metadata.get("acc") for e in entries] == [0.1, 0.7, 0.8, 0.2, None]
    fresh = objckpt.CheckpointManager(root, storage_options=opts)
    with pytest.raises(RetentionPolicyError, match="best_step"):
        fresh.best_step()
    assert fresh.best_step("acc") == 3
    st = _state(0)
    fresh.load(st, step=fresh.best_step("loss", "min"))
    assert_same(st, _state(2))
    fresh.close()


def test_telling_a_state_from_a_step_never_formats_the_state() -> None:
    """Every manager save and load asks whether its state argument looks like a step (swapped
    arguments); for a state dict that must not build the repr of every tensor (23 ms for 300
    tensors of 1M floats, more with optimizer state), only answer no."""
    from objckpt.manager.naming import check_step, looks_like_step

    calls = []

    class Counted:
        def __repr__(self) -> str:
            calls.append(1)
            return "counted"

    state = {"a": Counted(), "b": [Counted()]}
    assert not looks_like_step(state)
    assert not looks_like_step(-1) and not looks_like_step(True) and not looks_like_step(1.0)
    assert looks_like_step(3) and looks_like_step(torch.tensor(4))
    assert calls == []
    with pytest.raises(InvalidStepError, match="non-negative integer"):
        check_step(state)  # the error still describes what it got
