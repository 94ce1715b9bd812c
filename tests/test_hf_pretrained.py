"""docs/integrations.md "Hugging Face Trainer": a Trainer step holds what a Trainer's checkpoint
folder holds (training arguments, config.json, generation_config.json, trainer_state.json), as
JSON values, and ``objckpt.integrations.hf_pretrained.from_pretrained`` builds its model in one
call, in a fresh process, with no export first: every weight bit for bit, tied weights tied,
the generation config and the training arguments as they were."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import objckpt
from objckpt.errors import MissingKeyError
from objckpt.integrations.hf_pretrained import STEP_FILES, export_pretrained, training_arguments
from recipes import load_recipe

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations" / "hf_trainer.py"


def _recipe() -> Any:
    return load_recipe("hf_trainer.py", "hf_trainer_recipe")


def test_a_trainer_step_builds_its_model_in_one_call_in_a_fresh_process(
        moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str, one_thread: Any) -> None:
    bucket, opts = moto_s3
    recipe = _recipe()
    run = recipe.train(f"s3://{bucket}/run", storage_options=opts)  # async saves of steps 2, 4, 6
    uri = f"s3://{bucket}/run/step-0000000004"

    # the step holds the files of a Trainer's checkpoint folder, as JSON values (no pickle)
    held = objckpt.read(uri, list(STEP_FILES), storage_options=opts)
    assert held["training_args"] == run["args"]
    assert held["generation_config"]["max_new_tokens"] == 8 and held["generation_config"]["top_k"] == 4
    assert held["model_config"]["architectures"] == ["GPT2LMHeadModel"]
    assert held["trainer_state"]["global_step"] == 4

    env = {**os.environ, "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
           "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"], "AWS_DEFAULT_REGION": opts["region_name"],
           "OMP_NUM_THREADS": "1"}
    job = subprocess.run([sys.executable, str(RECIPE), "--from-pretrained", uri], env=env, capture_output=True,
                         text=True, timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    built = json.loads(job.stdout.strip().splitlines()[-1])

    assert built["class"] == "GPT2LMHeadModel"  # AutoModelForCausalLM read config.json's model_type
    assert built["weights"] == run["weights"][4]  # every tensor of the state dict, bit for bit
    assert built["tied"]  # lm_head shares the embedding, as from_pretrained ties it
    want = recipe.model().generation_config.to_dict()
    assert built["generation_config"] == want and want["max_new_tokens"] == 8
    assert built["args"] == run["args"]  # TrainingArguments rebuilt from the step: the same to_dict()
    assert built["name_or_path"] == uri


def test_export_pretrained_writes_a_folder_transformers_loads(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    uri = str(tmp_path / "plain")
    objckpt.save({"model": model}, uri)  # not a Trainer step: no config.json stored

    folder = str(tmp_path / "hf")
    os.makedirs(folder)
    (pathlib.Path(folder) / "generation_config.json").write_text('{"max_new_tokens": 99}')  # an earlier export's
    with pytest.raises(MissingKeyError, match=r"(?s)plain.*holds no 'model_config'.*config="):
        export_pretrained(uri, folder)
    out = export_pretrained(uri, folder, config=config, dtype=torch.bfloat16)
    assert out.json_files == ["config.json"] and out.weights.files == ["model.safetensors"]
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]  # the stale file is gone
    assert json.loads((pathlib.Path(folder) / "config.json").read_text())["dtype"] == "bfloat16"

    loaded = GPT2LMHeadModel.from_pretrained(folder)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k

    with pytest.raises(MissingKeyError, match=r"(?s)plain.*holds no 'training_args'"):
        training_arguments(uri)


def test_cli_export_of_a_step_writes_a_folder_from_pretrained_loads(tmp_path: pathlib.Path) -> None:
    """``objckpt export`` (a new process) of a checkpoint holding the model's config writes
    config.json beside the weights, so ``from_pretrained(DIR)`` needs nothing else; a plain
    checkpoint still gets its weights only."""
    from objckpt.integrations.hf_pretrained import config_json

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    step, plain = str(tmp_path / "step"), str(tmp_path / "plain")
    objckpt.save({"model": model, "model_config": config_json(model)}, step)
    objckpt.save({"model": model}, plain)
    env = {**os.environ, "PYTHONPATH": str(RECIPE.parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for uri in (step, plain):
        out = subprocess.run([sys.executable, "-m", "objckpt", "export", uri, uri + "-hf", "--prefix", "model."],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
    assert "and config.json" in subprocess.run(
        [sys.executable, "-m", "objckpt", "export", step, step + "-again", "--prefix", "model."],
        capture_output=True, text=True, env=env, timeout=300).stdout
    assert sorted(os.listdir(step + "-hf")) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(plain + "-hf")) == ["model.safetensors"]
    loaded = GPT2LMHeadModel.from_pretrained(step + "-hf")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
