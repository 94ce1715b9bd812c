"""The first call in a new process: a small restore's wall time, cold against warm.

    python -m benchmarks.bench_first_call                          # 6 rounds, this tree
    python -m benchmarks.bench_first_call --baseline 1d0cc9d,5cee7c6  # and the objckpt of commits, alternated
    python -m benchmarks.bench_first_call --profile                 # one cold load under cProfile (top 25)

One in-memory S3 server process (``testkit.s3server``) holds a small checkpoint
(``--mib``, default 4 MiB in 8 tensors). Each round starts a new Python process per
variant (alternating their order) that imports torch (untimed), then times
``import objckpt``, the first ``objckpt.load`` (**cold**: store opening, S3
configuration, credentials, threads, connections, all of it) and the median of three more
loads (**warm**). What bench_cold_warm leaves out of its timed op (the store's opening
in ``setup``) is inside the cold figure here: this is what a restarting job waits on.
Medians (min–max) over rounds; the ratio cold / warm is the figure issue 26 targets.

``--peers boto3,s3tc`` times the same first call with other clients in their own new
processes, for scale: ``boto3`` (import, client, eight ``get_object`` reads of the same
tensors stored as objects, copied into fresh tensors) and ``s3tc`` (s3torchconnector's
``S3Checkpoint`` with its CRT client, ``torch.load`` of the same tensors saved with
``torch.save``). Their "import" column is their client library's import.

``--creds container --creds-delay-ms 30`` gives objckpt's processes no keys in options or
the environment: botocore's chain finds them at a container credentials endpoint
(``AWS_CONTAINER_CREDENTIALS_FULL_URI``, what ECS and EKS Pod Identity serve) run here,
answering after the delay (a stand-in for IMDS, a pod identity agent or STS).

Every process imports from compiled bytecode, as an installed package does (pip compiles
at install): the processes write and read it under a temporary ``PYTHONPYCACHEPREFIX``
(one untimed process per variant first), whatever ``PYTHONDONTWRITEBYTECODE`` says.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from . import harness as h


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One new process: import, one cold load, three warm ones (run with ``--one``)."""
    import torch

    if args.creds == "container":  # botocore's chain must find the keys at the endpoint
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
        os.environ["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = args.creds_url
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    root = args.root
    if root:
        sys.path.insert(0, root)
    t0 = time.perf_counter()
    import objckpt

    imported = time.perf_counter() - t0
    if root and not os.path.abspath(objckpt.__file__).startswith(os.path.abspath(root)):
        raise RuntimeError("the baseline objckpt was not the one imported")
    template = {f"t{i}": torch.empty(args.mib * (1 << 20) // 4 // 8) for i in range(8)}
    opts = h.s3_options(args.endpoint_url)
    if args.creds == "container":
        opts = {k: v for k, v in opts.items() if not k.startswith("aws_")}
    uri = f"s3://{args.bucket}/first-call"
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t1 = time.perf_counter()
    cpu1 = time.process_time()
    objckpt.load(template, uri, storage_options=opts)
    cold, cold_cpu = time.perf_counter() - t1, time.process_time() - cpu1
    if prof is not None:
        import io
        import pstats

        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue(), file=sys.stderr)
    warm = []
    for _ in range(3):
        t = time.perf_counter()
        objckpt.load(template, uri, storage_options=opts)
        warm.append(time.perf_counter() - t)
    mods = sorted(m for m in ("botocore", "aiobotocore", "aiohttp", "boto3") if m in sys.modules)
    return {"import_s": imported, "cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": statistics.median(warm),
            "modules": mods}


def peer_child(args: argparse.Namespace) -> dict[str, Any]:
    """One new process of a peer client (``--one --peer NAME``): import, one cold read, three warm."""
    import torch

    n = args.mib * (1 << 20) // 4 // 8
    t0 = time.perf_counter()
    if args.peer == "boto3":
        import boto3  # noqa: F401  (its import is what the column shows)

        imported = time.perf_counter() - t0

        def once() -> None:
            client = once.client if hasattr(once, "client") else h.boto3_client(args.endpoint_url)
            once.client = client  # type: ignore[attr-defined]
            for i in range(8):
                body = client.get_object(Bucket=args.bucket, Key=f"first-call-peer/t{i}")["Body"].read()
                torch.empty(n).view(torch.uint8).copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))
    else:
        from s3torchconnector import S3Checkpoint

        imported = time.perf_counter() - t0

        def once() -> None:
            ckpt = once.ckpt if hasattr(once, "ckpt") else S3Checkpoint(h.REGION, endpoint=args.endpoint_url)
            once.ckpt = ckpt  # type: ignore[attr-defined]
            with ckpt.reader(f"s3://{args.bucket}/first-call-peer.pt") as f:
                torch.load(f, weights_only=True)

    t1, cpu1 = time.perf_counter(), time.process_time()
    once()
    cold, cold_cpu = time.perf_counter() - t1, time.process_time() - cpu1
    warm = []
    for _ in range(3):
        t = time.perf_counter()
        once()
        warm.append(time.perf_counter() - t)
    return {"import_s": imported, "cold_s": cold, "cold_cpu_s": cold_cpu, "warm_s": statistics.median(warm),
            "modules": [args.peer]}


