"""CheckpointManager against a real moto S3 over HTTP: retention, the step index, its repair, races."""
from __future__ import annotations

import threading
from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.errors import CheckpointExistsError, NotFoundError
from objckpt.manager.index import InvalidStepError, StepEntry, StepIndex
from objckpt.manager.retention import RetentionPolicy, RetentionPolicyError, steps_to_keep
from testkit.http_count import CountingProxy
from conftest import assert_same


def _keys(bucket: str, opts: dict[str, Any], prefix: str = "") -> list[str]:
    s3 = boto3.client("s3", **opts)
    out: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 8, generator=g), "b": torch.arange(step, step + 5), "step": step}


def test_keep_last_and_keep_every_leave_exactly_those_steps(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with objckpt.CheckpointManager(root, keep_last=3, keep_every=10, storage_options=opts) as m:
        for step in range(1, 21):
            m.save(step, _state(step), metadata={"loss": 1.0 / step})
        m.wait()
        assert m.steps() == [10, 18, 19, 20] and m.latest_step() == 20
    keys = _keys(bucket, opts)
    steps_left = sorted({k.split("/")[1] for k in keys if k.split("/")[1].startswith("step-")})
    assert steps_left == ["step-0000000010", "step-0000000018", "step-0000000019", "step-0000000020"]
    # nothing of a deleted step is left: every remaining key is the index or one of those four
    assert all(k.split("/")[1] in steps_left or k.split("/")[1] == "_objckpt_index" for k in keys), keys
    fresh = objckpt.CheckpointManager(root, storage_options=opts)
    st = {"w": torch.zeros(32, 8), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    fresh.load(st)
    assert_same(st, _state(20))
    fresh.load(st, step=10)
    assert_same(st, _state(10))
    fresh.close()


def test_keep_best_by_metadata(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.1, 5: 0.7, 6: 0.8}
    with objckpt.CheckpointManager(f"s3://{bucket}/r", keep_last=1, keep_best=2, best_key="loss", best_mode="min",
                                   storage_options=opts) as m:
        for step, loss in losses.items():
            m.save(step, _state(step), metadata={"loss": loss})
        m.wait()
        assert m.steps() == [2, 4, 6]  # the two lowest losses and the newest
        entries = {e.step: e for e in m.entries().steps}
        assert entries[4].metadata == {"loss": 0.1} and entries[4].bytes > 0 and entries[4].time > 0
    with pytest.raises(RetentionPolicyError, match="best_key"):
        objckpt.CheckpointManager(f"s3://{bucket}/r2", keep_best=1, storage_options=opts)
    assert steps_to_keep(RetentionPolicy(keep_best=1, best_key="acc"), [(1, {"acc": 0.5}), (2, {"acc": 0.9}),
                                                                       (3, {}), (4, {"acc": 0.1})]) == {2, 4}


def test_fresh_manager_latest_step_costs_at_most_4_requests_and_no_list(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in (5, 10, 15):
            m.save(step, _state(step))
    with CountingProxy(moto_endpoint) as proxy:
        fresh = objckpt.CheckpointManager(root, storage_options={**opts, "endpoint_url": proxy.url})
        assert fresh.latest_step() == 15
        reqs = proxy.requests
        fresh.close()
    kinds = [r.kind for r in reqs]
    # the hint, the next version (404), the bucket check behind that 404, the newest step's manifest
    assert "LIST" not in kinds and len(reqs) <= 4, reqs
    assert any(r.path.endswith("/_objckpt_index/head.json") and r.status == 200 for r in reqs), reqs
    assert any(r.path.endswith("/step-0000000015/manifest.json") and r.method == "HEAD" for r in reqs), reqs


def test_missing_or_corrupt_head_falls_back_to_one_listing_and_repairs(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    s3 = boto3.client("s3", **opts)
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step), metadata={"n": step})
    head = "run/_objckpt_index/head.json"
    proxy = CountingProxy(moto_endpoint).start()
    popts = {**opts, "endpoint_url": proxy.url}
    for damage in ("stale", "missing", "corrupt", "no-index-at-all"):
        if damage == "stale":  # a hint behind the chain (its writer died between its two PUTs): walk forward
            first = s3.get_object(Bucket=bucket, Key="run/_objckpt_index/v-000000000000.json")["Body"].read()
            s3.put_object(Bucket=bucket, Key=head, Body=first)
        elif damage == "missing":
            s3.delete_object(Bucket=bucket, Key=head)
        elif damage == "corrupt":
            s3.put_object(Bucket=bucket, Key=head, Body=b'{"kind": "objckpt-step-index", "seq": 9')
        else:
            doomed = _keys(bucket, opts, "run/_objckpt_index/")
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in doomed]})
        proxy.reset()
        fresh = objckpt.CheckpointManager(root, storage_options=popts)
        assert fresh.latest_step() == 3, damage
        assert proxy.counts().get("LIST", 0) == (0 if damage == "stale" else 1), (damage, proxy.requests)
        proxy.reset()
        assert fresh.steps() == [1, 2, 3]  # repaired: no LIST any more
        assert "LIST" not in proxy.counts(), (damage, proxy.requests)
        assert [e.metadata for e in fresh.entries().steps] == [{"n": 1}, {"n": 2}, {"n": 3}]
        fresh.close()
    proxy.stop()


