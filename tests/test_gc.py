"""Garbage collection: what crashed saves leave goes, what any checkpoint uses stays."""
from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.cli import main
from objckpt.format import keys as layout
from objckpt.format.manifest import Blob, Manifest, Mesh, RankIndexRef, TensorEntry, TensorLayout, encode
from objckpt.ops.gc import attempt_time, collect_garbage
from objckpt.storage import open_store
from objckpt.storage.memory import MemoryStore

OLD = "20200101T000000-0123456789ab"  # an attempt id from long ago


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(12.0).reshape(4, 3) + step, "step": step}


def test_attempt_time_reads_the_id() -> None:
    assert attempt_time(OLD) == 1577836800.0
    assert attempt_time("garbage") is None
    assert abs(attempt_time(layout.new_attempt_id()) - time.time()) < 5  # type: ignore[operator]


def test_gc_on_local_files_via_cli(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    ck1, ck2 = str(run / "step-1"), str(run / "step-2")
    objckpt.save(_state(1), ck1)
    objckpt.save(_state(2), ck2)
    objckpt.save(_state(3), ck2, overwrite=True)  # the replaced blobs are deleted by the save itself
    # what a killed save leaves: an old attempt's blob, a stray manifest temporary, a
    # blob of a save that never committed (no manifest at all), and a young one (in progress)
    for rel in (f"step-1/blobs/{OLD}/r00000-0000.bin", f"step-9/blobs/{OLD}/r00001-0000.bin",
                "step-2/manifest.json.tmp-abc", f"step-1/blobs/{layout.new_attempt_id()}/r00000-0000.bin"):
        p = run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 100)
    old = time.time() - 30 * 3600
    os.utime(run / "step-2" / "manifest.json.tmp-abc", (old, old))
    before = sorted(p for p in run.rglob("*") if p.is_file())

    assert main(["gc", str(run), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete" in out and "2 checkpoint(s)" in out and "would delete 3 object(s)" in out
    assert sorted(p for p in run.rglob("*") if p.is_file()) == before  # dry run deletes nothing

    assert main(["gc", str(run)]) == 0
    out = capsys.readouterr().out
    assert "deleted 3 object(s)" in out and "1 younger than 6 h kept" in out
    left = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}
    assert not any(OLD in k or ".tmp-" in k for k in left)
    assert any("step-1/blobs/" in k for k in left)  # the young one
    assert torch.equal(objckpt.read(ck1)["w"], _state(1)["w"]) and objckpt.read(ck2)["step"] == 3
    assert main(["verify", ck1]) == 0 and main(["verify", ck2]) == 0


def test_gc_keeps_v2_rank_indexes_and_skips_unreadable_manifests() -> None:
    st = MemoryStore()
    attempt = OLD
    refs = [RankIndexRef(layout.index_name(attempt, r), 1, 0) for r in range(2)]
    blobs = [Blob(layout.blob_name(attempt, r, 0), 1, r) for r in range(2)]
    m = Manifest({"w": TensorEntry("w", "float32", (2,), layout=TensorLayout(0, ("S0",)))}, blobs, None, attempt=attempt,
                 world_size=2, meshes=[Mesh((2,), (0, 1))], rank_indexes=refs, format_version=2)
    objs = {"a/manifest.json": encode(m), "b/manifest.json": b"{broken"}
    for name in [b.name for b in blobs] + [r.name for r in refs] + [layout.blob_name(OLD[:-1] + "c", 0, 0)]:
        objs[f"a/{name}"] = b"x"
        objs[f"b/{name}"] = b"x"
    st.objects.update(objs)
    r = _runtime.run(collect_garbage(st, ""))
    assert r.deleted == [f"a/{layout.blob_name(OLD[:-1] + 'c', 0, 0)}"]  # only a's unreferenced blob
    assert r.unreadable == ["b/manifest.json"] and r.checkpoints == 1
    assert all(f"a/{ref.name}" in st.objects for ref in refs)


def test_gc_aborts_stale_multipart_uploads_on_s3(moto_s3: Any) -> None:
    import boto3

    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/ck"
    objckpt.save(_state(1), uri, storage_options=opts)
    s3 = boto3.client("s3", **opts)
    stale = s3.create_multipart_upload(Bucket=bucket, Key=f"run/ck/blobs/{OLD}/r00000-0000.bin")["UploadId"]
    young_key = f"run/ck/blobs/{layout.new_attempt_id()}/r00000-0000.bin"
    s3.create_multipart_upload(Bucket=bucket, Key=young_key)
    s3.put_object(Bucket=bucket, Key=f"run/ck/blobs/{OLD}/r00001-0000.bin", Body=b"junk")
    store, prefix = open_store(f"s3://{bucket}/run", opts)
    r = _runtime.run(collect_garbage(store, prefix))
    assert r.aborted_uploads == [f"run/ck/blobs/{OLD}/r00000-0000.bin"]
    assert r.deleted == [f"run/ck/blobs/{OLD}/r00001-0000.bin"] and r.kept_young == 1
    left = [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    assert left == [young_key] and stale not in str(left)
    assert torch.equal(objckpt.read(uri, storage_options=opts)["w"], _state(1)["w"])


def _files(root: Any) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_gc_keeps_a_checkpoint_under_a_folder_named_blobs_on_local_files(tmp_path: Any) -> None:
    """A folder named ``blobs`` above a checkpoint is not its blob dir (issue item 5)."""
    ck = tmp_path / "team" / "blobs" / "ck1"
    objckpt.save(_state(1), str(ck))
    committed = _files(ck)
    orphans = [ck / f"blobs/{OLD}/r00000-0000.bin", tmp_path / f"team/blobs/ck2/blobs/{OLD}/r00000-0000.bin",
               ck / f"blobs/{OLD}/r00001.index.json.tmp-0a1b2c"]  # a killed local put's temporary
    notes = tmp_path / "team" / "blobs" / "notes.txt"  # a user's file, not anything a save wrote
    for p in orphans + [notes]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 10)

    store, prefix = open_store(str(tmp_path / "team"))
    r = _runtime.run(collect_garbage(store, prefix, grace=0))
    assert r.checkpoints == 1 and len(r.deleted) == 3 and not any(p.exists() for p in orphans)
    assert _files(ck) == committed and notes.exists()  # bit-exact, and the user's file stays
    assert main(["gc", str(tmp_path), "--grace-hours", "0"]) == 0
    assert _files(ck) == committed
    assert torch.equal(objckpt.read(str(ck))["w"], _state(1)["w"])


def test_gc_keeps_a_checkpoint_under_a_folder_named_blobs_on_s3(moto_s3: Any) -> None:
    import boto3

    bucket, opts = moto_s3
    uri = f"s3://{bucket}/team/blobs/ck1"
    objckpt.save(_state(1), uri, storage_options=opts)
    s3 = boto3.client("s3", **opts)

    def objects() -> dict[str, bytes]:
        listed = s3.list_objects_v2(Bucket=bucket, Prefix="team/").get("Contents", [])
        return {o["Key"]: s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}

    committed = objects()
    orphan = f"team/blobs/ck1/blobs/{OLD}/r00000-0000.bin"
    s3.put_object(Bucket=bucket, Key=orphan, Body=b"junk")
    store, prefix = open_store(f"s3://{bucket}/team", opts)
    r = _runtime.run(collect_garbage(store, prefix, grace=0))
    assert r.deleted == [orphan] and r.checkpoints == 1
    assert objects() == committed
    assert main(["gc", f"s3://{bucket}", "--grace-hours", "0", "--endpoint-url", opts["endpoint_url"]]) == 0
    assert objects() == committed
    assert torch.equal(objckpt.read(uri, storage_options=opts)["w"], _state(1)["w"])
