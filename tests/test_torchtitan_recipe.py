"""docs/integrations.md "torchtitan": the recipe's manager, run with real torchtitan 0.3.0.

FSDP2 on 2 gloo ranks, async saves to moto S3 through objckpt's DCP plugin, torchtitan's
debug model (fused q/k/v: its state-dict hooks hand out fresh wq/wk/wv tensors), optimizer
and LR-scheduler containers.  A run stopped at step 4 and resumed in fresh processes must
continue with exactly the losses of a run that never stopped: without the model's
``load_state_dict`` after ``dcp.load`` the 6 fused weights keep their fresh initialisation
and the losses drift in the fourth hex digit.

torchtitan 0.3.0 does not install beside this project's pinned test environment (see
docs/integrations.md), so this test runs only where it is importable: its checkpoint manager
needs ``tyro``, ``spmd_types``, ``torch_checkpointing``, ``einops``, and its models import
``triton``.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Any

import boto3
import pytest

pytest.importorskip("torchtitan.components.checkpoint",
                    reason="torchtitan is not installed (it cannot install beside the pinned test environment)")
pytest.importorskip("torchtitan.models.llama3", reason="torchtitan's models import triton, which is not installed")

from mp import run_multiprocess  # noqa: E402

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations" / "torchtitan_manager.py"


def _job(rank: int, world: int, env: dict[str, str], runs: list[tuple[str, int, bool]]) -> list[dict[str, Any]]:
    os.environ.update(env)  # ranks fork from a server started before the test set its environment
    spec = importlib.util.spec_from_file_location("torchtitan_manager", RECIPE)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return [recipe.train(root, steps, 6, resume) for root, steps, resume in runs]


def test_torchtitan_manager_resumes_bit_for_bit(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> None:
    bucket, opts = moto_s3
    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
           "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"], "AWS_DEFAULT_REGION": opts["region_name"]}
    straight_root, root = f"s3://{bucket}/straight", f"s3://{bucket}/run"
    first = run_multiprocess(2, _job, env, [(straight_root, 6, False), (root, 4, False)], timeout=600)
    straight, stopped = first[0]
    assert straight["n_params"] == 45
    assert stopped["losses"] == {s: straight["losses"][s] for s in (1, 2, 3, 4)}

    resumed = run_multiprocess(2, _job, env, [(root, 6, True)], timeout=600)[0][0]  # fresh processes
    assert resumed["losses"] == {5: straight["losses"][5], 6: straight["losses"][6]}

    keys = {o["Key"] for o in boto3.client("s3", **opts).list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]}
    committed = sorted(k.split("/")[1] for k in keys if k.endswith("/manifest.json"))
    assert committed == ["step-4", "step-6"], committed  # keep_latest_k=2 purged step 2; objckpt, not DCP
    assert not any(k.endswith("/.metadata") for k in keys)
