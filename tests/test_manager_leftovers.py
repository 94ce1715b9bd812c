"""What the manager does about objects nobody indexes: leftovers of killed saves under a step
that retention deletes, and steps whose folder was deleted by hand."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.errors import NotFoundError
from objckpt.storage import open_store
from conftest import assert_same
from mp import run_multiprocess

#: a save killed (the process exits at once) when it is about to ``die_at``: ``manifest``
#: (every blob is up, nothing committed) or ``complete`` (two 6 MiB blobs in 5 MiB parts: the
#: second completion never happens, so one blob is stored and a multipart upload is left open)
KILLED_SAVE = r"""
import asyncio, json, os, sys, torch, objckpt
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore
uri, opts, die_at, n = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])

class Dies(CountingStore):
    async def put(self, key, data, *, if_absent=False):
        if die_at == "manifest" and key.endswith("manifest.json"):
            os._exit(9)
        await super().put(key, data, if_absent=if_absent)

    def open_writer(self, key, size, num_parts=1):
        w = super().open_writer(key, size, num_parts)
        if die_at == "complete":
            done = w.complete
            async def complete():
                if self.ops["complete"] >= 1:  # the second blob: once the first is stored, die
                    while not stored:
                        await asyncio.sleep(0.01)
                    os._exit(9)
                await done()
                stored.append(key)
            w.complete = complete
        return w

stored = []
big = {"blob_size": 6 << 20, "part_size": 5 << 20} if die_at == "complete" else {}
objckpt.save({"w": torch.randn(n)}, uri, store=Dies(open_store(uri, opts)[0]), **big)
"""


def _kill_a_save(uri: str, opts: dict[str, Any], die_at: str, n: int = 4096) -> None:
    r = subprocess.run([sys.executable, "-c", KILLED_SAVE, uri, json.dumps(opts), die_at, str(n)], timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 9, r


def _under(root: str, opts: dict[str, Any], step: int) -> tuple[list[str], list[str]]:
    """(object keys, unfinished upload keys) under ``step``'s prefix."""
    store, prefix = open_store(root, opts)
    p = f"{prefix}/step-{step:010d}/" if prefix else f"step-{step:010d}/"
    objs = [o.key for o in _runtime.run(store.list(p))]
    return objs, [u.key for u in _runtime.run(store.list_uploads(p))]


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


def test_retention_removes_killed_saves_leftovers_with_the_step(local_or_s3: tuple[str, dict[str, Any]]) -> None:
    """A save of step 2 killed before its commit (and, on S3, one killed inside a multipart
    upload) leaves objects under step 2; the restarted job saves step 2 beside them (no
    manifest: nothing to prove), and when retention deletes step 2 nothing is left under it.
    Within the grace period the leftovers are kept (they might be a save in progress)."""
    uri, opts = local_or_s3
    root = uri + "-root"
    step2 = f"{root}/step-0000000002"
    if opts:  # S3, multipart as on AWS: a stored blob and an open multipart upload
        _kill_a_save(step2, {**opts, "endpoint_kind": "s3"}, "complete", n=3 << 20)
        assert _under(root, opts, 2)[1]
    else:
        _kill_a_save(step2, opts, "manifest")
    killed = _under(root, opts, 2)[0]
    assert killed and not any(k.endswith("manifest.json") for k in killed)

    careful = objckpt.CheckpointManager(root, keep_last=1, storage_options=opts)  # default grace: 6 h
    careful.save(2, _state(2))  # reuses the prefix beside the leftovers
    careful.save(3, _state(3))
    careful.wait()
    assert careful.steps() == [3]
    objs, _ = _under(root, opts, 2)
    assert set(killed) <= set(objs)  # young: kept, and queued for a later sweep
    assert 2 in careful._worker.pending  # type: ignore[union-attr]
    careful.close()

    # step 2 exists again (the leftovers still beside it), saved by a manager without retention
    # (one with keep_last=1 refuses a step that retention would delete at once)
    with objckpt.CheckpointManager(root, storage_options=opts) as keeps_all:
        keeps_all.save(2, _state(2))
    m = objckpt.CheckpointManager(root, keep_last=1, storage_options=opts, leftover_grace=0)
    m.save(4, _state(4))  # then retention drops 2 and 3
    m.wait()
    assert m.steps() == [4]
    assert m._worker.last_retention.deleted == [2, 3]  # type: ignore[union-attr]
    assert m._worker.last_retention.leftovers >= len(killed)  # type: ignore[union-attr]
    assert _under(root, opts, 2) == ([], [])  # nothing of the deleted step is left
    if not opts:
        assert not os.path.exists(os.path.join(root, "step-0000000002"))  # not even its folders
    st = {"w": torch.zeros(256), "step": 0}
    m.load(st)
    assert_same(st, _state(4))
    m.close()


def _delete_step_by_hand(root: str, opts: dict[str, Any], step: int) -> None:
    if not opts:
        shutil.rmtree(os.path.join(root, f"step-{step:010d}"))
        return
    store, _ = open_store(root, opts)
    objs, _ = _under(root, opts, step)
    _runtime.run(store.delete(objs))


def test_step_deleted_by_hand_falls_back_to_the_newest_that_exists(
        local_or_s3: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    uri, opts = local_or_s3
    root = uri + "-root"
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in (1, 2, 3, 4):
            m.save(step, _state(step))
    _delete_step_by_hand(root, opts, 4)
    _delete_step_by_hand(root, opts, 3)
    fresh = objckpt.CheckpointManager(root, storage_options=opts)
    with caplog.at_level(logging.WARNING, logger="objckpt.manager"):
        assert fresh.latest_step() == 2
    assert any("[3, 4]" in r.getMessage() and "latest step is 2" in r.getMessage() for r in caplog.records)
    st = {"w": torch.zeros(256), "step": 0}
    fresh.load(st)
    assert_same(st, _state(2))
    assert fresh.steps() == [1, 2]  # dropped from the index, for every later reader too
    assert objckpt.CheckpointManager(root, storage_options=opts).steps() == [1, 2]
    _delete_step_by_hand(root, opts, 2)
    assert fresh.reindex() == [1]
    with pytest.raises(NotFoundError, match="step-0000000002"):
        fresh.load(st, step=2)
    fresh.save(5, _state(5))
    assert fresh.latest_step() == 5
    fresh.close()


def _ranks_load_latest(rank: int, world: int, root: str) -> tuple[Any, int]:
    m = objckpt.CheckpointManager(root)
    st = {"w": torch.zeros(256), "step": 0}
    m.load(st)
    out = (m.latest_step(), st["step"])
    m.close()
    return out


def test_every_rank_falls_back_to_the_same_step(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    with objckpt.CheckpointManager(root) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    shutil.rmtree(os.path.join(root, "step-0000000003"))
    assert run_multiprocess(2, _ranks_load_latest, root) == [(2, 2), (2, 2)]