def test_two_managers_racing_lose_no_committed_step(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    managers = [objckpt.CheckpointManager(root, storage_options=opts) for _ in range(2)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for step in range(i, 16, 2):
                managers[i].save(step, _state(step))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for m in managers:
        m.close()
    assert objckpt.CheckpointManager(root, storage_options=opts).steps() == list(range(16))


def test_concurrent_index_writers_lose_no_update(moto_s3: tuple[str, dict[str, Any]]) -> None:
    """Four writers adding 4 steps each at once: the create-only chain serialises them."""
    bucket, opts = moto_s3
    store, prefix = objckpt.storage.open_store(f"s3://{bucket}/idx", opts)
    index = StepIndex(store, prefix)

    async def writer(i: int) -> None:
        for j in range(4):
            await index.add(StepEntry(i * 100 + j))

    async def all_writers() -> None:
        import asyncio

        await asyncio.gather(*(writer(i) for i in range(4)))

    _runtime.run(all_writers())
    doc = _runtime.run(index.read())
    assert doc.step_numbers() == sorted(i * 100 + j for i in range(4) for j in range(4))
    assert doc.seq == 15  # one version per update: none overwritten


def test_retention_never_deletes_a_step_another_manager_is_writing(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    big = {"w": torch.randn(1 << 21)}  # 8 MiB: the upload takes a while on moto
    slow = objckpt.CheckpointManager(root, async_save=True, storage_options=opts)
    fast = objckpt.CheckpointManager(root, keep_last=1, storage_options=opts)
    fast.save(1, _state(1))  # before slow's step 50 exists: fast knows step 1 as the newest
    slow.save(50, big)
    for step in (2, 3):
        fast.save(step, _state(step))
    fast.wait()
    slow.wait()
    st = {"w": torch.zeros(1 << 21)}
    slow.load(st, step=50)
    assert_same(st, big)
    assert 50 in slow.steps()
    with pytest.raises(CheckpointExistsError):
        slow.save(50, big)
        slow.wait()
    slow.close()
    fast.close()


def test_bad_input_names_the_step(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    with objckpt.CheckpointManager(f"s3://{bucket}/run", storage_options=opts) as m:
        with pytest.raises(NotFoundError, match="no committed step"):
            m.load({"w": torch.zeros(2)})
        with pytest.raises(InvalidStepError, match="non-negative integer, got -1"):
            m.save(-1, {"w": torch.zeros(2)})
        with pytest.raises(InvalidStepError, match="got 1.5"):
            m.save(1.5, {"w": torch.zeros(2)})  # type: ignore[arg-type]
        with pytest.raises(RetentionPolicyError, match="keep_last"):
            objckpt.CheckpointManager(f"s3://{bucket}/x", keep_last=0, storage_options=opts)
        m.save(7, {"w": torch.zeros(2)})
        m.delete(7)
        assert m.steps() == [] and m.latest_step() is None
        with pytest.raises(NotFoundError, match="step-0000000007"):
            m.delete(7)
        with pytest.raises(NotFoundError, match="step-0000000008"):
            m.load({"w": torch.zeros(2)}, step=8)


def test_commit_without_index_update_is_never_replaced_but_adopted(moto_s3: tuple[str, dict[str, Any]]) -> None:
    """What a save killed after its manifest but before its index update leaves: a committed,
    unindexed step.  Nothing stored proves that it is stale (the same state as a second job
    writing this root), so saving that step again raises CheckpointExistsError and leaves it
    as it is; the step is adopted into the index; reindex adopts the others."""
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        m.save(2, _state(2))
        objckpt.save(_state(99), f"{root}/step-0000000003", storage_options=opts)  # committed, never indexed
        objckpt.save(_state(4), f"{root}/step-0000000004", storage_options=opts, metadata={"k": 4})
        assert m.latest_step() == 2
        with pytest.raises(CheckpointExistsError, match="step 3 is already committed.*not replaced.*now indexed"):
            m.save(3, _state(3))
        st = _state(0)
        m.load(st, step=3)
        assert_same(st, _state(99))  # untouched
        assert m.steps() == [2, 3]
        with pytest.raises(CheckpointExistsError, match="step 3 is already committed") as ei:
            m.save(3, _state(3))
        assert "not in the index" not in str(ei.value)
        assert m.reindex() == [2, 3, 4] and m.latest_step() == 4
        assert m.entries().get(4).metadata == {"k": 4}


def test_damaged_versions_are_repaired_from_the_manifests(tmp_path: Any) -> None:
    """A version after the hint that is garbage, or holds the wrong sequence number (a walk
    that would never end), is detected; the index is rebuilt from the manifests."""
    root = str(tmp_path / "run")
    with objckpt.CheckpointManager(root) as m:
        for step in (1, 2):
            m.save(step, _state(step), metadata={"s": step})
    idx = tmp_path / "run" / "_objckpt_index"
    v0 = (idx / "v-000000000000.json").read_bytes()
    head = (idx / "head.json").read_bytes()  # seq 1
    for bad in (b"garbage", v0):  # v0's document under the name of version 2
        (idx / "v-000000000002.json").write_bytes(bad)
        (idx / "head.json").write_bytes(head)
        fresh = objckpt.CheckpointManager(root)
        assert fresh.steps() == [1, 2]
        assert [e.metadata for e in fresh.entries().steps] == [{"s": 1}, {"s": 2}]
        fresh.save(3, _state(3))
        assert fresh.steps() == [1, 2, 3]
        fresh.close()
        objckpt.CheckpointManager(root).delete(3)
        for v in idx.glob("v-*.json"):
            if v.name > "v-000000000002.json":
                v.unlink()
