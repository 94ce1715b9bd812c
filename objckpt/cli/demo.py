"""``objckpt demo``: save a small transformer's training state, restore it, verify it.

By default the target is an S3 server embedded in this process (moto, over real
HTTP on a free loopback port), so the demo needs no cloud account.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any, Iterator, Optional, cast

import torch

from .. import api
from ..storage import open_store
from ..testing.stores import CountingStore
from .options import add_command, storage_options


def build_model(d_model: int = 512, layers: int = 4, vocab: int = 8192, seed: int = 0) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, batch_first=True)
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(vocab, d_model),
            "blocks": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
            "norm": torch.nn.LayerNorm(d_model),
            "head": torch.nn.Linear(d_model, vocab, bias=False),
        }
    )
    model["head"].weight = model["embed"].weight  # tied, as in GPT-2
    return model


def train_state(model: torch.nn.ModuleDict, steps: int = 1) -> dict[str, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    embed = cast(torch.nn.Embedding, model["embed"])
    for _ in range(steps):
        tokens = torch.randint(0, embed.num_embeddings, (2, 16))
        h = model["blocks"](model["embed"](tokens))
        loss = torch.nn.functional.cross_entropy(model["head"](model["norm"](h)).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": steps, "loss": float(loss.detach())}


@contextlib.contextmanager
def embedded_s3() -> Iterator[tuple[str, dict[str, Any]]]:
    """A moto S3 server on a free loopback port, with a bucket; yields (uri, storage_options)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:  # pragma: no cover - depends on the install
        raise SystemExit("the embedded S3 target needs moto: pip install 'objckpt[demo]', or pass --uri") from None
    import logging

    import boto3  # type: ignore[import-untyped]

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._server.server_port}"  # type: ignore[attr-defined,union-attr]
        opts = {"endpoint_url": endpoint, "aws_access_key_id": "demo", "aws_secret_access_key": "demo",
                "region_name": "us-east-1"}
        boto3.client("s3", **opts).create_bucket(Bucket="objckpt-demo")
        yield "s3://objckpt-demo/runs/demo/step-1", opts
    finally:
        server.stop()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def run_demo(uri: Optional[str] = None, storage_options: Optional[dict[str, Any]] = None, *,
             d_model: int = 384, layers: int = 4, overwrite: bool = True) -> int:
    """Run the demo; returns a process exit code (0 when everything verified)."""
    with contextlib.ExitStack() as stack:
        if uri is None:
            uri, storage_options = stack.enter_context(embedded_s3())
            where = f"{uri} (embedded moto S3 at {storage_options['endpoint_url']})"
        else:
            where = uri
        print(f"objckpt demo -> {where}")
        model = build_model(d_model, layers)
        state = train_state(model)
        counting = CountingStore(open_store(uri, storage_options)[0])
        rows: list[tuple[str, int, float, int]] = []

        t = time.perf_counter()
        saved = api.save(state, uri, store=counting, overwrite=overwrite, metadata={"demo": True, "step": 1})
        rows.append(("save", saved.bytes, time.perf_counter() - t, sum(counting.ops.values())))

        fresh = build_model(d_model, layers, seed=1)
        restored = {"model": fresh.state_dict(), "step": 0, "loss": 0.0}
        counting.reset()
        t = time.perf_counter()
        api.load(restored, uri, store=counting, strict=False)
        rows.append(("load model in place", counting.bytes_read, time.perf_counter() - t, sum(counting.ops.values())))

        counting.reset()
        t = time.perf_counter()
        full = api.read(uri, store=counting)
        rows.append(("read everything", counting.bytes_read, time.perf_counter() - t, sum(counting.ops.values())))

        key = "model.blocks.layers.0.linear1.weight"
        counting.reset()
        t = time.perf_counter()
        one = api.read(uri, keys=[key], store=counting)
        rows.append(("read one tensor", counting.bytes_read, time.perf_counter() - t, sum(counting.ops.values())))

        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        opt.load_state_dict(full["optim"])
        checks = {
            "model weights equal": _equal(state["model"], fresh.state_dict()),
            "optimizer state equal": _equal(state["optim"], opt.state_dict()),
            "tied weights still tied": fresh["head"].weight is fresh["embed"].weight,
            "step and loss restored": restored["step"] == 1 and restored["loss"] == state["loss"],
            "one-tensor read equal": torch.equal(one[key], state["model"][key.split(".", 1)[1]]),
        }
        m = api.inspect(uri, storage_options=storage_options, store=counting)

    print()
    print(f"{'operation':<22} {'MB':>9} {'seconds':>9} {'GB/s':>7} {'requests':>9}")
    for name, nbytes, secs, reqs in rows:
        print(f"{name:<22} {nbytes / 1e6:9.2f} {secs:9.3f} {nbytes / secs / 1e9 if secs else 0:7.3f} {reqs:9d}")
    print()
    print(f"checkpoint: {m.tensor_count()} in {len(m.blobs)} blob(s), {m.total_blob_bytes / 1e6:.1f} MB, "
          f"manifest format v{m.format_version}")
    ok = all(checks.values())
    for name, good in checks.items():
        print(f"  [{'ok' if good else 'FAILED'}] {name}")
    print("verified" if ok else "VERIFICATION FAILED")
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args.uri, storage_options(args), d_model=args.d_model, layers=args.layers)


def add_demo(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "demo", "save, restore and verify a small transformer's state", cmd_demo)
    p.add_argument("--uri", help="s3://bucket/path, file:///dir or a path (default: embedded moto S3)")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
