"""Multi-rank save/load benchmark: objckpt vs DCP (FsspecWriter/Reader over s3fs), same data, same run.

    python -m benchmarks.bench_multirank --scale 0.05 --repeat 1     # quick check (~1 min)
    python -m benchmarks.bench_multirank                             # worlds 2,4, scale 0.25, median of 3

Starts objckpt's fast in-memory S3 server in its own process
(``python objckpt/testing/s3server.py --port 0``), creates a bucket, then for
each world size spawns that many gloo ranks (``torch.multiprocessing``, one
``tcp://127.0.0.1:<free port>`` process group).  Every rank builds the
GPT-like state of :mod:`benchmarks.gpt_state` (the same full tensors on every
rank), turns each 2-D tensor into a DTensor ``Shard(0)`` over a 1-D CPU
DeviceMesh of the world (FSDP-like) and keeps 1-D tensors as plain,
replicated tensors.  The load template is zeros with the same placements.

Methods, both on the default process group:

* ``objckpt``: ``objckpt.save(state, uri, storage_options=...)`` /
  ``objckpt.load(template, uri, storage_options=...)``.
* ``dcp``: ``torch.distributed.checkpoint.save/load`` with
  ``FsspecWriter(uri, sync_files=False, **s3fs options)`` /
  ``FsspecReader(uri, **s3fs options)`` (only ``storage_reader=`` to load),
  default planners; s3fs options as in :mod:`benchmarks.methods`.

Per world and method: one untimed warm-up save+load (clients, connection
pools, first-touch memory), then ``--repeat`` timed repetitions, interleaved
across methods.  Each op: rank 0 resets the server stats, barrier, op,
barrier; wall = rank 0's ``perf_counter`` between the barriers; CPU = each
rank's ``time.process_time`` delta over the op alone (all its threads);
per-rank bytes = objckpt's ``SaveResult.bytes`` / ``LoadResult.bytes``, for
DCP the server's byte delta divided by the world size (an approximation: DCP
does not report per-rank bytes); requests and bytes in/out from the server's
``/_objckpt/stats``.  Every load (warm-up included) is verified: each rank's
local shards and plain tensors are compared with the source, and any
difference aborts the run.  Checkpoints are deleted after each repetition.

Medians go to a markdown table (plus an objckpt/DCP ratio row per world) and
everything to ``benchmarks/results/multirank.json``.  On a 2-core machine
the ranks and the server share the cores (oversubscribed); the script says so.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from datetime import timedelta
from typing import Any, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
GiB = 1 << 30
METHOD_NAMES = ("objckpt", "dcp")
OPS = ("save", "load")

# --------------------------------------------------------------------------- server (parent process)


class FastS3Server:
    """``objckpt/testing/s3server.py --port 0`` run as a script (no torch import) in its own process."""

    def __init__(self, log_path: str) -> None:
        script = os.path.join(REPO_ROOT, "objckpt", "testing", "s3server.py")
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, script, "--port", "0"], cwd=REPO_ROOT,
                                     stdout=subprocess.PIPE, stderr=self._log)
        box: list[bytes] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(60)
        line = box[0].decode().strip() if box else ""
        if not line.startswith("http"):
            self.stop()
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"s3server did not print its endpoint URL (got {line!r}); log:\n{tail}")
        self.endpoint_url = line
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for _ in self.proc.stdout:  # type: ignore[union-attr]
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- helpers used in the ranks

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _stats(endpoint: str) -> dict[str, Any]:
    with _NO_PROXY.open(f"{endpoint}/_objckpt/stats", timeout=30) as r:
        return json.loads(r.read())


def _reset_stats(endpoint: str) -> None:
    req = urllib.request.Request(f"{endpoint}/_objckpt/reset_stats", data=b"", method="POST")
    _NO_PROXY.open(req, timeout=30).read()


def _server_cpu(pid: int) -> Optional[float]:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - psutil is optional
        return None


def _build_state(mesh: Any, scale: float, seed: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(state, zeros template, global state bytes): 2-D tensors as Shard(0) DTensors, 1-D plain.

    ``distribute_tensor(..., src_data_rank=None)`` splits the full tensor every
    rank generated itself (no scatter); the local shard is cloned so it owns
    its memory and the full tensor is freed."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from .gpt_state import iter_gpt_state, scaled_bytes

    def shard(full: torch.Tensor) -> Any:
        dt = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
        return DTensor.from_local(dt.to_local().clone(), mesh, [Shard(0)], run_check=False,
                                  shape=dt.shape, stride=dt.stride())

    state: dict[str, Any] = {}
    tmpl: dict[str, Any] = {}
    total = 0
    for key, full in iter_gpt_state(scaled_bytes(scale), seed):
        total += full.numel() * full.element_size()
        if full.dim() == 2:
            state[key] = shard(full)
            tmpl[key] = shard(torch.zeros_like(full))
        else:
            state[key] = full
            tmpl[key] = torch.zeros_like(full)
    return state, tmpl, total


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _verify(state: dict[str, Any], tmpl: dict[str, Any]) -> list[str]:
    import torch

    bad = []
    for k, src in state.items():
        got = tmpl.get(k)
        if got is None:
            bad.append(f"{k}: missing")
        elif not torch.equal(_local(got), _local(src)):
            bad.append(f"{k}: values differ")
    return bad


class _ObjckptMethod:
    name = "objckpt"

    def __init__(self, cfg: dict[str, Any]) -> None:
        import objckpt

        self.objckpt = objckpt
        self.opts = {"endpoint_url": cfg["endpoint"], "region_name": "us-east-1",
                     "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}

    def save(self, state: dict[str, Any], uri: str) -> dict[str, Any]:
        r = self.objckpt.save(state, uri, storage_options=self.opts)
        return {"bytes": r.bytes, "requests": r.requests, "blobs": r.blobs}

    def load(self, tmpl: dict[str, Any], uri: str) -> dict[str, Any]:
        r = self.objckpt.load(tmpl, uri, storage_options=self.opts)
        return {"bytes": r.bytes, "requests": r.requests}


class _DcpMethod:
    """DCP over s3fs; options and gotchas as in ``benchmarks.methods.DcpS3fs``."""

    name = "dcp"

    def __init__(self, cfg: dict[str, Any]) -> None:
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        self.dcp, self.writer_cls, self.reader_cls = dcp, FsspecWriter, FsspecReader
        self.fs_options = {"endpoint_url": cfg["endpoint"], "key": "testing", "secret": "testing",
                           "client_kwargs": {"region_name": "us-east-1"}}

    def save(self, state: dict[str, Any], uri: str) -> dict[str, Any]:
        # sync_files=False: with fsspec streams DCP's fsync falls back to a machine-wide os.sync().
        writer = self.writer_cls(uri, sync_files=False, thread_count=1, **self.fs_options)
        self.dcp.save(state, storage_writer=writer)
        return {}

    def load(self, tmpl: dict[str, Any], uri: str) -> dict[str, Any]:
        # Only storage_reader=: with checkpoint_id= too, reset() re-creates the fs without the options.
        self.dcp.load(tmpl, storage_reader=self.reader_cls(uri, **self.fs_options))
        return {}


def in_gloo_group(rank: int, world: int, port: int, cfg: dict[str, Any], body: Any) -> None:
    """Run ``body()`` in this spawned rank's gloo group (test credentials for the S3 server)."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["torch_threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["pg_timeout"]))
    try:
        body()
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], result_path: str) -> None:
    in_gloo_group(rank, world, port, cfg, lambda: _run_rank(rank, world, cfg, result_path))


