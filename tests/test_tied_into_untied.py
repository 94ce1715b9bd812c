"""Tied tensors saved, loaded into a template where they are separate tensors.

A model whose embedding and output head share one tensor is saved with the
second name as an alias of the first. A fresh template (``to_empty()`` without
``tie_weights()``, or any model built from scratch) holds two tensors: both
must be filled with the same bytes, which one stored range serves twice.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt


def _tied_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(64, 32, generator=g)
    return {"model": {"embed.weight": emb, "norm.weight": torch.randn(32, generator=g), "lm_head.weight": emb},
            "step": 7}


def _untied_template() -> dict[str, Any]:
    return {"model": {"embed.weight": torch.zeros(64, 32), "norm.weight": torch.zeros(32),
                      "lm_head.weight": torch.zeros(64, 32)}, "step": 0}


def test_tied_checkpoint_loads_into_untied_template(local_or_s3: tuple[str, dict[str, Any]]) -> None:
    uri, opts = local_or_s3
    sd = _tied_state()
    objckpt.save(sd, uri, storage_options=opts)
    tmpl = _untied_template()
    objckpt.load(tmpl, uri, storage_options=opts)
    m = tmpl["model"]
    assert torch.equal(m["embed.weight"], sd["model"]["embed.weight"])
    assert torch.equal(m["lm_head.weight"], sd["model"]["embed.weight"])
    assert m["embed.weight"].data_ptr() != m["lm_head.weight"].data_ptr()  # still two tensors
    assert torch.equal(m["norm.weight"], sd["model"]["norm.weight"])
    assert tmpl["step"] == 7


def test_tied_checkpoint_loads_into_untied_module_built_on_meta(tmp_path: Any) -> None:
    """The meta-device path: ``to_empty()`` forgets the tie until ``tie_weights()``."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    src[1].weight = src[0].weight  # tied
    uri = str(tmp_path / "ck")
    objckpt.save({"model": src.state_dict()}, uri)
    with torch.device("meta"):
        dst = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    dst = dst.to_empty(device="cpu")
    sd = {"model": dst.state_dict()}
    objckpt.load(sd, uri)
    assert torch.equal(dst[0].weight, src[0].weight)
    assert torch.equal(dst[1].weight, src[0].weight)


def test_read_returns_both_names_of_a_tied_tensor(local_or_s3: tuple[str, dict[str, Any]]) -> None:
    uri, opts = local_or_s3
    sd = _tied_state()
    objckpt.save(sd, uri, storage_options=opts)
    out = objckpt.read(uri, storage_options=opts)
    assert torch.equal(out["model"]["lm_head.weight"], sd["model"]["embed.weight"])
    assert torch.equal(out["model"]["embed.weight"], sd["model"]["embed.weight"])
