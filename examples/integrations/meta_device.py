"""Models built on the meta device: no memory and no random init until the checkpoint fills them.

    python examples/integrations/meta_device.py s3://my-bucket/runs/meta   # or a local directory

``with torch.device("meta")`` builds the module structure only; ``to_empty``
then allocates uninitialised memory and ``objckpt.load`` fills every tensor of
the state dict.  Two things are *not* in a state dict, so no checkpoint can
restore them, and you must redo them after ``to_empty``:

* **Tied weights**: ``to_empty`` gives each module its own storage, so tie them
  again (``model.tie_weights()`` for a transformers model) before loading.
* **Non-persistent buffers** (``register_buffer(..., persistent=False)``), e.g.
  a Llama's rotary ``inv_freq`` and ``original_inv_freq``: compute them again
  (:func:`recompute_rotary` below).  Without it the model runs on uninitialised
  memory and its outputs are garbage.

The script saves a small Llama (transformers), restores it into a meta-built
copy and checks that every tensor and the logits are equal bit for bit.
S3 endpoint and credentials come from the AWS environment (``AWS_ENDPOINT_URL``...).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import objckpt

CONFIG: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def recompute_rotary(model: Any) -> None:
    """Llama's rotary frequencies are non-persistent buffers: compute them as the model's __init__ does."""
    rot = model.model.rotary_emb
    init = rot.compute_default_rope_parameters if rot.rope_type == "default" else ROPE_INIT_FUNCTIONS[rot.rope_type]
    inv_freq, rot.attention_scaling = init(model.config, device=rot.inv_freq.device)
    with torch.no_grad():
        rot.inv_freq.copy_(inv_freq)
        rot.original_inv_freq.copy_(inv_freq)


def build_on_meta(config: LlamaConfig, device: str = "cpu", fix_buffers: bool = True) -> Any:
    """The model without initialising it: structure on meta, then memory, ready to be loaded into."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    if fix_buffers:
        if config.tie_word_embeddings:
            model.tie_weights()
        recompute_rotary(model)
    return model


def main(uri: str, storage_options: Optional[dict] = None, fix_buffers: bool = True) -> dict[str, Any]:
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    trained = LlamaForCausalLM(config)
    objckpt.save({"model": trained}, uri, storage_options=storage_options, overwrite=True)

    model = build_on_meta(config, fix_buffers=fix_buffers)
    objckpt.load({"model": model}, uri, storage_options=storage_options)

    x = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same_logits = torch.equal(model(input_ids=x).logits, trained(input_ids=x).logits)
    same_state = all(torch.equal(v, model.state_dict()[k]) for k, v in trained.state_dict().items())
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"same_state": same_state, "same_logits": same_logits, "tied": tied}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} URI")
    out = main(sys.argv[1])
    print(out)
    assert out["same_state"] and out["same_logits"] and out["tied"], out
