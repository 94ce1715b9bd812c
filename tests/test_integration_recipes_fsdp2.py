"""The FSDP2 recipe (examples/integrations/fsdp2.py) against moto S3: save at world 2, resume at 1, 2 and 3.

Same layout (world 2): the next losses equal the uninterrupted run's bit for
bit.  Other world sizes: the restored state (model and optimizer, gathered
whole) equals the saved one bit for bit, and the losses agree to a relative
1e-5: the global batch is the same, but the gradient is averaged over 3 (or
1) ranks' partial means instead of 2, so float sums run in another order
(observed differences are ~1e-7 relative).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

import objckpt

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "integrations")
sys.path.insert(0, EXAMPLES)
import fsdp2 as recipe  # noqa: E402

RTOL = 1e-5


def _flat_saved(uri: str, opts: dict[str, Any]) -> dict[str, torch.Tensor]:
    saved = objckpt.read(uri, storage_options=opts)
    out = {f"model.{k}": v for k, v in saved["model"].items()}
    for pid, entry in saved["optim"]["state"].items():
        out.update({f"optim.state.{pid}.{k}": v for k, v in entry.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and all(abs(g - w) <= RTOL * abs(w) for g, w in zip(got, want)), (got, want)


def test_fsdp2_resumes_at_world_1_2_and_3(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/fsdp2/step-3"
    res = recipe.main(uri, opts)

    m = objckpt.inspect(uri, storage_options=opts)
    assert m.tensors["model.0.weight"].shape == (32, 16) and "optim.state.3.exp_avg_sq" in m.tensors
    saved = _flat_saved(uri, opts)
    assert len(saved) == 4 + 4 * 3

    assert res["world2"] == res["reference"]  # same layout: bit for bit
    _same(res["restored2"], saved)
    _same(res["restored3"], saved)  # 32 rows over 3 ranks: uneven shards, 4 rows: one rank holds none
    _close(res["world3"], res["reference"])

    # world 1: a plain module and optimizer in this process (no process group) load the FSDP2 checkpoint
    model, opt = recipe.build(None, seed=7)
    step = recipe.load_state(model, opt, uri, opts)
    assert step == 3
    _same(recipe.full_state(model, opt), saved)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _close(recipe.train(model, opt, step, 3, 0, 1), res["reference"])
    finally:
        torch.set_num_threads(threads)


def dcp_route_job(rank: int, world: int, mesh: Any, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The torch.distributed.checkpoint.state_dict route: save what get_state_dict returns, load into
    what it returns for fresh objects, hand it over with set_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = recipe.build(mesh, seed=0)
    recipe.train(model, opt, 0, 3, rank, world)
    msd, osd = get_state_dict(model, opt)
    objckpt.save({"model": msd, "optim": osd, "step": 3}, uri, storage_options=opts)
    reference = recipe.train(model, opt, 3, 3, rank, world)

    model, opt = recipe.build(mesh, seed=rank + 1)
    msd, osd = get_state_dict(model, opt)  # torch initialises a fresh optimizer's state here
    state: dict[str, Any] = {"model": msd, "optim": osd, "step": 0}
    objckpt.load(state, uri, storage_options=opts)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    resumed = recipe.train(model, opt, state["step"], 3, rank, world)
    return {"reference": reference, "resumed": resumed, "step": state["step"]}


def test_fsdp2_through_get_state_dict_and_set_state_dict(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/fsdp2-dcp-route/step-3"
    res = recipe.spawn(2, dcp_route_job, uri, opts)
    assert res["step"] == 3 and res["resumed"] == res["reference"]
    keys = objckpt.inspect(uri, storage_options=opts).tensors
    assert "optim.state.0.weight.exp_avg" in keys  # keyed by parameter name on this route
