"""``objckpt rm | prune | gc`` on checkpoints a real Lightning Trainer wrote through the plugin.

On object stores the plugin writes a marker object at each checkpoint's path (the
checkpoint is the prefix under it): it is what Lightning's fsspec checks see.  The
marker belongs to the checkpoint (objckpt.ops.owned), so every command that deletes a
checkpoint deletes it, first, and ``gc`` removes one whose checkpoint is gone, never one
whose checkpoint is committed.  The commands run as ``python -m objckpt`` subprocesses
against a real moto S3 over HTTP; Lightning's own view (fsspec's ``exists``, ``fit(ckpt_path=
"last")``) and a listing of the bucket then say what is left.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
from lightning.fabric.utilities.cloud_io import get_filesystem

from objckpt.errors import NotFoundError
from objckpt.format.marker import read_marker
from objckpt.integrations.lightning_marker import marker_body
from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO
from objckpt.ops.delete import delete_checkpoint
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from objckpt.testing.stores import FaultyStore

from lightning_helpers import Tiny, data, trainer

REPO = pathlib.Path(__file__).resolve().parents[1]


def cli(opts: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m objckpt ARGS --endpoint-url ...`` in a new process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "objckpt", *args, "--endpoint-url", opts["endpoint_url"]],
                          capture_output=True, text=True, timeout=300, env=env)


def keys_under(bucket: str, opts: dict[str, Any], prefix: str) -> list[str]:
    """Every key equal to ``prefix`` or under ``prefix/`` (the marker and the checkpoint)."""
    r = boto3.client("s3", **opts).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(k for o in r.get("Contents", []) if (k := o["Key"]) == prefix or k.startswith(prefix + "/"))


def lightning_sees(path: str) -> bool:
    """Lightning's own existence check (``ModelCheckpoint.file_exists``: its fsspec
    filesystem's ``exists``), fsspec's cached listings dropped."""
    fs = get_filesystem(path)
    fs.invalidate_cache()
    return bool(fs.exists(path))


def marker_seen(path: str) -> bool:
    """Whether fsspec sees a file at ``path``: the marker, which Lightning dates checkpoints by
    (``modified``; a prefix alone has no date) and which the plugin's ``ckpt_path="last"``
    requires."""
    fs = get_filesystem(path)
    fs.invalidate_cache()
    return bool(fs.isfile(path))


def test_rm_deletes_the_marker_so_lightning_no_longer_sees_the_checkpoint(
        s3_run: tuple[str, str, dict[str, Any]]) -> None:
    bucket, run, opts = s3_run
    ckdir = f"{run}/checkpoints"
    cb = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer(4, [ObjckptCheckpointIO(opts)], [cb], default_root_dir=run).fit(Tiny(), data())
    last, step4 = f"{ckdir}/last.ckpt", f"{ckdir}/epoch=1-step=4.ckpt"
    assert lightning_sees(last) and "run/checkpoints/last.ckpt" in keys_under(bucket, opts, "run/checkpoints/last.ckpt")

    r = cli(opts, "rm", last)
    assert r.returncode == 0, r.stderr
    assert keys_under(bucket, opts, "run/checkpoints/last.ckpt") == []  # nothing of it is left, marker included
    assert not lightning_sees(last) and not marker_seen(last)
    assert "Lightning marker, manifest and" in r.stdout, r.stdout
    assert lightning_sees(step4) and ObjckptCheckpointIO(opts).load_checkpoint(step4)["global_step"] == 4


def test_prune_deletes_the_markers_of_the_steps_it_drops(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    bucket, run, opts = s3_run
    t = trainer(2, [ObjckptCheckpointIO(opts)], default_root_dir=run)
    t.fit(Tiny(), data())
    paths = [f"{run}/step-{s:010d}" for s in (1, 2, 3)]  # the names a CheckpointManager root holds
    for p in paths:
        t.save_checkpoint(p)
    assert all(lightning_sees(p) for p in paths)

    r = cli(opts, "prune", run, "--keep-last", "1")
    assert r.returncode == 0, r.stderr
    assert "deleted 2 of 3 step(s); kept [3]" in r.stdout, r.stdout
    assert [lightning_sees(p) for p in paths] == [False, False, True]
    assert keys_under(bucket, opts, "run/step-0000000001") == keys_under(bucket, opts, "run/step-0000000002") == []
    assert "run/step-0000000003" in keys_under(bucket, opts, "run/step-0000000003")
    assert ObjckptCheckpointIO(opts).load_checkpoint(paths[2])["global_step"] == 2


def test_gc_removes_a_marker_whose_checkpoint_is_gone_and_never_a_committed_ones(
        s3_run: tuple[str, str, dict[str, Any]]) -> None:
    bucket, run, opts = s3_run
    ckdir = f"{run}/checkpoints"
    cb = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=2, save_top_k=-1)
    trainer(6, [ObjckptCheckpointIO(opts)], [cb], default_root_dir=run).fit(Tiny(), data())
    names = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]
    gone, gone_too, kept = (f"run/checkpoints/{n}" for n in names)
    s3 = boto3.client("s3", **opts)
    # two checkpoints deleted as an older release deleted them (manifest and blobs, the
    # marker left), and two small objects that are no markers, one where a marker would be
    for key in [k for ck in (gone, gone_too) for k in keys_under(bucket, opts, ck) if k != ck]:
        s3.delete_object(Bucket=bucket, Key=key)
    s3.put_object(Bucket=bucket, Key="run/checkpoints/notes.ckpt", Body=b"not a marker")
    s3.put_object(Bucket=bucket, Key="run/readme.txt", Body=b"hello")
    assert lightning_sees(f"s3://{bucket}/{gone}")  # Lightning takes the stale marker for a checkpoint...
    with pytest.raises(NotFoundError):  # ...that cannot load
        ObjckptCheckpointIO(opts).load_checkpoint(f"s3://{bucket}/{gone}")

    r = cli(opts, "gc", run)  # the default grace period (6 h) keeps a marker written just now
    assert r.returncode == 0, r.stderr
    assert keys_under(bucket, opts, gone) == [gone]
    r = cli(opts, "gc", run, "--grace-hours", "0", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"would delete {gone} (Lightning marker of a deleted checkpoint)" in r.stdout, r.stdout
    assert keys_under(bucket, opts, gone) == [gone]

    r = cli(opts, "gc", run, "--grace-hours", "0")
    assert r.returncode == 0, r.stderr
    assert f"deleted {gone} (Lightning marker of a deleted checkpoint)" in r.stdout, r.stdout
    assert keys_under(bucket, opts, gone) == [] and not lightning_sees(f"s3://{bucket}/{gone}")
    assert keys_under(bucket, opts, gone_too) == []
    after = keys_under(bucket, opts, "run")
    assert {"run/checkpoints/notes.ckpt", "run/readme.txt", kept, f"{kept}/manifest.json"} <= set(after)
    assert lightning_sees(f"s3://{bucket}/{kept}")

    # gc of one checkpoint's own prefix judges the marker at that key: kept while committed
    r = cli(opts, "gc", f"s3://{bucket}/{kept}", "--grace-hours", "0")
    assert r.returncode == 0, r.stderr
    assert keys_under(bucket, opts, kept) == [k for k in after if k == kept or k.startswith(kept + "/")]
    assert ObjckptCheckpointIO(opts).load_checkpoint(f"s3://{bucket}/{kept}")["global_step"] == 6
    s3.delete_object(Bucket=bucket, Key=f"{kept}/manifest.json")  # now gone: its marker is garbage
    r = cli(opts, "gc", f"s3://{bucket}/{kept}", "--grace-hours", "0")
    assert r.returncode == 0, r.stderr
    assert f"deleted {kept} (Lightning marker of a deleted checkpoint)" in r.stdout, r.stdout
    assert keys_under(bucket, opts, kept) == []


@pytest.mark.parametrize("stopped_at", [2, 3], ids=["before-the-manifest", "before-the-blobs"])
def test_a_delete_stopped_midway_never_leaves_lightning_a_checkpoint_that_cannot_load(
        s3_run: tuple[str, str, dict[str, Any]], stopped_at: int) -> None:
    """The marker goes first: stopped before the manifest, the checkpoint is still whole (it
    loads, objckpt lists it) and Lightning no longer sees its marker; stopped after, only
    unreferenced objects are left, no marker, and gc removes them."""
    bucket, run, opts = s3_run
    t = trainer(2, [ObjckptCheckpointIO(opts)], default_root_dir=run)
    t.fit(Tiny(), data())
    path = f"{run}/x.ckpt"
    t.save_checkpoint(path)
    store, prefix = open_store(path, opts)
    with pytest.raises(ConnectionError, match="injected"):  # the marker's delete goes, the next one fails
        _runtime.run(delete_checkpoint(FaultyStore(store, "delete", nth=stopped_at), prefix, path))
    assert not marker_seen(path)
    if stopped_at == 2:
        assert ObjckptCheckpointIO(opts).load_checkpoint(path)["global_step"] == 2
        assert cli(opts, "ls", run).stdout.split() == [path]
        r = cli(opts, "rm", path)  # and the delete can be finished
    else:
        with pytest.raises(NotFoundError):
            ObjckptCheckpointIO(opts).load_checkpoint(path)
        r = cli(opts, "gc", run, "--grace-hours", "0")
    assert r.returncode == 0, r.stderr
    assert keys_under(bucket, opts, "run/x.ckpt") == []


class _Runs:
    """Unpickling this runs code (creates a file): a marker reader must never do it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_a_marker_is_recognised_by_reading_it_never_by_running_it(tmp_path: pathlib.Path) -> None:
    """What deletes and gc read at a checkpoint's key: the plugin's marker (and the JSON form of
    earlier releases) is one; a torch.save file, other bytes, and a pickle that would run code
    are not, and reading them runs nothing."""
    import io

    import torch

    assert read_marker(marker_body("run/x.ckpt/manifest.json", 1)) == {
        "objckpt": "lightning-checkpoint", "format": 1, "manifest": "run/x.ckpt/manifest.json"}
    assert read_marker(b'{"objckpt": "lightning-checkpoint", "format": 1}') is not None
    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(2)}}, buf)
    trap = io.BytesIO()
    torch.save(_Runs(str(tmp_path / "ran")), trap)
    for other in (buf.getvalue(), trap.getvalue(), b"not a marker", b'{"objckpt": "other"}', b"", b"PK\x03\x04"):
        assert read_marker(other) is None
    assert not (tmp_path / "ran").exists()
