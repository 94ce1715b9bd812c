"""Edges of a load whose template does not fit the checkpoint: another kind of optimizer, a
rank-local template at another world size, and the step a manager without a local tier loaded.

Each runs in fresh processes joined by gloo (tests/mp.py), on real moto S3 or real files.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import objckpt
from mp import run_multiprocess


def _net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer, i: int = 0) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything a load could change, copied: weights, param groups, per-parameter state."""
    sd = opt.state_dict()
    return {"model": {k: v.clone() for k, v in net.state_dict().items()},
            "groups": [dict(g) for g in sd["param_groups"]],
            "state": {pid: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
                      for pid, e in sd["state"].items()}}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _refused(fn: Any) -> tuple[str, str]:
    """(error class name, message) of what ``fn()`` raised, or ("", "") when it loaded."""
    try:
        fn()
    except objckpt.StateDictMismatchError as e:
        return type(e).__name__, str(e)
    return "", ""


def optimizer_kinds(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    """A fresh process: an AdamW checkpoint (lr 1e-3, two steps taken) loaded into SGD (fresh, and
    with momentum buffers; Stateful and plain dict), with the accepting option, into a fresh
    AdamW of another lr, and into a stepped AdamW of another lr."""
    net = _net(0)
    adamw = torch.optim.AdamW(net.parameters(), lr=1e-3)
    _step(net, adamw, 0)
    _step(net, adamw, 1)
    objckpt.save({"model": net, "optim": adamw, "step": 2}, uri, storage_options=opts)
    saved = _snapshot(net, adamw)
    out: dict[str, Any] = {}

    # fresh SGD: refused, nothing changed (weights, lr, state, the plain value beside them)
    net2 = _net(1)
    sgd = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
    before, state = _snapshot(net2, sgd), {"model": net2, "optim": sgd, "step": 0}
    out["fresh_sgd"] = _refused(lambda: objckpt.load(state, uri, storage_options=opts))
    out["fresh_sgd_untouched"] = _same(before, _snapshot(net2, sgd)) and state["step"] == 0

    # SGD with momentum buffers: the state names are compared too, and nothing changes
    net3 = _net(2)
    sgd3 = torch.optim.SGD(net3.parameters(), lr=0.1, momentum=0.9)
    _step(net3, sgd3, 5)
    before3 = _snapshot(net3, sgd3)
    out["stepped_sgd"] = _refused(lambda: objckpt.load({"model": net3, "optim": sgd3, "step": 0}, uri,
                                                      storage_options=opts))
    out["stepped_sgd_untouched"] = _same(before3, _snapshot(net3, sgd3))
    # a plain state dict of SGD's (the caller then calls load_state_dict): refused the same way
    plain = {"model": net3.state_dict(), "optim": sgd3.state_dict(), "step": 0}
    out["plain_sgd"] = _refused(lambda: objckpt.load(plain, uri, storage_options=opts))
    out["plain_sgd_untouched"] = plain["optim"]["param_groups"][0]["lr"] == 0.1

    # accepted: SGD takes AdamW's settings and state, as torch's load_state_dict would
    objckpt.load(state, uri, storage_options=opts, allow_optimizer_change=True)
    out["accepted_fresh"] = (sgd.param_groups[0]["lr"], _same(saved["state"], _snapshot(net2, sgd)["state"]),
                             _same(saved["model"], net2.state_dict()), state["step"])
    objckpt.load({"model": net3, "optim": sgd3, "step": 0}, uri, storage_options=opts, allow_optimizer_change=True)
    out["accepted_stepped"] = (sgd3.param_groups[0]["lr"], _same(saved["state"], _snapshot(net3, sgd3)["state"]))

    # AdamW of another lr, fresh and stepped: loads, the stored lr and state; both go on alike
    for name, steps in (("fresh_adamw", 0), ("stepped_adamw", 1)):
        net4 = _net(3)
        adamw4 = torch.optim.AdamW(net4.parameters(), lr=0.5)
        for i in range(steps):
            _step(net4, adamw4, 9)
        objckpt.load({"model": net4, "optim": adamw4, "step": 0}, uri, storage_options=opts)
        got = _snapshot(net4, adamw4)
        same_state = _same(saved["state"], got["state"])
        ref_net = _net(0)
        ref_net.load_state_dict(saved["model"])
        ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-3)
        # (load_state_dict keeps the tensors it is given: a copy, so the step leaves ``saved`` alone)
        ref_opt.load_state_dict(copy.deepcopy({"state": saved["state"], "param_groups": saved["groups"]}))
        _step(net4, adamw4, 7)
        _step(ref_net, ref_opt, 7)
        out[name] = (got["groups"][0]["lr"], same_state, _same(ref_net.state_dict(), net4.state_dict()))
    return out


