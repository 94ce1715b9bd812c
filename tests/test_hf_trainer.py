"""docs/integrations.md "Hugging Face Trainer": the recipe checkpoints a Trainer to moto S3 and
resumes in fresh processes, from "latest" and from an explicit S3 URI, exactly where it stopped:
the same losses and the same weights, bit for bit, as a run that never stopped (dropout and the
Trainer's shuffling depend on the restored generators)."""
from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import objckpt
from objckpt.errors import NotFoundError
from mp import run_multiprocess
from recipes import load_recipe

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations" / "hf_trainer.py"


def _recipe() -> Any:
    return load_recipe("hf_trainer.py", "hf_trainer_recipe")


def _env(endpoint: str, opts: dict[str, Any]) -> dict[str, str]:
    return {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"], "AWS_DEFAULT_REGION": opts["region_name"],
            "OMP_NUM_THREADS": "1"}  # the weights are compared bit for bit: one thread count everywhere


def _json_keys(d: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def test_trainer_resumes_from_latest_and_from_a_uri_bit_for_bit(moto_s3: tuple[str, dict[str, Any]],
                                                                moto_endpoint: str, one_thread: Any) -> None:
    bucket, opts = moto_s3
    recipe = _recipe()
    root = f"s3://{bucket}/run-1"
    straight = recipe.train(f"s3://{bucket}/straight", storage_options=opts)
    stopped = recipe.train(root, stop_at=4, storage_options=opts)
    assert stopped["global_step"] == 4 and stopped["steps"] == [2, 4]
    assert stopped["losses"] == {s: straight["losses"][s] for s in (1, 2, 3, 4)}

    # what a step holds: model, optimizer, scheduler, generators, trainer state; no pickle
    ck = objckpt.read(f"{root}/step-0000000004", ["trainer_state", "rng", "scheduler", "optimizer.state"],
                      storage_options=opts)
    assert ck["trainer_state"]["global_step"] == 4 and ck["scheduler"]["last_epoch"] == 4
    assert set(ck["rng"]) >= {"python", "numpy", "cpu"} and len(ck["optimizer.state"]) > 0

    # a restarted job, in a fresh process configured by the environment only: it resumes from an
    # explicit S3 URI into another root, then from "latest" of the first root
    code = (f"import json, runpy; r = runpy.run_path({str(RECIPE)!r}); "
            f"print(json.dumps([r['train']({f's3://{bucket}/run-2'!r}, resume={f'{root}/step-0000000002'!r}), "
            f"r['train']({root!r}, resume='latest')]))")
    job = subprocess.run([sys.executable, "-c", code], env=_env(moto_endpoint, opts), capture_output=True, text=True,
                         timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    from_uri, latest = json.loads(job.stdout.strip().splitlines()[-1])

    want = {s: straight["losses"][s] for s in range(1, 7)}
    assert _json_keys(latest["losses"]) == want and latest["global_step"] == 6
    assert _json_keys(latest["weights"]) == {s: straight["weights"][s] for s in (5, 6)}
    assert _json_keys(from_uri["losses"]) == want
    assert _json_keys(from_uri["weights"]) == {s: straight["weights"][s] for s in (3, 4, 5, 6)}

    # rotation: save_total_limit=2 keeps the 2 newest, plus the best by eval loss
    best = straight["best"]
    assert best is not None and best.startswith(f"s3://{bucket}/straight/step-")
    best_step = int(best.rsplit("-", 1)[1])
    assert straight["steps"] == sorted({4, 6, best_step})
    assert latest["steps"] == sorted({4, 6, best_step}) and latest["best"] == best.replace("straight", "run-1")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trainer_on_cuda_resumes_bit_for_bit(tmp_path: pathlib.Path) -> None:
    """The GPU mirror of the test above: dropout draws from the CUDA generator, which the
    checkpoint must carry (``rng.cuda``) for the resumed run to match."""
    recipe = _recipe()
    straight = recipe.train(str(tmp_path / "straight"), use_cpu=False)
    recipe.train(str(tmp_path / "run"), stop_at=4, use_cpu=False)
    torch.cuda.manual_seed_all(12345)  # the resume must not depend on the generator it finds
    resumed = recipe.train(str(tmp_path / "run"), resume="latest", use_cpu=False)
    assert resumed["losses"] == straight["losses"]
    assert {s: resumed["weights"][s] for s in (5, 6)} == {s: straight["weights"][s] for s in (5, 6)}
    rng = objckpt.read(str(tmp_path / "run" / "step-0000000004"), "rng")["rng"]
    assert isinstance(rng.get("cuda"), bytes) and len(rng["cuda"]) > 0


def test_resume_from_a_missing_uri_or_true_without_checkpoints_names_it(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    recipe = _recipe()
    with pytest.raises(NotFoundError, match=f"s3://{bucket}/nothing/step-0000000002"):
        recipe.train(f"s3://{bucket}/x", resume=f"s3://{bucket}/nothing/step-0000000002", storage_options=opts)
    with pytest.raises(NotFoundError, match=f"s3://{bucket}/empty"):
        recipe.train(f"s3://{bucket}/empty", resume=True, storage_options=opts)  # type: ignore[arg-type]


def _per_rank_rng(rank: int, world: int, uri: str) -> list[float]:
    """Each rank's generators differ; saved together, each rank gets its own back."""
    from objckpt.integrations.rng_state import capture_rng, restore_rng

    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    objckpt.save({"w": torch.ones(4), "rng": capture_rng()}, uri)
    draws = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    random.seed(0), np.random.seed(0), torch.manual_seed(0)  # noqa: the generators move on
    holder: dict[str, Any] = {"rng": None}
    objckpt.load(holder, uri, strict=False)
    restore_rng(holder["rng"])
    again = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    assert again == draws, (rank, again, draws)
    return draws


def test_generators_are_saved_and_restored_per_rank(tmp_path: pathlib.Path) -> None:
    draws = run_multiprocess(2, _per_rank_rng, str(tmp_path / "ck"))
    assert draws[0] != draws[1]  # the ranks really held different states
    m = objckpt.inspect(str(tmp_path / "ck"), chunks=False)
    assert m.rank_trees is not None and len(m.rank_trees) == 2