def _run_rank(rank: int, world: int, cfg: dict[str, Any], result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    endpoint = cfg["endpoint"]
    t_build = time.perf_counter()
    mesh = init_device_mesh("cpu", (world,))
    state, tmpl, state_bytes = _build_state(mesh, cfg["scale"], cfg["seed"])
    dist.barrier()
    build_s = time.perf_counter() - t_build
    methods = {"objckpt": _ObjckptMethod, "dcp": _DcpMethod}
    methods = {m: methods[m](cfg) for m in cfg["methods"]}
    client = None
    if rank == 0:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
    runs: list[dict[str, Any]] = []

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def one(method: str, op: str, uri: str, rep: Optional[int]) -> dict[str, Any]:
        m = methods[method]
        if op == "load":
            with torch.no_grad():
                for v in tmpl.values():
                    _local(v).zero_()
        if rank == 0:
            _reset_stats(endpoint)
            scpu0 = _server_cpu(cfg["server_pid"])
        dist.barrier()
        t0 = time.perf_counter()
        c0 = time.process_time()
        err = None
        try:
            info = m.save(state, uri) if op == "save" else m.load(tmpl, uri)
        except Exception as e:  # noqa: BLE001 - reported by every rank below
            info, err = {}, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        cpu = time.process_time() - c0
        op_s = time.perf_counter() - t0
        dist.barrier()
        wall = time.perf_counter() - t0
        rec: dict[str, Any] = {"world": world, "method": method, "op": op, "rep": rep, "warmup": rep is None,
                               "wall_s": wall}
        if rank == 0:
            rec["server"] = _stats(endpoint)
            s1 = _server_cpu(cfg["server_pid"])
            rec["server_cpu_s"] = (s1 - scpu0) if s1 is not None and scpu0 is not None else None
        bad = _verify(state, tmpl) if op == "load" and err is None else []
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"cpu_s": cpu, "op_s": op_s, "info": info, "error": err, "bad": bad[:5],
                                          "n_bad": len(bad)})
        errors = [f"rank {r}: {p['error']}" for r, p in enumerate(per_rank) if p["error"]]
        if errors:
            raise RuntimeError(f"{method} {op} (world {world}) failed:\n" + "\n".join(errors))
        mism = [f"rank {r}: {p['n_bad']} tensors differ, e.g. {p['bad']}" for r, p in enumerate(per_rank) if p["n_bad"]]
        if mism:
            raise RuntimeError(f"{method} load (world {world}) VERIFICATION FAILED:\n" + "\n".join(mism))
        rec["cpu_s_per_rank"] = [p["cpu_s"] for p in per_rank]
        rec["op_s_per_rank"] = [p["op_s"] for p in per_rank]
        if method == "objckpt":
            rec["bytes_per_rank"] = [p["info"]["bytes"] for p in per_rank]
            rec["bytes_per_rank_source"] = f"objckpt {'SaveResult' if op == 'save' else 'LoadResult'}.bytes"
            rec["client_requests_per_rank"] = [p["info"]["requests"] for p in per_rank]
        elif rank == 0:
            moved = rec["server"]["bytes_in" if op == "save" else "bytes_out"]
            rec["bytes_per_rank"] = [moved / world] * world
            rec["bytes_per_rank_source"] = "server bytes / world (approximation)"
        if rank == 0:
            s = rec["server"]
            log(f"world {world} {method:8s} {op:4s} {'warm-up' if rep is None else f'rep {rep}':7s}: "
                f"{wall:6.3f} s, {state_bytes / wall / 1e9:5.2f} GB/s, CPU {sum(rec['cpu_s_per_rank']):5.2f} s "
                f"(ranks {', '.join(f'{c:.2f}' for c in rec['cpu_s_per_rank'])}), "
                f"{sum(s['requests'].values())} reqs, in {s['bytes_in'] / 1e6:.0f} MB, out {s['bytes_out'] / 1e6:.0f} MB"
                + ("  [verified]" if op == "load" else ""))
        return rec

    def cleanup(prefix: str) -> None:
        if rank == 0 and not cfg["keep"]:
            from .bench_save_load import _delete_prefix

            _delete_prefix(client, cfg["bucket"], prefix)
        dist.barrier()

    base = f"{cfg['run_id']}/w{world}"
    log(f"world {world}: state built and sharded in {build_s:.1f} s "
        f"({state_bytes / GiB:.3f} GiB, {len(state)} tensors, "
        f"{sum(1 for v in state.values() if hasattr(v, 'to_local'))} sharded)")
    for method in cfg["methods"]:  # warm-ups, untimed
        prefix = f"{base}/{method}/warmup"
        for op in OPS:
            one(method, op, f"s3://{cfg['bucket']}/{prefix}", None)
        cleanup(prefix)
    for rep in range(cfg["repeat"]):  # interleaved across methods
        for method in cfg["methods"]:
            prefix = f"{base}/{method}/r{rep}"
            for op in OPS:
                runs.append(one(method, op, f"s3://{cfg['bucket']}/{prefix}", rep))
            cleanup(prefix)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"world": world, "state_bytes": state_bytes, "tensors": len(state), "build_s": build_s,
                       "runs": runs}, f)


