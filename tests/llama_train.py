"""A tiny Llama training loop for the Stateful tests: built here and, to restore, in a fresh process.

``python tests/llama_train.py SPEC_JSON`` restores each variant of SPEC (uri,
tied, meta) from its checkpoint into a freshly built model, optimizer and
scheduler, trains ``steps`` more steps and prints one JSON line: the losses of
each variant.  One thread, so a run's floating-point reductions are the same
in every process.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import torch

VOCAB = 128


def config(tied: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tied)


def recompute_rotary(model: Any) -> None:
    """Llama's rotary ``inv_freq`` is a non-persistent buffer: not in the state dict, so a
    model built on the meta device must compute it again after ``to_empty``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rot = model.model.rotary_emb
    fn = rot.compute_default_rope_parameters if rot.rope_type == "default" else ROPE_INIT_FUNCTIONS[rot.rope_type]
    inv_freq, rot.attention_scaling = fn(model.config, device=rot.inv_freq.device)
    with torch.no_grad():
        rot.inv_freq.copy_(inv_freq)
        rot.original_inv_freq.copy_(inv_freq)


def build(tied: bool, meta: bool = False, seed: int = 0) -> tuple[Any, Any, Any]:
    """Model, AdamW and cosine schedule, built from scratch (on the meta device, then
    ``to_empty``, when ``meta``)."""
    from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = LlamaForCausalLM(config(tied))
        model.to_empty(device="cpu")
        if tied:
            model.tie_weights()  # to_empty gives each module its own storage
        recompute_rotary(model)
    else:
        model = LlamaForCausalLM(config(tied))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=20)
    return model, opt, sched


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1000 + step))


def train(model: Any, opt: Any, sched: Any, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x = batch(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def restore_and_train(uri: str, tied: bool, meta: bool, steps: int, storage_options: dict[str, Any]) -> dict:
    import objckpt

    model, opt, sched = build(tied, meta, seed=1)  # other weights than the saved run: a load that misses shows
    state = {"model": model, "optim": opt, "sched": sched, "step": -1}
    objckpt.load(state, uri, storage_options=storage_options)
    losses = train(model, opt, sched, state["step"], steps)
    return {"losses": losses, "step": state["step"], "lr": opt.param_groups[0]["lr"]}


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    out = [restore_and_train(v["uri"], v["tied"], v["meta"], spec["steps"], spec["storage_options"])
           for v in spec["variants"]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