def _store_for_peers(url: str, bucket: str, state: dict[str, Any]) -> None:
    """The same tensors as objects (boto3) and as one ``torch.save`` file (s3torchconnector)."""
    import io

    import torch

    client = h.boto3_client(url)
    for k, t in state.items():
        client.put_object(Bucket=bucket, Key=f"first-call-peer/{k}", Body=t.numpy().tobytes())
    buf = io.BytesIO()
    torch.save(state, buf)
    client.put_object(Bucket=bucket, Key="first-call-peer.pt", Body=buf.getvalue())


class _ContainerCreds:
    """A container credentials endpoint on loopback (a thread of the driver) that answers
    with the benchmark's keys after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        import http.server
        import threading

        body = json.dumps({"AccessKeyId": h.ACCESS_KEY, "SecretAccessKey": h.SECRET_KEY, "Token": "bench",
                           "Expiration": "2099-01-01T00:00:00Z"}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/creds"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})" if xs else "–"


def drive(args: argparse.Namespace) -> int:
    roots = {"this tree": ""}
    for ref in (r for r in (args.baseline or "").split(",") if r):
        roots[ref] = h.export_objckpt(ref)
    peers = [p for p in (args.peers or "").split(",") if p]
    variants = list(roots) + peers
    pyc = tempfile.mkdtemp(prefix="objckpt-pyc-")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode as installed (see the module docstring)
    os.environ["PYTHONPYCACHEPREFIX"] = pyc
    creds = _ContainerCreds(args.creds_delay_ms / 1000) if args.creds == "container" else None
    extra = ["--creds", args.creds] + (["--creds-url", creds.url] if creds else [])
    with h.Server("fast", args.bucket) as server:
        import torch

        sys.path.insert(0, h.REPO_ROOT)
        import objckpt

        state = {f"t{i}": torch.randn(args.mib * (1 << 20) // 4 // 8) for i in range(8)}
        objckpt.save(state, f"s3://{args.bucket}/first-call", storage_options=h.s3_options(server.url))
        if peers:
            _store_for_peers(server.url, args.bucket, state)
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for rnd in range(-1, args.rounds):  # round -1: untimed, writes each variant's bytecode
            for v in (variants if rnd % 2 == 0 else variants[::-1]):
                which = ["--peer", v] if v in peers else ["--root", roots[v]]
                r = h.run_json(["-m", "benchmarks.bench_first_call", "--one", *which, "--endpoint-url",
                                server.url, "--bucket", args.bucket, "--mib", str(args.mib), *extra]
                               + (["--profile"] if args.profile and rnd >= 0 else []), 300,
                               show_stderr=args.profile and rnd >= 0)
                if rnd < 0:
                    continue
                if "cold_s" not in r:
                    h.log(f"round {rnd} {v}: {r.get('error')}")
                    continue
                results[v].append(r)
                h.log(f"round {rnd} {v}: import {r['import_s']:.3f} s, cold {r['cold_s']:.3f} s "
                      f"(CPU {r['cold_cpu_s']:.3f}), warm {r['warm_s']:.3f} s; loaded {r['modules']}")
    for root in [*roots.values(), pyc]:
        if root:
            shutil.rmtree(root, ignore_errors=True)
    if creds is not None:
        creds.close()
    print(f"\ncredentials: {args.creds}" + (f" (endpoint answering after {args.creds_delay_ms} ms)" if creds else ""))
    print(f"\n{args.mib} MiB in 8 tensors, fast in-memory server, {args.rounds} new processes per variant; "
          "median (min–max) s:\n")
    rows = []
    for v, rs in results.items():
        ratio = [r["cold_s"] / r["warm_s"] for r in rs]
        rows.append([v, _fmt([r["import_s"] for r in rs]),
                     _fmt([r["cold_s"] for r in rs]), _fmt([r["cold_cpu_s"] for r in rs]),
                     _fmt([r["warm_s"] for r in rs]), _fmt(ratio)])
    print(h.md_table(["client", "import s", "cold load s", "cold load CPU s", "warm load s", "cold / warm"],
                     rows))
    if args.name:
        path = h.write_results(h.result_path(args.name), {"name": args.name, "config": vars(args),
                                                          "results": results})
        print(f"\nresults: {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mib", type=int, default=4, help="checkpoint size in MiB (8 tensors)")
    ap.add_argument("--baseline", default=None, metavar="REFS",
                    help="also run the objckpt of these git refs (comma-separated), alternated")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each cold load (stderr)")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--name", default=None, help="benchmarks/results/<name>.json")
    ap.add_argument("--peers", default=None, help="also time these clients' first call: boto3, s3tc")
    ap.add_argument("--one", action="store_true", help="internal: one new process")
    ap.add_argument("--peer", default="", help="internal: the peer client of this process")
    ap.add_argument("--root", default="", help="internal: the objckpt source to import first")
    ap.add_argument("--endpoint-url", default=None)
    ap.add_argument("--creds", choices=("options", "container"), default="options",
                    help="objckpt's keys: in the storage options, or from botocore's chain at a container endpoint")
    ap.add_argument("--creds-delay-ms", type=float, default=30.0, help="the container endpoint's answer delay")
    ap.add_argument("--creds-url", default="", help="internal: the container endpoint")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(peer_child(args) if args.peer else child(args)), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