# --------------------------------------------------------------------------- summary (parent)


def _med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(world: int, method: str, runs: list[dict[str, Any]], state_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"world": world, "method": method}
    gb = state_bytes / 1e9
    for op in OPS:
        rs = [r for r in runs if r["method"] == method and r["op"] == op and not r["warmup"]]
        d: dict[str, Any] = {"n": len(rs)}
        d["wall_s"] = _med([r["wall_s"] for r in rs])
        d["cpu_s_total"] = _med([sum(r["cpu_s_per_rank"]) for r in rs])
        d["cpu_s_max_rank"] = _med([max(r["cpu_s_per_rank"]) for r in rs])
        d["gbps"] = gb / d["wall_s"] if d["wall_s"] else None
        d["cpu_s_per_gb"] = d["cpu_s_total"] / gb if d["cpu_s_total"] is not None else None
        d["requests"] = _med([sum(r["server"]["requests"].values()) for r in rs])
        d["ops"] = rs[-1]["server"]["ops"] if rs else None
        d["server_bytes_in"] = _med([r["server"]["bytes_in"] for r in rs])
        d["server_bytes_out"] = _med([r["server"]["bytes_out"] for r in rs])
        d["server_cpu_s"] = _med([r.get("server_cpu_s") for r in rs])
        d["bytes_per_rank"] = [_med([r["bytes_per_rank"][k] for r in rs]) for k in range(world)] if rs else None
        d["bytes_per_rank_source"] = rs[-1]["bytes_per_rank_source"] if rs else None
        out[op] = d
    return out


