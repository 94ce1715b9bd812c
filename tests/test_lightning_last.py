"""docs/integrations.md "PyTorch Lightning": with async saves, a job SIGKILLed after a step's top-k
checkpoint committed and before its ``last.ckpt`` did leaves ``last.ckpt`` a save behind;
``fit(ckpt_path="last")`` through objckpt's ``ModelCheckpoint`` and plugin resumes from the newest
committed checkpoint all the same (real Lightning, a real training process killed, moto S3 over
HTTP or local files)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import boto3  # type: ignore[import-untyped]
import pytest
import torch

import objckpt
from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO

from conftest import assert_same
from lightning_helpers import Tiny, data, reference_losses, trainer

TESTS = pathlib.Path(__file__).resolve().parent

#: a training job with async saves every 2 steps (top 2 by step, plus last.ckpt) that, at step
#: ``stop_at``, lets the step's top-k save commit and stops before saving last.ckpt, until killed
CHILD = r"""
import sys, time
from lightning_helpers import Tiny, data, trainer
from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO

run, stop_at = sys.argv[1], int(sys.argv[2])

class StopsBeforeLast(ObjckptCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if str(path).endswith("/last.ckpt") and checkpoint["global_step"] == stop_at:
            self.teardown()  # every save in flight commits: the top-k one of this step too
            print("stopped", flush=True)
            time.sleep(600)  # killed here
        super().save_checkpoint(checkpoint, path, storage_options)

ckpt = ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True)
trainer(8, [StopsBeforeLast(async_save=True)], [ckpt], default_root_dir=run).fit(Tiny(), data())
"""


def _ckpt() -> ModelCheckpoint:
    return ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True)


def _kill_at(run: str, step: int, tmp_path: pathlib.Path) -> None:
    err = tmp_path / "child.err"
    with open(err, "w") as e:
        child = subprocess.Popen([sys.executable, "-c", CHILD, run, str(step)], cwd=TESTS, stdout=subprocess.PIPE,
                                 stderr=e, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert child.stdout is not None
        for line in child.stdout:  # whatever else the job prints, up to the stop (EOF: it died)
            if line.strip() == "stopped":
                break
        else:
            raise AssertionError(f"the job ended before it stopped: {err.read_text()[-3000:]}")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("where", ["s3", "local"])
def test_last_resumes_from_the_newest_committed_checkpoint_after_a_kill(
        where: str, moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, tmp_path: pathlib.Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, opts = moto_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # the child's and Lightning's fsspec find moto here
    run = f"s3://{bucket}/run" if where == "s3" else str(tmp_path / "run")
    so = opts if where == "s3" else None
    _kill_at(run, 6, tmp_path)

    ck = f"{run}/checkpoints"
    assert objckpt.read(f"{ck}/last.ckpt", "global_step", storage_options=so)["global_step"] == 4  # it lags
    assert objckpt.read(f"{ck}/epoch=2-step=6.ckpt", "global_step", storage_options=so)["global_step"] == 6

    # newer things that do not count: a checkpoint objckpt.save wrote (not the plugin's), and a
    # save killed before its commit (blobs, no manifest)
    objckpt.save({"w": torch.ones(2)}, f"{ck}/other.ckpt", storage_options=so)
    if where == "s3":
        s3 = boto3.client("s3", **opts)
        s3.put_object(Bucket=bucket, Key="run/checkpoints/other.ckpt", Body=b"x")  # a marker, as if
        s3.put_object(Bucket=bucket, Key="run/checkpoints/epoch=9-step=99.ckpt/blobs/a/0", Body=b"x")
        s3.put_object(Bucket=bucket, Key="run/checkpoints/epoch=9-step=99.ckpt", Body=b"x")
    else:
        os.makedirs(f"{ck}/epoch=9-step=99.ckpt/blobs/a")

    # a fresh model and Trainer (this process is not the killed one) resume with "last"
    ref_losses, ref_weights = reference_losses(8)
    resumed = Tiny()
    trainer(8, [ObjckptCheckpointIO(so, async_save=True)], [_ckpt()], default_root_dir=run).fit(
        resumed, data(), ckpt_path="last")
    assert resumed.losses == ref_losses[6:]  # from step 6; from last.ckpt's step 4 it would be ref_losses[4:]
    assert_same(dict(resumed.state_dict()), dict(ref_weights))


def test_a_committed_checkpoint_without_its_marker_is_skipped_and_named(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Lightning checks the path it resumes from through fsspec, which sees only the marker: a
    checkpoint whose marker is missing (a kill between commit and marker) cannot be "last"; the
    newest one that has its marker is taken, and the skipped one is named."""
    bucket, opts = moto_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    run = f"s3://{bucket}/run"
    trainer(4, [ObjckptCheckpointIO(opts)], [_ckpt()], default_root_dir=run).fit(Tiny(), data())
    s3 = boto3.client("s3", **opts)
    for name in ("epoch=1-step=4.ckpt", "last.ckpt"):  # step 4's two checkpoints lose their markers
        s3.delete_object(Bucket=bucket, Key=f"run/checkpoints/{name}")

    ref_losses, _ = reference_losses(8)
    resumed = Tiny()
    trainer(8, [ObjckptCheckpointIO(opts)], [_ckpt()], default_root_dir=run).fit(resumed, data(), ckpt_path="last")
    assert resumed.losses == ref_losses[2:]  # from step 2, the newest with its marker
    assert "epoch=1-step=4.ckpt is committed but has no marker object" in caplog.text
    assert f"ckpt_path='{run}/checkpoints/epoch=1-step=4.ckpt'" in caplog.text
