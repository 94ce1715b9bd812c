"""Recipe: converting checkpoints with ``objckpt convert`` (here through its Python function).

A DCP directory, a torch.save file or safetensors files become an objckpt
checkpoint, and an objckpt checkpoint becomes a DCP directory again, streaming:
one tensor in memory at a time.  The command line does the same:

    objckpt convert ./dcp-step-100 s3://my-bucket/run-1/step-100
    objckpt convert s3://my-bucket/run-1/step-100 ./dcp-again
    objckpt convert model.safetensors s3://my-bucket/imported/base-model

    python examples/integrations/convert.py s3://my-bucket/converted [--endpoint-url URL]
"""
from __future__ import annotations

import argparse
import tempfile
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import objckpt
from objckpt.integrations.convert import convert


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix", help="where the converted objckpt checkpoints go")
    ap.add_argument("--endpoint-url")
    a = ap.parse_args(argv)
    opts: dict[str, Any] = {"endpoint_url": a.endpoint_url} if a.endpoint_url else {}
    state = {"model": {"w": torch.randn(64, 32), "b": torch.zeros(32)}, "step": 7}
    with tempfile.TemporaryDirectory() as tmp:
        # a DCP checkpoint as DCP's own FileSystemWriter writes it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=f"{tmp}/dcp", no_dist=True)
        r = convert(f"{tmp}/dcp", f"{a.prefix}/from-dcp", storage_options=opts)
        print(f"{r.src_format.value} -> {r.dst_format.value}: {r.tensors} tensors, {r.nbytes} bytes")
        assert objckpt.read(f"{a.prefix}/from-dcp", storage_options=opts)["step"] == 7

        # and back to a DCP directory that dcp.load reads
        convert(f"{a.prefix}/from-dcp", f"{tmp}/dcp-again", storage_options=opts)
        target = {"model": {"w": torch.empty(64, 32), "b": torch.empty(32)}, "step": 0}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=f"{tmp}/dcp-again", no_dist=True)
        assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["step"] == 7

        # safetensors -> objckpt -> safetensors, bit for bit
        save_file(state["model"], f"{tmp}/model.safetensors")
        convert(f"{tmp}/model.safetensors", f"{a.prefix}/from-safetensors", storage_options=opts)
        convert(f"{a.prefix}/from-safetensors", f"{tmp}/st-again", dst_format="safetensors", storage_options=opts)
        again = load_file(f"{tmp}/st-again/model.safetensors")
        assert all(torch.equal(again[k], v) for k, v in state["model"].items())

        # a torch.save file (memory-mapped, weights_only) -> objckpt
        torch.save(state, f"{tmp}/state.pt")
        convert(f"{tmp}/state.pt", f"{a.prefix}/from-torch-save", storage_options=opts)
        assert torch.equal(objckpt.read(f"{a.prefix}/from-torch-save", storage_options=opts)["model"]["w"],
                           state["model"]["w"])
    print("ok: dcp -> objckpt -> dcp, safetensors -> objckpt -> safetensors, torch.save -> objckpt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