def _f(x: Optional[float], fmt: str = "{:.3g}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    head = ["world", "method", "save s", "load s", "save GB/s", "load GB/s", "CPU-s/GB save", "CPU-s/GB load",
            "save reqs / MB in", "load reqs / MB out", "MB/rank save", "MB/rank load", "server CPU-s save / load"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def per_rank(d: dict[str, Any], method: str) -> str:
        b = d.get("bytes_per_rank")
        if not b:
            return "–"
        lo, hi = min(b) / 1e6, max(b) / 1e6
        s = f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"
        return s + ("*" if method == "dcp" else "")

    by_world: dict[int, dict[str, dict[str, Any]]] = {}
    for s in summaries:
        by_world.setdefault(s["world"], {})[s["method"]] = s
    for world, ms in by_world.items():
        for method, s in ms.items():
            sv, ld = s["save"], s["load"]
            rows.append("| " + " | ".join([
                str(world), method, _f(sv["wall_s"]), _f(ld["wall_s"]), _f(sv["gbps"]), _f(ld["gbps"]),
                _f(sv["cpu_s_per_gb"]), _f(ld["cpu_s_per_gb"]),
                f"{_f(sv['requests'], '{:.0f}')} / {_f(sv['server_bytes_in'] and sv['server_bytes_in'] / 1e6, '{:.0f}')}",
                f"{_f(ld['requests'], '{:.0f}')} / {_f(ld['server_bytes_out'] and ld['server_bytes_out'] / 1e6, '{:.0f}')}",
                per_rank(sv, method), per_rank(ld, method),
                f"{_f(sv['server_cpu_s'], '{:.2f}')} / {_f(ld['server_cpu_s'], '{:.2f}')}",
            ]) + " |")
        if "objckpt" in ms and "dcp" in ms:
            o, d = ms["objckpt"], ms["dcp"]

            def ratio(op: str, field: str, fmt: str = "{:.2f}x") -> str:
                a, b = o[op].get(field), d[op].get(field)
                return fmt.format(a / b) if a is not None and b else "–"

            def req_ratio(op: str, bfield: str) -> str:
                return f"{ratio(op, 'requests')} / {ratio(op, bfield)}"

            rows.append("| " + " | ".join([
                str(world), "**objckpt/DCP**", ratio("save", "wall_s"), ratio("load", "wall_s"),
                ratio("save", "gbps"), ratio("load", "gbps"), ratio("save", "cpu_s_per_gb"),
                ratio("load", "cpu_s_per_gb"), req_ratio("save", "server_bytes_in"),
                req_ratio("load", "server_bytes_out"), "", "",
                f"{ratio('save', 'server_cpu_s')} / {ratio('load', 'server_cpu_s')}",
            ]) + " |")
    return "\n".join(rows)


def _environment() -> dict[str, Any]:
    import platform

    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "platform": platform.platform()}
    for mod in ("torch", "s3fs", "fsspec", "aiobotocore", "objckpt"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                    capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return env


def _spawn_world(world: int, cfg: dict[str, Any], timeout: float, rank_main: Any = None,
                 extra: tuple = ()) -> dict[str, Any]:
    """``world`` spawned ranks running ``rank_main(rank, world, port, cfg, result_path, *extra)``
    (this file's ``_rank_main`` by default); rank 0's JSON result, or TimeoutError."""
    import torch.multiprocessing as tmp

    fd, result_path = tempfile.mkstemp(prefix=f"bench-w{world}-", suffix=".json")
    os.close(fd)
    try:
        ctx = tmp.spawn(rank_main or _rank_main, args=(world, _free_port(), cfg, result_path) + extra,
                        nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=2):  # raises ProcessRaisedException (and kills the rest) if a rank fails
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"world {world}: no result within {timeout:.0f} s (ranks killed)")
        with open(result_path) as f:
            return json.load(f)
    finally:
        os.remove(result_path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Multi-rank save/load: objckpt vs DCP over s3fs, gloo ranks, "
                                             "objckpt's fast S3 server.")
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--scale", type=float, default=0.25, help="state size relative to 1.03 GiB")
    ap.add_argument("--repeat", type=int, default=3, help="timed repetitions per method and world (medians)")
    ap.add_argument("--methods", default=",".join(METHOD_NAMES), help="comma-separated subset of objckpt,dcp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", default="bench-multirank")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads in each rank")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per world before the ranks are killed")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints on the server")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "multirank.json"))
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if any(m not in METHOD_NAMES for m in methods):
        ap.error(f"--methods must be a subset of {METHOD_NAMES}")

    from .bench_save_load import _client

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id = f"mr-{stamp}-{os.getpid()}"
    cpus = os.cpu_count() or 1
    t_start = time.perf_counter()
    server = FastS3Server(os.path.join(tempfile.gettempdir(), f"{run_id}-server.log"))
    results: dict[str, Any] = {
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": vars(args) | {"worlds": worlds, "methods": methods},
        "environment": _environment(),
        "endpoint_url": server.endpoint_url,
        "notes": [
            "wall = rank 0's perf_counter between a barrier before and after the op",
            "CPU = sum over ranks of time.process_time over the op (all threads of each rank); "
            "server CPU (psutil) is separate",
            "DCP per-rank bytes = server bytes in/out divided by the world size (approximation)",
            "GB/s = global state bytes / wall; GB = 1e9 bytes",
        ],
    }
    summaries: list[dict[str, Any]] = []
    worlds_out: list[dict[str, Any]] = []
    state_bytes = 0
    try:
        print(f"fast S3 server at {server.endpoint_url} (pid {server.proc.pid})", file=sys.stderr)
        _client(server.endpoint_url).create_bucket(Bucket=args.bucket)
        for world in worlds:
            if world + 1 > cpus:
                msg = (f"world {world}: {world} ranks + the S3 server on {cpus} cores: OVERSUBSCRIBED, "
                       f"times include CPU contention")
                print(msg, file=sys.stderr)
                results["notes"].append(msg)
            cfg = {"endpoint": server.endpoint_url, "server_pid": server.proc.pid, "bucket": args.bucket,
                   "run_id": run_id, "scale": args.scale, "seed": args.seed, "repeat": args.repeat,
                   "methods": methods, "torch_threads": args.torch_threads, "keep": args.keep,
                   "pg_timeout": args.timeout}
            w = _spawn_world(world, cfg, args.timeout)
            worlds_out.append(w)
            state_bytes = w["state_bytes"]
            for m in methods:
                summaries.append(summarize(world, m, w["runs"], state_bytes))
    except BaseException:
        print(f"server log kept: {server.log_path}", file=sys.stderr)
        server.log_path = ""
        raise
    finally:
        server.stop()
        if server.log_path:
            try:
                os.remove(server.log_path)
            except OSError:
                pass

    table = markdown_table(summaries)
    total_s = time.perf_counter() - t_start
    results.update(state_bytes=state_bytes, summary=summaries, worlds_raw=worlds_out, table_markdown=table,
                   total_s=total_s)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(args.out + ".tmp", args.out)

    n_tensors = worlds_out[0]["tensors"] if worlds_out else 0
    print(f"\n{n_tensors} tensors, {state_bytes / GiB:.3f} GiB ({state_bytes / 1e9:.3f} GB), 2-D tensors Shard(0) "
          f"DTensors, 1-D replicated; gloo ranks on {cpus} cores + fast S3 server process; "
          f"median of {args.repeat} after one warm-up; total {total_s:.0f} s\n")
    print(table)
    print("\n* DCP MB/rank = server bytes / world (DCP reports no per-rank bytes). CPU-s/GB: all ranks' "
          "process CPU summed (server excluded). objckpt/DCP row: ratios of the medians (seconds and CPU: "
          "< 1 is objckpt better; GB/s: > 1 is objckpt better).")
    over = [w for w in worlds if w + 1 > cpus]
    if over:
        print(f"Oversubscribed: worlds {over} run more ranks (+ the server) than the {cpus} cores.")
    print(f"\nresults: {os.path.relpath(os.path.abspath(args.out), REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
