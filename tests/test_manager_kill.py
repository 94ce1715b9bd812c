"""A training process SIGKILLed in the middle of a manager save (real process, real moto S3)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import boto3
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.ops.gc import collect_garbage
from objckpt.storage import open_store
from conftest import assert_same

CHILD = r"""
import json, sys, torch, objckpt
root, opts = sys.argv[1], json.loads(sys.argv[2])
m = objckpt.CheckpointManager(root, keep_last=2, storage_options=opts)
m.save(1, {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), "step": 1})
print("committed 1", flush=True)
m.save(2, {"w": torch.randn(16 << 20), "step": 2})  # 64 MiB: a multipart upload moto takes a while over
print("committed 2", flush=True)
"""


def test_sigkill_during_upload_leaves_previous_step_latest_and_gc_cleans(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    s3 = boto3.client("s3", **opts)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # multipart, as on AWS: on moto objckpt would otherwise write single-PUT blobs (objckpt.storage.shape)
    child_opts = {**opts, "endpoint_kind": "s3"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, json.dumps(child_opts)], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "committed 1"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once step 2's upload is under way
            ups = s3.list_multipart_uploads(Bucket=bucket, Prefix="run/step-0000000002/").get("Uploads", [])
            if ups:
                break
            assert child.poll() is None, "the child finished before it could be killed"
            time.sleep(0.02)
        else:
            raise AssertionError("step 2's upload never started")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    leftovers = s3.list_objects_v2(Bucket=bucket, Prefix="run/step-0000000002/").get("Contents", [])
    assert not any(o["Key"].endswith("manifest.json") for o in leftovers)

    m = objckpt.CheckpointManager(root, storage_options=opts)
    assert m.latest_step() == 1 and m.steps() == [1]
    st = {"w": torch.zeros(64, 64), "step": 0}
    m.load(st)
    assert_same(st, {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), "step": 1})
    m.close()

    store, prefix = open_store(root, opts)
    report = _runtime.run(collect_garbage(store, prefix, grace=0))
    assert report.aborted_uploads, report  # the killed multipart upload
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads", []) == []
    assert s3.list_objects_v2(Bucket=bucket, Prefix="run/step-0000000002/").get("KeyCount", 0) == 0
    # step 1 and the index are untouched by gc
    assert objckpt.CheckpointManager(root, storage_options=opts).steps() == [1]


EXITING = r"""
import sys, torch, objckpt
m = objckpt.CheckpointManager(sys.argv[1], keep_last=1, async_save=True)
for s in range(1, 4):
    m.save(s, {"w": torch.full((1 << 16,), float(s))})
# no wait(), no close(): the interpreter exits with a save in flight and index/retention jobs queued
"""


def test_exit_without_wait_still_commits_indexes_and_prunes(tmp_path: Any) -> None:
    root = tmp_path / "run"
    subprocess.run([sys.executable, "-c", EXITING, str(root)], check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert sorted(p.name for p in root.iterdir()) == ["_objckpt_index", "step-0000000003"]
    m = objckpt.CheckpointManager(str(root))
    assert m.steps() == [3]
    st = {"w": torch.zeros(1 << 16)}
    m.load(st)
    assert torch.equal(st["w"], torch.full((1 << 16,), 3.0))
    m.close()


OLD_JOB = r"""
import json, sys, torch, objckpt
m = objckpt.CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]))
for s in range(1, 100):
    m.save(s, {"w": torch.full((256,), float(s))})
    print(f"indexed {s}", flush=True)  # save() returned: committed and in the index
"""


def test_restarted_job_beside_a_dying_one_loses_no_indexed_step(moto_s3: tuple[str, dict[str, Any]]) -> None:
    """The old job keeps saving while the restarted one saves too, then is SIGKILLed:
    every step either reported as indexed is still in the index, and nothing indexed is dangling."""
    import threading

    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    old = subprocess.Popen([sys.executable, "-c", OLD_JOB, root, json.dumps(opts)], stdout=subprocess.PIPE,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    reported: list[int] = []
    two = threading.Event()

    def read() -> None:
        assert old.stdout is not None
        for line in old.stdout:
            reported.append(int(line.split()[1]))
            if len(reported) >= 2:
                two.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert two.wait(120), "the old job never saved"
        new = objckpt.CheckpointManager(root, storage_options=opts)
        for step in range(100, 105):
            new.save(step, {"w": torch.full((256,), float(step))})
            if step == 102:
                old.send_signal(signal.SIGKILL)
        old.wait(timeout=30)
        reader.join(timeout=10)
    finally:
        if old.poll() is None:
            old.kill()
    assert old.returncode == -signal.SIGKILL and reported
    indexed = new.steps()
    assert set(reported) | set(range(100, 105)) <= set(indexed), (reported, indexed)
    s3 = boto3.client("s3", **opts)
    for step in indexed:  # nothing indexed without its manifest
        s3.head_object(Bucket=bucket, Key=f"run/step-{step:010d}/manifest.json")
    new.close()
