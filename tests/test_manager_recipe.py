"""docs/integrations.md "Training with CheckpointManager": the recipe runs, stops, resumes bit for bit."""
from __future__ import annotations

import pathlib
from typing import Any

import torch
from recipes import load_recipe

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations" / "manager_loop.py"


def _recipe() -> Any:
    return load_recipe("manager_loop.py", "manager_loop")


def test_manager_loop_resumes_bit_for_bit(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    recipe = _recipe()
    straight = recipe.train(f"s3://{bucket}/straight", 12, storage_options=opts)
    assert straight["resumed_from"] is None
    first = recipe.train(f"s3://{bucket}/crashy", 12, stop_at=7, storage_options=opts)
    assert first["resumed_from"] is None and first["steps"][-2:] == [4, 6]
    second = recipe.train(f"s3://{bucket}/crashy", 12, storage_options=opts)
    assert second["resumed_from"] == 6
    for k, v in straight["model"].items():
        assert torch.equal(v, second["model"][k]), k
    # saves at even steps; kept: the last two (10, 12), every 10th (10), the lowest loss (any)
    assert {10, 12} <= set(second["steps"]) and len(second["steps"]) <= 3
    assert second["best"] in second["steps"]  # the lowest loss is kept, and named by best_step()
