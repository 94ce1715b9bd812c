"""Recipe: export a training checkpoint's model weights as Hugging Face safetensors.

A training state saved with ``objckpt.save({"model": model.state_dict(), "optim": ...})``
exports with the ``model.`` prefix stripped; ``from_pretrained`` then loads the
directory once the model's config is next to the weights:

    objckpt export s3://my-bucket/run-1/step-1000 ./hf-model --format safetensors \
        --prefix model. --dtype bf16 --max-shard-size 5GB

    python examples/integrations/hf_export.py s3://my-bucket/run-1 [--endpoint-url URL]
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Any, Optional, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import objckpt
from objckpt.cli import main as objckpt_cli


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix", help="where the training checkpoint goes")
    ap.add_argument("--endpoint-url")
    a = ap.parse_args(argv)
    opts: dict[str, Any] = {"endpoint_url": a.endpoint_url} if a.endpoint_url else {}
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    uri = f"{a.prefix}/step-1000"
    objckpt.save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 1000}, uri,
                 storage_options=opts)
    with tempfile.TemporaryDirectory() as out:
        ep = ["--endpoint-url", a.endpoint_url] if a.endpoint_url else []
        rc = objckpt_cli(["export", uri, out, "--format", "safetensors", "--prefix", "model.",
                          "--max-shard-size", "100KB", *ep])
        assert rc == 0
        cfg.save_pretrained(out)  # from_pretrained needs the config beside the weights
        loaded = LlamaForCausalLM.from_pretrained(out).eval()
        ids = torch.tensor([[1, 5, 9, 2]])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, loaded(ids).logits)
    print("ok: exported and loaded with from_pretrained; logits identical")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
