"""Loads that would silently load too little: torch's wrapper prefixes, and non-strict loads of nothing.

A model saved through ``torch.compile`` (keys ``_orig_mod.…``), ``DistributedDataParallel``
(``module.…``) or activation checkpointing loads into the plain model and back (real
wrappers, real gloo DDP, resumes in fresh processes); a prefix objckpt cannot explain is
named with its fix; ``strict=False`` never turns a load of nothing into a success.
"""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import StateDictMismatchError

from mp import run_multiprocess


def _net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 8, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """Tensors of a model's and an optimizer's state dicts, flat, as numpy arrays (a tensor sent
    between processes lives in shared memory that dies with its sender)."""
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in state["model"].items()}
    for pid, entry in state["optim"]["state"].items():
        out.update({f"optim.{pid}.{n}": v.detach().numpy().copy() for n, v in entry.items()})
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def save_wrapped(rank: int, world: int, root: str) -> dict[str, Any]:
    """Two gloo ranks save a model through its wrappers.

    ``compiled``: a plain model trained one step, saved through ``torch.compile`` as a
    Stateful value and as the compiled module's state dict (keys ``_orig_mod.…``).
    ``ddp``: a DDP model trained one step (each rank on its own data), saved as a Stateful
    value and as ``ddp.state_dict()`` (keys ``module.…``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _step(net, opt, 1)
    compiled = torch.compile(net, backend="eager")  # its state_dict() needs no run
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    objckpt.save({"model": compiled, "optim": opt}, f"{root}/compiled/stateful")
    objckpt.save({"model": compiled.state_dict(), "optim": opt.state_dict()}, f"{root}/compiled/dict")
    out = {"compiled": _plain({"model": net.state_dict(), "optim": opt.state_dict()})}

    net = _net(0)
    ddp = DDP(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    _step(ddp, opt, 10 + rank)
    assert next(iter(ddp.state_dict())).startswith("module.")
    objckpt.save({"model": ddp, "optim": opt}, f"{root}/ddp/stateful")
    objckpt.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, f"{root}/ddp/dict")
    out["ddp"] = _plain({"model": net.state_dict(), "optim": opt.state_dict()})
    return out


def resume_wrapped(rank: int, world: int, root: str) -> dict[str, list[dict[str, Any]]]:
    """A fresh process (a one-rank gloo group) resumes each wrapper's two checkpoints into the
    plain model (strict), and the Stateful one into a wrapped model again."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrap = {"compiled": lambda m: torch.compile(m, backend="eager"), "ddp": DDP}
    out: dict[str, list[dict[str, Any]]] = {}
    for kind, wrapper in wrap.items():
        got = []
        for name in ("stateful", "dict"):
            net = _net(7)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
            objckpt.load({"model": net, "optim": opt}, f"{root}/{kind}/{name}")
            got.append(_plain({"model": net.state_dict(), "optim": opt.state_dict()}))
        net = _net(8)
        wrapped = wrapper(net)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        objckpt.load({"model": wrapped, "optim": opt}, f"{root}/{kind}/stateful")
        got.append(_plain({"model": net.state_dict(), "optim": opt.state_dict()}))
        out[kind] = got
    return out


@pytest.fixture(scope="module")
def wrapped_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(root, what each saving rank had, what the resuming process loaded): one save run of
    two ranks and one fresh resume, shared by the compile and DDP tests."""
    root = str(tmp_path_factory.mktemp("wrapped"))
    saved = run_multiprocess(2, save_wrapped, root)
    (loaded,) = run_multiprocess(1, resume_wrapped, root)
    return root, saved, loaded


def test_compiled_model_resumes_into_the_plain_model_and_back(
        wrapped_runs: tuple[str, list[dict[str, Any]], dict[str, Any]]) -> None:
    root, saved, loaded = wrapped_runs
    keys = objckpt.inspect(f"{root}/compiled/stateful").tensors
    assert all(k.startswith(("model.0", "model.2", "optim.")) for k in keys)
    assert any(k.startswith("model._orig_mod.") for k in objckpt.inspect(f"{root}/compiled/dict").tensors)
    assert len(loaded["compiled"]) == 3 and all(_same(got, saved[0]["compiled"]) for got in loaded["compiled"])


def test_ddp_checkpoint_resumes_into_the_plain_model_and_back(
        wrapped_runs: tuple[str, list[dict[str, Any]], dict[str, Any]]) -> None:
    root, saved, loaded = wrapped_runs
    assert _same(saved[0]["ddp"], saved[1]["ddp"])  # DDP kept the replicas equal
    assert not _same(saved[0]["ddp"], saved[0]["compiled"])  # and they trained on other data
    assert all(".module." not in k for k in objckpt.inspect(f"{root}/ddp/stateful").tensors)
    assert any(k.startswith("model.module.") for k in objckpt.inspect(f"{root}/ddp/dict").tensors)
    assert len(loaded["ddp"]) == 3 and all(_same(got, saved[0]["ddp"]) for got in loaded["ddp"])


def test_activation_checkpointed_parameters_load_into_the_plain_model(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """``named_parameters()`` of a model under activation checkpointing (the usual way to save
    only trainable weights) has ``<layer>._checkpoint_wrapped_module.`` inside every key."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                                checkpoint_wrapper)

    net = _net(0)
    apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, torch.nn.Linear))
    params = {n: p.detach() for n, p in net.named_parameters()}
    assert "0._checkpoint_wrapped_module.weight" in params
    objckpt.save(params, str(tmp_path / "ac"))
    plain = _net(5)
    with caplog.at_level(logging.INFO, logger="objckpt.load"):
        res = objckpt.load(plain.state_dict(), str(tmp_path / "ac"), strict=False)
    assert res.tensors == 4 and res.missing_keys == [] and res.unexpected_keys == []
    assert all(torch.equal(plain.state_dict()[n.replace("_checkpoint_wrapped_module.", "")], p)
               for n, p in params.items())
    assert "'_checkpoint_wrapped_module.'" in caplog.text and "activation checkpointing" in caplog.text
    # the plain model's checkpoint into a wrapped one, as a Stateful value
    objckpt.save({"model": plain}, str(tmp_path / "plain"))
    wrapped = checkpoint_wrapper(_net(6))
    objckpt.load({"model": wrapped}, str(tmp_path / "plain"))
    assert all(torch.equal(wrapped.state_dict()[k], v) for k, v in plain.state_dict().items())


