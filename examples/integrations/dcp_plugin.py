"""Recipe: torch.distributed.checkpoint (DCP) saving and loading through objckpt.

DCP keeps its planning (flattening, DTensor shards, dedup of replicated tensors);
objckpt's StorageWriter packs the bytes into blobs and commits a JSON manifest
last, so the checkpoint is an ordinary objckpt checkpoint: ``dcp.load`` reads it
back (any world size), and so do ``objckpt.load`` / ``objckpt.read``.

    python examples/integrations/dcp_plugin.py s3://my-bucket/run-1 [--endpoint-url URL]

In a torch.distributed job every rank runs the same calls (drop ``no_dist=True``).
"""
from __future__ import annotations

import argparse
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp

import objckpt
from objckpt.dcp import StorageReader, StorageWriter


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix", help="where to put the checkpoints, e.g. s3://bucket/run-1 or a local directory")
    ap.add_argument("--endpoint-url")
    a = ap.parse_args(argv)
    opts: dict[str, Any] = {"endpoint_url": a.endpoint_url} if a.endpoint_url else {}
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 16)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "step": 100}

    # 1. dcp.save: the writer takes the URI, or pass checkpoint_id= to dcp.save per step
    uri = f"{a.prefix}/step-100"
    dcp.save(state, storage_writer=StorageWriter(uri, storage_options=opts), no_dist=True)

    # 2. dcp.async_save: returns once DCP has staged the state; wait before the next save
    fut = dcp.async_save(state, storage_writer=StorageWriter(storage_options=opts),
                         checkpoint_id=f"{a.prefix}/step-101", no_dist=True)
    fut.result()

    # 3. dcp.load into a fresh model (any world size / sharding when run distributed)
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    target = {"model": model2.state_dict(), "step": 0}
    dcp.load(target, storage_reader=StorageReader(uri, storage_options=opts), no_dist=True,
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))  # the optimizer state is not wanted here
    assert target["step"] == 100
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), model2.state_dict().values()))

    # 4. the same checkpoint without DCP: objckpt.read returns the nested state, values included
    back = objckpt.read(uri, storage_options=opts)
    assert back["step"] == 100 and torch.equal(back["model"]["0.weight"], model.state_dict()["0.weight"])
    print(f"ok: {len(objckpt.inspect(uri, storage_options=opts).tensors)} tensors at {uri} "
          "(written by dcp.save, read by dcp.load and objckpt.read)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
