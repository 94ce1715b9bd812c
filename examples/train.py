"""Train a small GPT-like model on CPU, checkpointing every N steps, and measure the stall.

The lines that matter (lazy async save: staging overlaps the next forward/backward)::

    import objckpt
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
    handle = objckpt.async_save(state, f"{uri}/step-{step:06d}", lazy=True)  # returns at once
    handle.wait_staged()   # right before the next optimizer.step(): the state is in host memory
    handle.result()        # before exiting: the SaveResult once committed (raises if the save failed)

Without ``lazy=True`` the call itself returns once the state is staged (no
``wait_staged`` needed); ``objckpt.save`` blocks until the checkpoint is committed.
A new ``async_save`` first waits for the previous one to commit (``max_in_flight=1``).

Run::

    python examples/train.py                          # lazy async saves to a local fast S3 server
    python examples/train.py --mode sync --uri file:///tmp/ckpt
    python examples/train.py --uri s3://bucket/run-1  # real S3: endpoint/credentials from the environment
    python examples/train.py --all                    # none/sync/async/lazy/dcp_async..., one table

Without ``--uri`` it starts ``python -m testkit.s3server`` (in-memory S3, a
benchmark target only) in a subprocess.  Modes: ``none`` (no checkpoints: the
baseline), ``sync`` (``objckpt.save``), ``async`` (``objckpt.async_save``), ``lazy``
(``async_save(lazy=True)`` + ``wait_staged()`` before ``optimizer.step()``),
``dcp_async`` (``torch.distributed.checkpoint.async_save``, defaults: the writer makes a
fresh CPU copy every save; over s3fs for ``s3://``), ``dcp_async_cached`` (the same with a
``DefaultStager`` kept across saves, so its staging copies are reused).

Printed per run: productive time (forward, backward, optimizer step), stall (time
blocked in checkpoint calls and waits), the effective training time ratio =
productive / loop wall time, the median step time (background uploads share the
CPU, so steps can get slower even when nothing stalls), and the wait for the last
save at the end ("drain", outside the loop).  The model: 6 pre-LN transformer
blocks, d=384, vocab 8192 (tied head), 13.8 M parameters: 166 MB of model + AdamW
state; with ``--batch 2 --seq 16`` a step takes ~50-100 ms on one core.

``--threads`` (default 1) sets torch's intra-op threads.  On a 2-core machine one
thread for training leaves the other core to the checkpoint's background work (and
the local S3 server); with two OpenMP threads and a busy second core every parallel
region can wait a scheduler slice, and steps get several times slower.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ["none", "sync", "async", "lazy", "dcp_async", "dcp_async_cached"]
REGION, KEY, SECRET = "us-east-1", "testing", "testing"


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 384, layers: int = 6, heads: int = 6, max_seq: int = 256) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- checkpointers


class Checkpointer:
    """``save`` at a checkpoint step, ``before_step`` before every ``optimizer.step()``,
    ``finish`` at the end; each returns when training may go on."""

    def __init__(self, uri: str, options: Optional[dict[str, Any]]) -> None:
        self.uri, self.options = uri.rstrip("/"), options

    def key(self, step: int) -> str:
        return f"{self.uri}/step-{step:06d}"

    def save(self, state: dict[str, Any], step: int) -> None:
        pass

    def before_step(self) -> None:
        pass

    def finish(self) -> None:
        pass


class Sync(Checkpointer):
    def save(self, state: dict[str, Any], step: int) -> None:
        import objckpt

        objckpt.save(state, self.key(step), storage_options=self.options)


class Async(Checkpointer):
    lazy = False

    def __init__(self, uri: str, options: Optional[dict[str, Any]]) -> None:
        super().__init__(uri, options)
        self.handle: Any = None

    def save(self, state: dict[str, Any], step: int) -> None:
        import objckpt

        # waits for the previous save to commit first (max_in_flight=1), and raises its error
        if self.handle is not None:
            self.handle.result()
        self.handle = objckpt.async_save(state, self.key(step), storage_options=self.options, lazy=self.lazy)

    def before_step(self) -> None:
        if self.handle is not None and self.lazy:
            self.handle.wait_staged()

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.result()


class Lazy(Async):
    lazy = True


class DcpAsync(Checkpointer):
    cached = False

    def __init__(self, uri: str, options: Optional[dict[str, Any]]) -> None:
        super().__init__(uri, options)
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.future: Any = None
        self.stager: Any = None
        if self.cached:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                       use_async_staging=False, use_non_blocking_copy=False))

    def writer(self, step: int) -> Any:
        key = self.key(step)
        if key.startswith("file://") or "://" not in key:
            return self.dcp.FileSystemWriter(key[len("file://"):] if key.startswith("file://") else key)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        o = self.options or {}
        fs_opts: dict[str, Any] = {}
        if o.get("endpoint_url"):
            fs_opts["endpoint_url"] = o["endpoint_url"]
        if o.get("aws_access_key_id"):
            fs_opts.update(key=o["aws_access_key_id"], secret=o.get("aws_secret_access_key"))
        if o.get("region_name"):
            fs_opts["client_kwargs"] = {"region_name": o["region_name"]}
        # sync_files=False: with fsspec streams DCP's fsync is a machine-wide os.sync()
        return FsspecWriter(key, sync_files=False, **fs_opts)

    def save(self, state: dict[str, Any], step: int) -> None:
        if self.future is not None:
            self.future.result()  # DCP: one async save at a time
        kw = {"async_stager": self.stager} if self.stager is not None else {}
        self.future = self.dcp.async_save(state, storage_writer=self.writer(step), no_dist=True, **kw)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
        if self.stager is not None:
            self.stager.close()


class DcpAsyncCached(DcpAsync):
    cached = True


CHECKPOINTERS = {"none": Checkpointer, "sync": Sync, "async": Async, "lazy": Lazy, "dcp_async": DcpAsync,
                 "dcp_async_cached": DcpAsyncCached}


# --------------------------------------------------------------------------- training


def train(args: argparse.Namespace, uri: str, options: Optional[dict[str, Any]]) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = GPT(args.vocab, args.d, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    n_params = sum(p.numel() for p in model.parameters())
    ck = CHECKPOINTERS[args.mode](uri, options)
    g = torch.Generator().manual_seed(args.seed)

    productive, stall, call_stall = 0.0, 0.0, 0.0
    step_ms: list[float] = []
    ckpt_stalls: list[float] = []  # per checkpoint: the save call + the wait before the next step
    pending: Optional[int] = None
    loss = torch.zeros(())
    t_loop = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=False)  # keep the grad buffers: no page faults every step
        loss.backward()
        t1 = time.perf_counter()
        ck.before_step()  # lazy: the state must be staged before the in-place update
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if pending is not None:
            ckpt_stalls[-1] += t2 - t1
            pending = None
        if step % args.every == 0 and args.mode != "none":
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            ck.save(state, step)
            t4 = time.perf_counter()
            ckpt_stalls.append(t4 - t3)
            call_stall += t4 - t3
            pending = step
        t4 = time.perf_counter()
        productive += (t1 - t0) + (t3 - t2)
        stall += (t2 - t1) + (t4 - t3)
        step_ms.append(((t1 - t0) + (t3 - t2)) * 1e3)
    loop_wall = time.perf_counter() - t_loop
    t = time.perf_counter()
    ck.finish()
    drain = time.perf_counter() - t

    verified = None
    if args.mode in ("sync", "async", "lazy") and args.steps % args.every == 0:
        import objckpt

        fresh = GPT(args.vocab, args.d, args.layers, args.heads)
        objckpt.load({"model": fresh.state_dict()}, ck.key(args.steps), storage_options=options, strict=False)
        verified = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                       if isinstance(t, torch.Tensor))
    return {
        "mode": args.mode, "steps": args.steps, "every": args.every, "checkpoints": len(ckpt_stalls),
        "params": n_params, "state_bytes": state_bytes, "threads": args.threads,
        "productive_s": productive, "stall_s": stall, "call_stall_s": call_stall,
        "wait_stall_s": stall - call_stall, "loop_wall_s": loop_wall, "drain_s": drain,
        "ratio": productive / loop_wall, "median_step_ms": statistics.median(step_ms),
        "first_ckpt_stall_s": ckpt_stalls[0] if ckpt_stalls else None,
        "median_ckpt_stall_s": statistics.median(ckpt_stalls[1:]) if len(ckpt_stalls) > 1 else None,
        "final_loss": float(loss.detach()), "verified_last": verified, "uri": uri,
    }


# --------------------------------------------------------------------------- local S3 server, --all


class LocalS3:
    """``python -m testkit.s3server --port 0`` in a subprocess, with a bucket."""

    def __init__(self, bucket: str = "train") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "testkit.s3server", "--port", "0"],
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # testkit/ is in the checkout
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.endpoint_url = (self.proc.stdout.readline() or "").strip()  # type: ignore[union-attr]
        if not self.endpoint_url.startswith("http"):
            self.stop()
            raise RuntimeError("the local S3 server did not start (pip install -e '.[bench]'?)")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION, aws_access_key_id=KEY,
                     aws_secret_access_key=SECRET).create_bucket(Bucket=bucket)
        self.uri = f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"
        self.options = {"endpoint_url": self.endpoint_url, "region_name": REGION,
                        "aws_access_key_id": KEY, "aws_secret_access_key": SECRET}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _fmt(x: Optional[float], f: str = "{:.2f}") -> str:
    return "–" if x is None else f.format(x)


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r["loop_wall_s"] for r in rows if r.get("mode") == "none" and "loop_wall_s" in r), None)
    head = ["mode", "ratio (productive / wall)", "total stall s (in save / in waits)", "stall per ckpt s (first / median)",
            "median step ms", "loop wall s", "wall vs none", "drain s", "verified"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['mode']} | failed: {r['error'][:120]} |" + " |" * (len(head) - 2))
            continue
        out.append("| " + " | ".join([
            r["mode"], _fmt(r["ratio"], "{:.3f}"),
            f"{r['stall_s']:.3f} ({r['call_stall_s']:.3f} / {r['wait_stall_s']:.3f})",
            f"{_fmt(r['first_ckpt_stall_s'], '{:.3f}')} / {_fmt(r['median_ckpt_stall_s'], '{:.3f}')}",
            _fmt(r["median_step_ms"], "{:.1f}"), _fmt(r["loop_wall_s"]),
            _fmt(r["loop_wall_s"] / base if base else None, "{:.3f}×"), _fmt(r["drain_s"], "{:.3f}"),
            {True: "yes", False: "NO", None: "–"}[r.get("verified_last")],
        ]) + " |")
    return "\n".join(out)


def run_all(args: argparse.Namespace) -> int:
    server = LocalS3() if args.uri is None else None
    base_uri = server.uri if server else args.uri.rstrip("/")
    rows: list[dict[str, Any]] = []
    try:
        for mode in args.modes.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--json",
                   "--uri", f"{base_uri}/{mode}-{uuid.uuid4().hex[:6]}"]
            if server:
                cmd += ["--endpoint-url", server.endpoint_url]
            for k in ("steps", "every", "threads", "batch", "seq", "vocab", "d", "layers", "heads", "seed"):
                cmd += [f"--{k}", str(getattr(args, k))]
            print(f"{mode} ...", file=sys.stderr, flush=True)
            p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
            rows.append(json.loads(line) if line else {"mode": mode, "error": f"exit {p.returncode}"})
    finally:
        if server:
            server.stop()
    r0 = next((r for r in rows if "state_bytes" in r), None)
    if r0:
        print(f"\n{r0['params'] / 1e6:.1f} M params, {r0['state_bytes'] / 1e6:.0f} MB state (model + AdamW), "
              f"{args.steps} steps, checkpoint every {args.every}, {args.threads} training thread(s), "
              f"{'local fast S3 server' if server else base_uri}:\n")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "table_markdown": table(rows)}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default="lazy")
    ap.add_argument("--all", action="store_true", help="run every mode (--modes) in its own process; print a table")
    ap.add_argument("--modes", default=",".join(MODES), help="with --all")
    ap.add_argument("--uri", default=None, help="checkpoint prefix (s3://..., file:///...); default: a local "
                    "fast S3 server started for this run")
    ap.add_argument("--endpoint-url", default=None, help="S3 endpoint (else from the environment)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for training")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON line (used by --all)")
    ap.add_argument("--out", default=None, help="with --all: write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.all:
        return run_all(args)

    server = None
    options: Optional[dict[str, Any]] = None
    uri = args.uri
    if uri is None and args.mode != "none":
        server = LocalS3()
        uri, options = server.uri, server.options
    elif args.endpoint_url:
        options = {"endpoint_url": args.endpoint_url, "region_name": REGION,
                   "aws_access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", KEY),
                   "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET)}
    try:
        r = train(args, uri or "none://", options)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt) or not args.json:
            raise
        print(json.dumps({"mode": args.mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
        return 1
    finally:
        if server:
            server.stop()
    if args.json:
        print(json.dumps(r), flush=True)
    else:
        print(f"{args.mode}: {r['params'] / 1e6:.1f} M params, {r['state_bytes'] / 1e6:.0f} MB state, "
              f"{r['checkpoints']} checkpoints to {uri}\n"
              f"  effective training time ratio {r['ratio']:.3f} (productive {r['productive_s']:.2f} s / "
              f"loop wall {r['loop_wall_s']:.2f} s); total stall {r['stall_s']:.3f} s "
              f"({r['call_stall_s']:.3f} s in the save calls, {r['wait_stall_s']:.3f} s waiting before steps) "
              f"(first checkpoint {_fmt(r['first_ckpt_stall_s'], '{:.3f}')} s, then median "
              f"{_fmt(r['median_ckpt_stall_s'], '{:.3f}')} s); median step {r['median_step_ms']:.1f} ms; "
              f"last save committed {r['drain_s']:.3f} s after the loop"
              + ("" if r["verified_last"] is None else f"; last checkpoint verified: {r['verified_last']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
