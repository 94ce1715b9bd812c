"""A Llama training run saved as Stateful objects and resumed in a fresh process, bit for bit.

The run (tiny ``LlamaConfig``, AdamW, transformers' cosine schedule with
warm-up) trains 3 steps, saves ``{"model": model, "optim": opt, "sched":
sched, "step": 3}`` to moto S3 and trains 5 more.  A fresh Python process
builds a new model (other random weights), optimizer (empty state) and
scheduler, loads, trains 5 steps: its losses must equal the uninterrupted
run's exactly.  Tied and untied embeddings, each restored into a normally
built model and into one built on the meta device and ``to_empty``-ed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch

import objckpt

sys.path.insert(0, os.path.dirname(__file__))
from llama_train import build, train  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_llama_resumes_bit_for_bit_in_a_fresh_process(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected: dict[bool, dict[str, Any]] = {}
        for tied in (True, False):
            model, opt, sched = build(tied)
            train(model, opt, sched, 0, 3)
            uri = f"s3://{bucket}/llama-{'tied' if tied else 'untied'}/step-3"
            state = {"model": model, "optim": opt, "sched": sched, "step": 3}
            if tied:
                objckpt.save(state, uri, storage_options=opts)
            else:  # async: staged when it returns, so training goes on at once
                handle = objckpt.async_save(state, uri, storage_options=opts)
            losses = train(model, opt, sched, 3, 5)
            if not tied:
                handle.result()
            expected[tied] = {"uri": uri, "losses": losses, "lr": opt.param_groups[0]["lr"]}
    finally:
        torch.set_num_threads(threads)

    m = objckpt.inspect(expected[False]["uri"], storage_options=opts)
    assert "model.lm_head.weight" in m.tensors and "optim.state.0.exp_avg_sq" in m.tensors
    assert m.tensors["optim.state.0.step"].shape == ()

    variants = [{"uri": expected[tied]["uri"], "tied": tied, "meta": meta}
                for tied in (True, False) for meta in (False, True)]
    spec = {"steps": 5, "storage_options": opts, "variants": variants}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "llama_train.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for v, got in zip(variants, results):
        want = expected[v["tied"]]
        assert got["step"] == 3, (v, got)
        assert got["losses"] == want["losses"], (v, got["losses"], want["losses"])
        assert got["lr"] == want["lr"], v