def dcp_optimizer_kinds(rank: int, world: int, root: str) -> dict[str, Any]:
    """The torch.distributed.checkpoint.state_dict route: get_state_dict's optimizer state dict
    (keyed by parameter name), nested and flattened, AdamW saved, SGD and AdamW templates."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    out: dict[str, Any] = {}
    for flat in (False, True):
        o = StateDictOptions(flatten_optimizer_state_dict=flat)
        net = _net(0)
        adamw = torch.optim.AdamW(net.parameters(), lr=1e-3)
        _step(net, adamw)
        msd, osd = get_state_dict(net, adamw, options=o)
        uri = f"{root}/flat{int(flat)}"
        objckpt.save({"model": msd, "optim": osd}, uri)
        net2 = _net(1)
        sgd = torch.optim.SGD(net2.parameters(), lr=0.1, momentum=0.9)
        msd2, osd2 = get_state_dict(net2, sgd, options=o)
        out[f"sgd{int(flat)}"] = _refused(lambda: objckpt.load({"model": msd2, "optim": osd2}, uri))
        net3 = _net(2)
        adamw3 = torch.optim.AdamW(net3.parameters(), lr=0.5)
        msd3, osd3 = get_state_dict(net3, adamw3, options=o)
        objckpt.load({"model": msd3, "optim": osd3}, uri)
        set_state_dict(net3, adamw3, model_state_dict=msd3, optim_state_dict=osd3, options=o)
        out[f"adamw{int(flat)}"] = (adamw3.param_groups[0]["lr"],
                                    _same(_snapshot(net, adamw)["state"], _snapshot(net3, adamw3)["state"]))
    return out


def test_another_optimizer_is_refused_before_anything_loads(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    (out,) = run_multiprocess(1, optimizer_kinds, f"s3://{bucket}/run/adamw", opts)
    kind, msg = out["fresh_sgd"]
    assert kind == "OptimizerMismatchError", out
    # both sides named: the optimizer, the group, each side's hyperparameters, the lr it would change
    for part in ("the SGD at key 'optim'", "param group 0", "'betas'", "'momentum'", "only in the checkpoint: "
                 "amsgrad, betas, eps", "only in the state dict: dampening, momentum, nesterov",
                 "from 0.1 to 0.001", "allow_optimizer_change=True", "Nothing was loaded"):
        assert part in msg, (part, msg)
    assert out["fresh_sgd_untouched"]
    kind, msg = out["stepped_sgd"]
    assert kind == "OptimizerMismatchError" and "the state of parameter 0, 1, 2 and 1 more" in msg, msg
    assert "['exp_avg', 'exp_avg_sq', 'step']" in msg and "['momentum_buffer']" in msg, msg
    assert out["stepped_sgd_untouched"]
    kind, msg = out["plain_sgd"]
    assert kind == "OptimizerMismatchError" and "the optimizer state dict at key 'optim'" in msg, msg
    assert out["plain_sgd_untouched"]
    assert out["accepted_fresh"] == (1e-3, True, True, 2)
    assert out["accepted_stepped"] == (1e-3, True)
    assert out["fresh_adamw"] == (1e-3, True, True)
    assert out["stepped_adamw"] == (1e-3, True, True)


def test_another_optimizer_through_get_state_dict(tmp_path: Any) -> None:
    (out,) = run_multiprocess(1, dcp_optimizer_kinds, str(tmp_path))
    kind, msg = out["sgd0"]
    assert kind == "OptimizerMismatchError" and "param group 0" in msg and "'momentum'" in msg, msg
    kind, msg = out["sgd1"]  # flattened: per parameter name
    assert kind == "OptimizerMismatchError" and "the param group of '0.weight'" in msg, msg
    assert "the state of '0.weight'" in msg and "momentum_buffer" in msg, msg
    assert out["adamw0"] == (1e-3, True) and out["adamw1"] == (1e-3, True)


# -- a rank-local template at another world size ----------------------------------------------

def save_shards(rank: int, world: int, uri: str) -> None:
    """Each rank saves its rows of an 8x4 tensor as an objckpt.Shard (4 rows each at world 2)."""
    rows = 8 // world
    local = torch.arange(rank * rows * 4, (rank + 1) * rows * 4, dtype=torch.float32).reshape(rows, 4)
    objckpt.save({"w": objckpt.Shard(local, (8, 4), (rank * rows, 0))}, uri)


def load_rank_local(rank: int, world: int, uri: str) -> dict[str, Any]:
    """A plain template of one rank's part at world 2 ([4, 4]: the saving rank's at world 1, this
    rank's at world 2) is refused naming what reshards; a Shard of this world's rows, and a full
    tensor, load."""
    rows = 8 // world
    kind, msg = _refused(lambda: objckpt.load({"w": torch.zeros(4, 4)}, uri))
    shard = objckpt.Shard(torch.zeros(rows, 4), (8, 4), (rank * rows, 0))
    objckpt.load({"w": shard}, uri)
    full = torch.zeros(8, 4)
    objckpt.load({"w": full}, uri)
    want = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    return {"kind": kind, "msg": msg, "shard": torch.equal(shard.local, want[rank * rows:(rank + 1) * rows]),
            "full": torch.equal(full, want)}


def load_other_model(rank: int, world: int, uri: str) -> str:
    """A resized model at the world size it was saved at: the plain shape message, no reshard advice."""
    return _refused(lambda: objckpt.load({"w": torch.zeros(16, 4)}, uri))[1]


def test_rank_local_template_at_another_world_size_says_what_reshards(tmp_path: Any) -> None:
    two = str(tmp_path / "two")
    run_multiprocess(2, save_shards, two)
    (got,) = run_multiprocess(1, load_rank_local, two)
    assert got["kind"] == "StateDictMismatchError" and got["shard"] and got["full"], got
    msg = got["msg"]
    for part in ("state dict has torch.float32 [4, 4], checkpoint has float32 [8, 4]", "one rank's part",
                 "2 such parts along dim 0", "stored global shape [8, 4]", "saved by 2 rank(s), loading on 1",
                 "Give the template the global shape [8, 4]", "DTensor", "objckpt.Shard(local, global_shape=(8, 4)"):
        assert part in msg, (part, msg)


def test_rank_local_template_the_other_way_round(tmp_path: Any) -> None:
    """Saved whole by one process, loaded on two ranks each holding a plain [4, 4]."""
    one = str(tmp_path / "one")
    run_multiprocess(1, save_shards, one)
    got = run_multiprocess(2, load_rank_local, one)
    for g in got:
        assert g["kind"] and g["shard"] and g["full"], g
        assert "saved by 1 rank(s), loading on 2" in g["msg"] and "[4, 4]" in g["msg"], g["msg"]
        assert "objckpt.Shard" in g["msg"] and "DTensor" in g["msg"], g["msg"]
    # the same world size and a tensor never split: a resized model, told nothing about resharding
    (msg,) = run_multiprocess(1, load_other_model, one)
    assert "checkpoint has float32 [8, 4]" in msg and "one rank's part" not in msg, msg


# -- CheckpointManager without a local tier --------------------------------------------------

def manager_steps(rank: int, world: int, root: str, opts: dict[str, Any]) -> list[Any]:
    """Two steps through a manager without a local tier, loaded back (the latest, then the older);
    an SGD into their AdamW state through the manager: refused, then accepted."""
    net = _net(0)
    adamw = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with objckpt.CheckpointManager(root, storage_options=opts) as m:
        for step in (10, 20):
            _step(net, adamw, step)
            m.save(step, {"model": net, "optim": adamw, "step": step})
        latest = m.load({"model": _net(1), "optim": torch.optim.AdamW(_net(1).parameters()), "step": 0})
        older = m.load({"model": _net(1), "optim": torch.optim.AdamW(_net(1).parameters()), "step": 0}, step=10)
        net2 = _net(1)
        sgd = torch.optim.SGD(net2.parameters(), lr=0.1)
        kind, _ = _refused(lambda: m.load({"model": net2, "optim": sgd, "step": 0}))
        accepted = m.load({"model": net2, "optim": sgd, "step": 0}, step=10, allow_optimizer_change=True)
    return [latest.step, older.step, latest.uri.rstrip("/").split("/")[-1], kind, accepted.step,
            sgd.param_groups[0]["lr"]]


def test_manager_without_a_tier_says_which_step_it_loaded(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    (got,) = run_multiprocess(1, manager_steps, f"s3://{bucket}/run", opts)
    assert got == [20, 10, "step-0000000020", "OptimizerMismatchError", 10, 1e-3], got


@pytest.mark.parametrize("names", [(["lr", "betas"], ["lr", "momentum"]), (["lr"], ["lr", "initial_lr"])])
def test_only_names_on_both_sides_differ(names: tuple[list[str], list[str]]) -> None:
    """The rule on its own: each side must have a name the other lacks (a scheduler's or a newer
    torch's extra name on one side is not another optimizer)."""
    from objckpt.load.optimizer_match import _differ, _hyper

    a, b = names
    assert _differ(_hyper(a), _hyper(b)) == ("momentum" in b)