def test_only_a_prefix_on_every_key_of_one_side_is_dropped() -> None:
    from objckpt.load.key_match import reconcile

    both = reconcile(["_orig_mod.module.a", "_orig_mod.module.b"], ["a", "b"])  # compiled DDP
    assert both.to_ckpt == {"_orig_mod.module.a": "a", "_orig_mod.module.b": "b"}
    layers = reconcile([f"layers.{i}.w" for i in range(3)] + ["step"],
                       [f"layers.{i}._checkpoint_wrapped_module.w" for i in range(3)] + ["step"])
    assert layers.to_ckpt["layers.2.w"] == "layers.2._checkpoint_wrapped_module.w" and len(layers.renames) == 3
    # a user's own submodule named "module" beside other keys is not a DDP prefix
    assert reconcile(["module.w", "b"], ["w", "b"]).to_ckpt == {}
    assert reconcile(["enc.module.w", "enc.x"], ["enc.w", "enc.x"]).to_ckpt == {}
    assert reconcile(["a.w"], ["a.w"]).to_ckpt == {}


def test_a_prefix_objckpt_cannot_explain_is_named_with_its_fix(tmp_path: Any) -> None:
    net = _net(0)
    uri = str(tmp_path / "ck")
    objckpt.save({"model": net.state_dict()}, uri)
    target = _net(1).state_dict()
    with pytest.raises(StateDictMismatchError) as ei:
        objckpt.load(target, uri)
    msg = str(ei.value)
    assert "prefix 'model.'" in msg and "objckpt.load({'model': state_dict}, uri)" in msg, msg
    assert "strict=False" not in msg and len(msg) < 600, msg
    objckpt.save({"model": net.state_dict()}, str(tmp_path / "ck2"))
    nested = {"model": {"net": _net(1).state_dict()}}
    with pytest.raises(StateDictMismatchError, match=r"under 'model' have the prefix 'net\.'.*"
                                                     r"objckpt\.load\(state_dict\['model'\]\['net'\], uri\)"):
        objckpt.load(nested, str(tmp_path / "ck2"))


def test_strict_false_hint_only_when_tensors_are_in_common(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"a": torch.ones(2), "b": torch.ones(3)}, uri)
    with pytest.raises(StateDictMismatchError, match=r"Pass strict=False to load the 1 tensor\(s\) in common"):
        objckpt.load({"a": torch.zeros(2), "c": torch.zeros(3)}, uri)
    with pytest.raises(StateDictMismatchError) as ei:
        objckpt.load({"x": torch.zeros(2)}, uri)
    assert "strict=False" not in str(ei.value)


def test_non_strict_load_of_nothing_is_an_error_and_touches_nothing(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"model": _net(0).state_dict()}, uri)
    target = _net(1).state_dict()
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(StateDictMismatchError, match=r"none of the state dict's 4 tensor\(s\).*prefix 'model\.'"):
        objckpt.load(target, uri, strict=False)
    assert all(torch.equal(target[k], before[k]) for k in target)
    # a template without tensors asks for values only: still fine
    objckpt.save({"model": _net(0).state_dict(), "step": 3}, str(tmp_path / "v"))
    values: dict[str, Any] = {"step": 0}
    objckpt.load(values, str(tmp_path / "v"), strict=False)
    assert values["step"] == 3


def test_non_strict_load_that_skips_a_whole_stateful_value_is_an_error(tmp_path: Any) -> None:
    """The optimizer's keys match, the model's do not (saved one level deeper): without the
    check the resume would pair trained AdamW moments with untrained weights."""
    net = _net(0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _step(net, opt, 1)
    uri = str(tmp_path / "ck")
    objckpt.save({"model": {"net": net.state_dict()}, "optim": opt}, uri)
    fresh = _net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    w0 = fresh[0].weight.detach().clone()
    with pytest.raises(StateDictMismatchError) as ei:
        objckpt.load({"model": fresh, "optim": fresh_opt}, uri, strict=False)
    msg = str(ei.value)
    assert "none of the 4 tensor(s) of the Sequential at key 'model'" in msg, msg
    assert "'model.net.0.weight'" in msg and "prefix 'net.'" in msg, msg
    assert torch.equal(fresh[0].weight, w0) and fresh_opt.state_dict()["state"] == {}
