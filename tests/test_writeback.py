"""A load into an object whose state-dict hook hands out fresh tensors must reach the object.

The module below stores q/k/v fused in one parameter, as torchtitan's models do, and its
``state_dict()`` hands out three fresh tensors split from it.  A load fills those copies;
only ``load_state_dict()`` (through a load pre-hook) can carry them back.  Wrapped like
torchtitan's ``ModelWrapper`` (``strict=False``), a module without that hook keeps its old
weights and nothing complains: objckpt must say so, naming the keys.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import StateDictMismatchError


class FusedAttention(torch.nn.Module):
    """q/k/v in one ``wqkv`` parameter; the state dict shows ``wq``, ``wk``, ``wv`` (fresh tensors)."""

    def __init__(self, d: int, fuse_back: bool) -> None:
        super().__init__()
        self.wqkv = torch.nn.Parameter(torch.randn(3 * d, d))
        self.out = torch.nn.Linear(d, d)
        self.register_state_dict_post_hook(self._split)
        if fuse_back:
            self.register_load_state_dict_pre_hook(self._fuse)

    @staticmethod
    def _split(module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        fused = sd.pop(prefix + "wqkv")
        for name, part in zip(("wq", "wk", "wv"), fused.detach().chunk(3)):
            sd[prefix + name] = part.clone()  # fresh: not the parameter's storage

    @staticmethod
    def _fuse(module: Any, sd: dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "wq" in sd:
            sd[prefix + "wqkv"] = torch.cat([sd.pop(prefix + n) for n in ("wq", "wk", "wv")])


class LenientWrapper:
    """torchtitan's ``ModelWrapper`` in short: a Stateful whose load is ``strict=False``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd, strict=False)


def _saved(tmp_path: Any) -> tuple[str, FusedAttention]:
    torch.manual_seed(0)
    src = FusedAttention(4, fuse_back=True)
    with torch.no_grad():
        src.wqkv[0, 0] = float("nan")  # compared bit for bit: a NaN that arrived is no difference
    uri = str(tmp_path / "ck")
    objckpt.save({"model": LenientWrapper(src), "step": 3}, uri)
    return uri, src


def test_fused_weights_written_back_by_a_load_hook_are_restored(tmp_path: Any) -> None:
    uri, src = _saved(tmp_path)
    torch.manual_seed(1)
    dst = FusedAttention(4, fuse_back=True)
    state: dict[str, Any] = {"model": LenientWrapper(dst), "step": 0}
    objckpt.load(state, uri)
    assert state["step"] == 3
    assert torch.equal(dst.wqkv.view(torch.int32), src.wqkv.view(torch.int32))
    assert torch.equal(dst.out.weight, src.out.weight)


def test_fresh_tensors_not_written_back_are_an_error_naming_the_keys(tmp_path: Any) -> None:
    uri, _ = _saved(tmp_path)
    torch.manual_seed(1)
    dst = FusedAttention(4, fuse_back=False)  # nothing carries wq/wk/wv back into wqkv
    with pytest.raises(StateDictMismatchError) as ei:
        objckpt.load({"model": LenientWrapper(dst), "step": 0}, uri)
    msg = str(ei.value)
    for k in ("model.wq", "model.wk", "model.wv"):
        assert repr(k) in msg
    assert "model.out.weight" not in msg  # the parameters the fill reached are not blamed
    assert "LenientWrapper.load_state_dict()" in msg and "3 tensor(s)" in msg and "state-dict hook" in msg


def test_an_optimizer_casting_its_created_state_is_not_a_false_alarm(tmp_path: Any) -> None:
    """A fresh optimizer's state is created in the stored dtype (fp32) and cast by
    ``Optimizer.load_state_dict`` for a bf16 parameter: new tensors, same values."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    objckpt.save({"model": net, "optim": opt}, str(tmp_path / "ck"))
    net2 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-2)
    objckpt.load({"model": net2, "optim": opt2}, str(tmp_path / "ck"), cast=True)
    exp_avg = opt2.state[net2.weight]["exp_avg"]
    assert exp_avg.dtype == torch.bfloat16
    assert torch.equal(exp_avg, opt.state[net.weight]["exp_avg"].to(torch.bfloat16))
