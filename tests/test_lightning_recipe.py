"""docs/integrations.md "PyTorch Lightning": the recipe saves to moto S3, keeps the best 2
checkpoints plus last, and resumes from "last" in a fresh process exactly where it stopped."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import boto3
import pytest
from recipes import load_recipe

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations" / "lightning_fit.py"


def _recipe() -> Any:
    return load_recipe("lightning_fit.py", "lightning_fit")


def _run(*args: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(RECIPE), *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lightning_recipe_resumes_from_last(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str,
                                            tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, opts = moto_s3
    recipe = _recipe()
    straight = recipe.fit(str(tmp_path / "straight"), 8, resume=False, async_save=False)  # local files

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    first = recipe.fit(f"s3://{bucket}/run", 6, resume=False, async_save=True)
    assert first["losses"] == straight["losses"][:6]
    keys = boto3.client("s3", **opts).list_objects_v2(Bucket=bucket)["Contents"]
    names = {o["Key"].split("/")[2] for o in keys}
    assert names == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"}, names

    # resume in a fresh process, as a restarted job would, configured only by the environment
    env = {**os.environ, "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
           "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"], "AWS_DEFAULT_REGION": opts["region_name"],
           "OBJCKPT_LIGHTNING_URI": f"s3://{bucket}/run"}
    second = _run("--steps", "8", "--resume", env=env)
    assert second["global_step"] == 8 and second["losses"] == straight["losses"][6:]
