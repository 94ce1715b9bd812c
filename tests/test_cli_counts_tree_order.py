"""What the commands print about a checkpoint, run as ``python -m objckpt`` against a real moto S3:

* every command counts tensors one way (tied ones included, said so): ``info``, ``verify``,
  ``cp`` and ``diff`` of a model with a tied ``lm_head`` agree;
* ``info`` shows the whole tree (plain values beside the tensors), ``--all`` every row
  whole, ``--json`` a documented document whose plain values round-trip;
* ``ls`` of a folder of steps without an index orders the numbers in names as numbers.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
import transformers

import objckpt

REPO = pathlib.Path(__file__).resolve().parents[1]
COUNT = re.compile(r"(\d+) tensors \((\d+) tied: stored once\)")


def cli(opts: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m objckpt ARGS --endpoint-url ...`` in a new process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-m", "objckpt", *args, "--endpoint-url", opts["endpoint_url"]],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


def test_every_command_counts_tied_tensors_alike(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    sd = transformers.GPT2LMHeadModel(cfg).state_dict()  # lm_head.weight is transformer.wte.weight
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    src, dst = f"s3://{bucket}/run/model", f"s3://{bucket}/copy/model"
    objckpt.save(sd, src, storage_options=opts)

    outputs = {"cp": cli(opts, "cp", src, dst).stdout}
    outputs["info"] = cli(opts, "info", src).stdout
    outputs["verify"] = cli(opts, "verify", dst).stdout
    outputs["diff"] = cli(opts, "diff", src, dst).stdout
    counts = {cmd: COUNT.findall(out) for cmd, out in outputs.items()}
    assert counts == {cmd: [(str(len(sd)), "1")] for cmd in outputs}, outputs
    doc = json.loads(cli(opts, "info", src, "--json").stdout)
    assert (doc["tensors"]["count"], doc["tensors"]["tied"]) == (len(sd), 1)
    assert doc["tree"]["lm_head.weight"]["$tensor"]["tied_to"] == "transformer.wte.weight"


def _plain(x: Any) -> Any:
    """A plain value as JSON holds it: tuples as lists."""
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def test_info_shows_the_whole_tree_and_its_json_round_trips_the_plain_values(
        moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])  # 16 tensors: summed up
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        sched.step()
    random.seed(3)
    nested = {"run": {"name": "llama-tiny", "tags": ["a", "b"], "limits": (1, 2.5), "resumed": None},
              "scale": float("inf"), "raw": b"\x00\xff", "dtype": torch.bfloat16, "by_rank": {0: "n0", 1: "n1"}}
    trainer_state = {"global_step": 7, "best_metric": 0.25, "log_history": [{"loss": 1.5, "step": 5}],
                     "note": "x" * 300}
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "scheduler": sched.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
             "trainer_state": trainer_state, "nested": nested, "step": 7}
    uri = f"s3://{bucket}/run/step-7"
    objckpt.save(state, uri, storage_options=opts)

    rows = {line.split()[0]: line for line in cli(opts, "info", uri).stdout.splitlines()[3:]}
    assert "16 tensors: float32" in rows["model"] and "model.0.weight" not in rows
    assert "tuple[3]" in rows["rng.python"] and rows["rng.python"].endswith("...")
    assert "16 tensors: float32" in rows["optim"] and "optim.state.0.momentum_buffer" not in rows
    assert "list[1]" in rows["optim.param_groups"] and '"momentum": 0.9' in rows["optim.param_groups"]
    assert "dict[" in rows["scheduler"] and '"last_epoch": 2' in rows["scheduler"]
    assert '"gamma": 0.5' in rows["scheduler"]
    assert rows["rng.torch"].split()[1:3] == ["uint8", f"[{torch.get_rng_state().numel()}]"]
    assert '"global_step": 7' in rows["trainer_state"]
    assert '"name": "llama-tiny"' in rows["nested"] and rows["step"].split()[1:] == ["int", "7"]

    every = {line.split()[0]: line for line in cli(opts, "info", uri, "--all").stdout.splitlines()[3:]}
    assert "model.7.bias" in every and "optim.state.0.momentum_buffer" in every and "x" * 300 in every["trainer_state"]
    assert "scale" not in every and "inf" in every["nested"] and "torch.bfloat16" in every["nested"]

    doc = json.loads(cli(opts, "info", uri, "--json").stdout)
    assert doc["schema"] == "objckpt.info/1" and doc["uri"] == uri and doc["format_version"] >= 1
    tree = doc["tree"]
    for key in ("scheduler", "trainer_state", "step"):
        assert tree[key] == _plain(state[key]), key
    assert tree["rng"]["python"] == _plain(random.getstate())
    assert tree["optim"]["param_groups"] == _plain(opt.state_dict()["param_groups"])
    assert tree["nested"]["run"] == _plain(nested["run"])
    assert tree["nested"]["scale"] == {"$float": "inf"} and math.isinf(float(tree["nested"]["scale"]["$float"]))
    assert tree["nested"]["raw"] == {"$bytes": "AP8="} and tree["nested"]["dtype"] == {"$dtype": "bfloat16"}
    assert tree["nested"]["by_rank"] == {"$dict": [[0, "n0"], [1, "n1"]]}
    rng = torch.get_rng_state()
    assert tree["rng"]["torch"] == {"$tensor": {"key": "rng.torch", "dtype": "uint8", "shape": list(rng.shape),
                                                "bytes": rng.numel()}}
    assert tree["model"]["0.weight"]["$tensor"] == {"key": "model.0.weight", "dtype": "float32", "shape": [4, 4],
                                                    "bytes": 64}
    assert doc["tensors"]["count"] == 16 + 16 + 1 and doc["tensors"]["tied"] == 0
    assert doc["rank_trees"] is None and doc["blobs"]["count"] >= 1
    manifest = json.loads(cli(opts, "info", uri, "--manifest").stdout)  # the manifest itself, as before
    assert "model.0.weight" in manifest["tensors"] and "schema" not in manifest


@pytest.mark.parametrize("names", [["step-5", "step-10", "step-15", "step-20"],
                                   ["epoch=9-step=90.ckpt", "epoch=10-step=100.ckpt", "epoch=10-step=101.ckpt"]],
                         ids=["steps", "lightning"])
def test_ls_of_a_folder_without_an_index_orders_numbers_as_numbers(moto_s3: tuple[str, dict[str, Any]],
                                                                   names: list[str]) -> None:
    bucket, opts = moto_s3
    for name in reversed(names):
        objckpt.save({"w": torch.zeros(2)}, f"s3://{bucket}/run/{name}", storage_options=opts)
    out = cli(opts, "ls", f"s3://{bucket}/run").stdout.split()
    assert out == [f"s3://{bucket}/run/{n}" for n in names]
