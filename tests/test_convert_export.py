"""``objckpt convert`` and ``objckpt export``: real DCP, safetensors, transformers, moto S3.

Round trips are compared bit for bit; the export is loaded by
``safetensors.torch.load_file`` and by ``LlamaForCausalLM.from_pretrained`` (a tiny
random Llama); the export from a two-rank sharded checkpoint runs in test_dcp_plugin.py.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch

import objckpt
from conftest import assert_same
from objckpt.cli import main as cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dcp_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(70, 9, generator=g), "b": torch.arange(5), "h": torch.randn(4).half(),
                      "s": torch.tensor(1.5, dtype=torch.float64)},
            "step": 12, "sched": {"lr": 0.25, "gamma": [0.5, 0.1]}}


def test_dcp_to_objckpt_to_dcp_round_trip(moto_s3: tuple[str, dict[str, Any]], tmp_path: Any,
                                          capsys: Any) -> None:
    import torch.distributed.checkpoint as dcp

    bucket, opts = moto_s3
    src, back = str(tmp_path / "dcp-src"), str(tmp_path / "dcp-back")
    sd = _dcp_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=src, no_dist=True)
    uri = f"s3://{bucket}/conv/ck"
    capsys.readouterr()
    assert cli(["convert", src, uri, "--endpoint-url", opts["endpoint_url"]]) == 0
    out = capsys.readouterr().out
    assert "converted dcp" in out and "4 tensors" in out
    assert_same(sd, objckpt.read(uri, storage_options=opts))  # nested again, values plain
    assert cli(["convert", uri, back, "--endpoint-url", opts["endpoint_url"]]) == 0
    for where in (src, back):
        tmpl = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0, "sched": {"lr": 0.0, "gamma": None}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(tmpl, checkpoint_id=where, no_dist=True)
        assert_same(sd, tmpl)
    # a DCP directory behind an fsspec URL (s3fs on the same moto server) converts the same way
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from objckpt.integrations.convert import convert
    from objckpt.integrations.sources import fsspec_options

    fs_dcp = f"s3://{bucket}/dcp-on-s3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FsspecWriter(fs_dcp, **fsspec_options(fs_dcp, opts)), no_dist=True)
    r = convert(fs_dcp, f"s3://{bucket}/conv/from-fsspec", storage_options=opts)
    assert r.src_format.value == "dcp" and r.tensors == 4
    assert_same(sd, objckpt.read(f"s3://{bucket}/conv/from-fsspec", storage_options=opts))
    # an existing destination is refused unless --overwrite
    assert cli(["convert", uri, back, "--endpoint-url", opts["endpoint_url"]]) == 2
    assert cli(["convert", src, uri, "--endpoint-url", opts["endpoint_url"]]) == 2
    assert cli(["convert", src, uri, "--overwrite", "--endpoint-url", opts["endpoint_url"]]) == 0


def test_safetensors_round_trip_and_torch_save(tmp_path: Any, capsys: Any) -> None:
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(5)
    shard1 = {"emb.weight": torch.randn(50, 8, generator=g).to(torch.bfloat16), "n.bias": torch.ones(3)}
    shard2 = {"head.weight": torch.randn(8, 50, generator=g), "mask": torch.tensor([True, False]),
              "ids": torch.arange(6, dtype=torch.int32)}
    one = tmp_path / "one.safetensors"
    save_file({**shard1, **shard2}, str(one), metadata={"format": "pt"})
    d = tmp_path / "hf"
    d.mkdir()
    save_file(shard1, str(d / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(d / "model-00002-of-00002.safetensors"))
    for src, name in ((one, "a"), (d, "b")):
        ck, out = str(tmp_path / f"ck-{name}"), tmp_path / f"out-{name}"
        assert cli(["convert", str(src), ck]) == 0
        assert objckpt.inspect(ck).metadata["converted_from"] == {"format": "safetensors"}
        assert cli(["convert", ck, str(out), "--to", "safetensors"]) == 0
        assert sorted(os.listdir(out)) == ["model.safetensors"]
        got = load_file(str(out / "model.safetensors"))
        assert_same(dict(sorted({**shard1, **shard2}.items())), dict(sorted(got.items())))
    # torch.save file -> objckpt (memory-mapped, weights_only)
    pt = tmp_path / "state.pt"
    state = {"model": {**shard1}, "step": 4, "hp": (0.9, 0.95)}
    torch.save(state, str(pt))
    from objckpt.integrations.convert import convert

    r = convert(str(pt), str(tmp_path / "ck-pt"))
    assert r.src_format.value == "torch" and r.tensors == 2
    assert_same(state, objckpt.read(str(tmp_path / "ck-pt")))
    capsys.readouterr()


def test_bad_inputs_give_clear_errors(tmp_path: Any, capsys: Any) -> None:
    txt = tmp_path / "notes.txt"
    txt.write_text("hello, not a checkpoint")
    objckpt.save({"w": torch.ones(2)}, str(tmp_path / "ck"))
    cases = [
        (["convert", str(tmp_path / "missing"), str(tmp_path / "o")], "does not exist"),
        (["convert", str(txt), str(tmp_path / "o")], "cannot tell the format"),
        (["convert", str(tmp_path), str(tmp_path / "o")], "cannot tell the format"),
        (["convert", str(txt), str(tmp_path / "o"), "--from", "pickle"], "unknown source format 'pickle'"),
        (["convert", str(tmp_path / "ck"), str(tmp_path / "o"), "--to", "torch"], "writes dcp or safetensors"),
        (["export", str(tmp_path / "ck"), str(tmp_path / "e"), "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["export", str(tmp_path / "ck"), str(tmp_path / "e"), "--prefix", "model."], "no tensor key starting"),
        (["export", str(tmp_path / "ck"), str(tmp_path / "e"), "--max-shard-size", "5 lots"], "not a size"),
        (["export", str(tmp_path / "nothing"), str(tmp_path / "e")], "no checkpoint at"),
    ]
    for argv, needle in cases:
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("objckpt: error: ") and needle in err, (argv, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()  # nothing half-written


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _check_hf_dir(out: Any, model: Any) -> None:
    from transformers import LlamaForCausalLM

    model.config.save_pretrained(str(out))
    loaded = LlamaForCausalLM.from_pretrained(str(out)).eval()
    theirs, ours = model.state_dict(), loaded.state_dict()
    assert theirs.keys() == ours.keys()
    for k in theirs:
        assert torch.equal(theirs[k], ours[k]), k
    ids = torch.arange(12).reshape(2, 6) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_export_hf_llama(moto_s3: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    from safetensors.torch import load_file

    bucket, opts = moto_s3
    ep = ["--endpoint-url", opts["endpoint_url"]]
    model = _tiny_llama()
    one = f"s3://{bucket}/llama/one"
    objckpt.save({"model": model.state_dict(), "step": 3}, one, storage_options=opts)
    out1 = tmp_path / "one"
    assert cli(["export", one, str(out1), "--format", "safetensors", "--prefix", "model.",
                "--max-shard-size", "40KB", *ep]) == 0
    index = json.loads((out1 / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.state_dict())
    merged = {}
    for f in files:
        merged.update(load_file(str(out1 / f)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    _check_hf_dir(out1, model)

    out16 = out1  # exported again into the same directory, now as one file: the old index must go
    assert cli(["export", one, str(out16), "--prefix", "model.", "--dtype", "bf16", *ep]) == 0
    got = load_file(str(out16 / "model.safetensors"))  # one shard under 5GB: a single file, no index
    assert not (out16 / "model.safetensors.index.json").exists()
    for k, v in model.state_dict().items():
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), k
    # the export from a 2-rank sharded checkpoint is in tests/test_dcp_plugin.py (it shares that test's ranks)
