"""Save/load benchmark driver: every method side by side, each op in its own process.

    python -m benchmarks.bench_save_load --target moto-ranged --scale 0.05 --repeat 1
    python -m benchmarks.bench_save_load --target fast --methods objckpt_s3,dcp_s3fs --repeat 3 --ceiling

Starts the S3 target in a subprocess (``moto``: stock moto; ``moto-ranged``:
moto patched to serve ranged GETs without copying the whole object, see
:mod:`benchmarks.moto_server`; ``fast``: ``python -m objckpt.testing.s3server``;
``none``: local methods only), creates a bucket, then for each method and
repeat runs ``save``, ``load`` and ``read_one`` through
:mod:`benchmarks.run_one` subprocesses (so CPU time and peak RSS are per
method and op), takes medians, prints a markdown table and writes everything
to ``benchmarks/results/<name>.json``.

Each S3 op also reports the server's request counts and bytes
(``/_objckpt/stats``: objckpt's fast server has it, and so does the moto
launcher here).  When psutil is installed, the server process's
CPU seconds per op are recorded as well (client and server share the cores).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

from .gpt_state import gpt_specs, partial_read_key, scaled_bytes
from .methods import ACCESS_KEY, DEFAULT_METHODS, METHODS, REGION, SECRET_KEY, Target

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
OPS = ("save", "load", "read_one")
GiB = 1 << 30


# --------------------------------------------------------------------------- S3 target


class S3Target:
    """An S3 server in a subprocess whose first stdout line is its endpoint URL."""

    def __init__(self, kind: str, log_path: str) -> None:
        self.kind = kind
        if kind == "moto":
            cmd = [sys.executable, "-m", "benchmarks.moto_server"]
        elif kind == "moto-ranged":
            cmd = [sys.executable, "-m", "benchmarks.moto_server", "--ranged-reads"]
        elif kind == "fast":
            if importlib.util.find_spec("objckpt.testing.s3server") is None:
                raise RuntimeError("--target fast needs objckpt.testing.s3server, which is not there (yet)")
            cmd = [sys.executable, "-m", "objckpt.testing.s3server", "--port", "0"]
        else:
            raise ValueError(kind)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._log)
        self.endpoint_url = self._first_line(timeout=60.0)
        # Keep draining stdout so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain, daemon=True).start()
        self._ps: Any = None
        try:
            import psutil

            self._ps = psutil.Process(self.proc.pid)
        except Exception:  # noqa: BLE001 - psutil is optional
            pass

    def _first_line(self, timeout: float) -> str:
        box: list[bytes] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        line = box[0].decode().strip() if box else ""
        if not line.startswith("http"):
            self.stop()
            with open(self.log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"{self.kind} server did not print its endpoint URL (got {line!r}); log:\n{tail}")
        return line

    def _drain(self) -> None:
        for _ in self.proc.stdout:  # type: ignore[union-attr]
            pass

    def cpu_seconds(self) -> Optional[float]:
        """User + system CPU seconds of the server process (threads included)."""
        if self._ps is None:
            return None
        try:
            t = self._ps.cpu_times()
            return t.user + t.system
        except Exception:  # noqa: BLE001
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _client(endpoint_url: str) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=REGION,
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
    )


def _delete_prefix(client: Any, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix/`` (and abort its multipart uploads)."""
    n = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
        n += len(keys)
    try:
        ups = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
        for u in ups:
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    except Exception:  # noqa: BLE001 - not every server lists uploads
        pass
    return n


# --------------------------------------------------------------------------- one op


def run_op(
    method: str, op: str, target: Target, args: argparse.Namespace, server: Optional[S3Target]
) -> dict[str, Any]:
    """Run ``benchmarks.run_one`` in a subprocess; its JSON result (plus driver-side numbers)."""
    cmd = [
        sys.executable, "-m", "benchmarks.run_one",
        "--method", method, "--op", op,
        "--bucket", target.bucket, "--prefix", target.prefix,
        "--scale", str(args.scale), "--seed", str(args.seed),
        "--local-root", target.local_root,
    ]
    if target.endpoint_url:
        cmd += ["--endpoint-url", target.endpoint_url]
    if not args.warmup:
        cmd.append("--no-warmup")
    if server is not None and METHODS[method].remote:
        cmd.append("--server-stats")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_DEFAULT_REGION=REGION, PYTHONWARNINGS="ignore")
    scpu0 = server.cpu_seconds() if server else None
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "op": op, "ok": False, "status": "timeout",
                "error": f"no result within {args.timeout} s"}
    elapsed = time.perf_counter() - t0
    scpu1 = server.cpu_seconds() if server else None
    res: Optional[dict[str, Any]] = None
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                res = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if res is None:
        res = {"method": method, "op": op, "ok": False, "status": "crashed",
               "error": f"exit {p.returncode}, no JSON line; stderr tail: {p.stderr[-1500:]}"}
    res["process_s"] = elapsed
    if scpu0 is not None and scpu1 is not None:
        # Whole subprocess lifetime (setup + op + verify); the server only works during warmup + op.
        res["server_cpu_s"] = scpu1 - scpu0
    return res


# --------------------------------------------------------------------------- summary


def _median(runs: list[dict[str, Any]], field: str) -> Optional[float]:
    vals = [r[field] for r in runs if r.get("ok") and isinstance(r.get(field), (int, float))]
    return statistics.median(vals) if vals else None


def _server_totals(run: dict[str, Any]) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(requests, bytes_in, bytes_out) from a run's server stats."""
    s = run.get("server")
    if not isinstance(s, dict):
        return None, None, None
    reqs = s.get("requests")
    if isinstance(reqs, dict):
        nreq: Optional[int] = sum(v for v in reqs.values() if isinstance(v, (int, float)))  # type: ignore[assignment]
    elif isinstance(reqs, (int, float)):
        nreq = int(reqs)
    else:
        nreq = None
    return nreq, s.get("bytes_in"), s.get("bytes_out")


def summarize(method: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per op over successful repeats, and the status of each op.

    GB/s and CPU-s/GB are computed from the median seconds (not medians of
    their own), so that the columns agree with each other.
    """
    out: dict[str, Any] = {"method": method}
    for op in OPS:
        rs = [r for r in runs if r.get("op") == op]
        good = [r for r in rs if r.get("ok")]
        d: dict[str, Any] = {"n": len(good), "of": len(rs)}
        if rs and not good:
            bad = rs[-1]
            d.update(status=bad.get("status"), error=bad.get("error"))
        else:
            d["status"] = "ok" if rs else "not run"
        for f in ("wall_s", "cpu_s", "gbps", "cpu_s_per_gb", "peak_rss_bytes", "op_peak_rss_bytes",
                  "peak_minus_before_bytes", "file_read_bytes", "file_write_bytes", "server_cpu_s", "bytes"):
            d[f] = _median(rs, f)
        if d.get("wall_s") and d.get("bytes"):  # from the medians, so the columns agree with each other
            d["gbps"] = d["bytes"] / d["wall_s"] / 1e9
            d["cpu_s_per_gb"] = d["cpu_s"] / (d["bytes"] / 1e9) if d.get("cpu_s") is not None else None
        tot = [_server_totals(r) for r in good]
        for i, name in enumerate(("requests", "server_bytes_in", "server_bytes_out")):
            vals = [t[i] for t in tot if t[i] is not None]
            d[name] = statistics.median(vals) if vals else None
        info_bytes = [r["info"]["objckpt_bytes"] for r in good if isinstance(r.get("info"), dict)
                      and "objckpt_bytes" in r["info"]]
        info_reqs = [r["info"]["objckpt_requests"] for r in good if isinstance(r.get("info"), dict)
                     and "objckpt_requests" in r["info"]]
        d["client_reported_bytes"] = statistics.median(info_bytes) if info_bytes else None
        d["client_reported_requests"] = statistics.median(info_reqs) if info_reqs else None
        out[op] = d
    return out


def _f(x: Optional[float], fmt: str = "{:.3g}") -> str:
    return "–" if x is None else fmt.format(x)


def _moved_mb(d: dict[str, Any], remote: bool) -> Optional[float]:
    """MB the op moved: server bytes out (fast), else client-reported, else local file reads."""
    for v in (d.get("server_bytes_out"), d.get("client_reported_bytes")):
        if v is not None:
            return v / 1e6
    if not remote and d.get("file_read_bytes") is not None:
        return d["file_read_bytes"] / 1e6
    return None


def _reqs(d: dict[str, Any], in_or_out: str) -> str:
    if d.get("requests") is None:
        return "–"
    b = d.get(f"server_bytes_{in_or_out}")
    return f"{d['requests']:.0f} / {b / 1e6:.0f} MB" if b is not None else f"{d['requests']:.0f}"


def markdown_table(summaries: list[dict[str, Any]], ceiling: Optional[dict[str, Any]] = None) -> str:
    """The results table (medians)."""
    head = ["method", "save s", "load s", "save GB/s", "load GB/s", "CPU-s/GB save", "CPU-s/GB load",
            "peak RSS load GiB (op Δ)", "save reqs / MB in", "load reqs / MB out",
            "1-tensor read s", "1-tensor MB moved", "server CPU-s save / load"]
    if ceiling:
        head += ["save/ceiling", "load/ceiling"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        sv, ld, r1 = s["save"], s["load"], s["read_one"]
        remote = METHODS[s["method"]].remote

        def cell(d: dict[str, Any], v: str) -> str:
            return v if d.get("status") == "ok" else (d.get("status") or "–")

        rss = "–"
        if ld.get("peak_rss_bytes") is not None:
            delta = ld.get("peak_minus_before_bytes")
            rss = f"{ld['peak_rss_bytes'] / GiB:.2f}" + (f" (+{delta / GiB:.2f})" if delta is not None else "")
        row = [
            s["method"],
            cell(sv, _f(sv.get("wall_s"))), cell(ld, _f(ld.get("wall_s"))),
            cell(sv, _f(sv.get("gbps"))), cell(ld, _f(ld.get("gbps"))),
            cell(sv, _f(sv.get("cpu_s_per_gb"))), cell(ld, _f(ld.get("cpu_s_per_gb"))),
            cell(ld, rss),
            cell(sv, _reqs(sv, "in")), cell(ld, _reqs(ld, "out")),
            cell(r1, _f(r1.get("wall_s"))), cell(r1, _f(_moved_mb(r1, remote))),
            f"{_f(sv.get('server_cpu_s'), '{:.2f}')} / {_f(ld.get('server_cpu_s'), '{:.2f}')}" if remote else "–",
        ]
        if ceiling:
            cs, cl = ceiling.get("save_gbps"), ceiling.get("load_gbps")
            row += [
                _f(sv["gbps"] / cs, "{:.2f}") if remote and cs and sv.get("gbps") else "–",
                _f(ld["gbps"] / cl, "{:.2f}") if remote and cl and ld.get("gbps") else "–",
            ]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


# --------------------------------------------------------------------------- ceiling


def _pick(d: dict[str, Any], words: tuple[str, ...], exclude: tuple[str, ...] = ()) -> Optional[float]:
    """The first GB/s-looking number whose key names one of ``words`` (and none of ``exclude``)."""
    for w in words:
        for k, v in d.items():
            lk = k.lower()
            if (isinstance(v, (int, float)) and ("gbps" in lk or "gb_s" in lk or "gb/s" in lk)
                    and w in lk and not any(x in lk for x in exclude)):
                return float(v)
    return None


def measure_ceiling(endpoint_url: str, bucket: str, size: int, part: int, concurrency: int,
                    server_pid: Optional[int] = None) -> dict[str, Any]:
    """Call ``benchmarks.ceiling.measure_ceiling`` and pull out upload/download GB/s.

    Returns ``{"status": "skipped", "error": ...}`` when it is not available.
    """
    try:
        from .ceiling import measure_ceiling as mc
    except Exception as e:  # noqa: BLE001 - written by someone else; may not exist
        return {"status": "skipped", "error": f"{type(e).__name__}: {e}"}
    import inspect

    kw: dict[str, Any] = {}
    try:
        if server_pid is not None and "server_pid" in inspect.signature(mc).parameters:
            kw["server_pid"] = server_pid
    except (TypeError, ValueError):
        pass
    try:
        raw = mc(endpoint_url, bucket, size, part, concurrency, **kw)
    except Exception as e:  # noqa: BLE001
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    if isinstance(raw, (int, float)):
        d: dict[str, Any] = {"gbps": float(raw)}
    elif isinstance(raw, dict):
        d = dict(raw)
    elif hasattr(raw, "__dict__"):
        d = dict(vars(raw))
    else:
        d = {"value": repr(raw)}
    both = _pick(d, ("gbps",)) if isinstance(raw, (int, float)) else None
    out = {
        "status": "ok",
        "raw": json.loads(json.dumps(d, default=repr)),
        "save_gbps": _pick(d, ("upload", "put", "write", "save"), ("download",)) or both,
        "load_gbps": _pick(d, ("download", "get", "read", "load"), ("upload",)) or both,
    }
    return out


# --------------------------------------------------------------------------- main


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count(), "platform": platform.platform()}
    for mod in ("torch", "boto3", "s3fs", "tensorstore", "moto", "numpy", "objckpt"):
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


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Checkpoint save/load benchmark, one subprocess per op.")
    ap.add_argument("--target", choices=["moto", "moto-ranged", "fast", "none"], default="moto-ranged",
                    help="fast: objckpt.testing.s3server; moto-ranged: moto serving ranged GETs without "
                         "copying the object (as baselines.md); moto: stock; none: local methods only")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated; known: {', '.join(METHODS)}")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of save,load,read_one "
                    "(load and read_one need a save in the same repeat)")
    ap.add_argument("--scale", type=float, default=1.0, help="state size relative to 1.03 GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="repeats per method; medians are reported")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--name", default=None, help="results/<name>.json (default: <target>-s<scale>-<time>)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per op subprocess")
    ap.add_argument("--local-root", default="/tmp/objckpt-bench")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time cold clients (by default each op process makes one cheap request first)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints (default: delete after each repeat)")
    ap.add_argument("--ceiling", action="store_true", help="also measure raw upload/download ceilings")
    ap.add_argument("--ceiling-part", type=int, default=16 << 20)
    ap.add_argument("--ceiling-concurrency", type=int, default=8)
    args = ap.parse_args(argv)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if any(o not in OPS for o in ops):
        ap.error(f"--ops must be a subset of {OPS}")
    remote_methods = [m for m in methods if METHODS[m].remote]
    if args.target == "none" and remote_methods:
        print(f"--target none: skipping S3 methods {remote_methods}", file=sys.stderr)
        methods = [m for m in methods if not METHODS[m].remote]

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.name or f"{args.target}-s{args.scale:g}-{stamp}"
    run_id = f"bench-{stamp}-{os.getpid()}"
    total = scaled_bytes(args.scale)
    specs = gpt_specs(total)
    state_bytes = sum(s.nbytes for s in specs)
    print(f"state: {len(specs)} tensors, {state_bytes / GiB:.3f} GiB; partial read: {partial_read_key(total)}; "
          f"target {args.target}; methods {methods}; repeat {args.repeat}", file=sys.stderr)

    server: Optional[S3Target] = None
    client = None
    endpoint: Optional[str] = None
    results: dict[str, Any] = {
        "name": name,
        "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": {k: v for k, v in vars(args).items()} | {"methods": methods, "ops": ops,
                                                           "state_bytes": state_bytes, "tensors": len(specs),
                                                           "partial_read_key": partial_read_key(total)},
        "environment": _environment(),
    }
    runs: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    ceiling: Optional[dict[str, Any]] = None
    try:
        if args.target != "none":
            server = S3Target(args.target, os.path.join("/tmp", f"{run_id}-server.log"))
            endpoint = server.endpoint_url
            client = _client(endpoint)
            client.create_bucket(Bucket=args.bucket)
            print(f"{args.target} server at {endpoint} (pid {server.proc.pid})", file=sys.stderr)
            results["endpoint_url"] = endpoint

        if args.ceiling:
            if endpoint is None:
                ceiling = {"status": "skipped", "error": "no S3 target"}
            else:
                ceiling = measure_ceiling(endpoint, args.bucket, state_bytes, args.ceiling_part,
                                          args.ceiling_concurrency, server.proc.pid if server else None)
            print(f"ceiling: {json.dumps(ceiling, default=repr)[:400]}", file=sys.stderr)
            results["ceiling"] = ceiling

        for m in methods:
            mruns: list[dict[str, Any]] = []
            for rep in range(args.repeat):
                target = Target(endpoint, args.bucket, f"{run_id}/{m}/r{rep}", args.local_root)
                stop_method = False
                for op in ops:
                    r = run_op(m, op, target, args, server)
                    r["repeat"] = rep
                    mruns.append(r)
                    msg = (f"{m:18s} {op:8s} rep {rep}: {r.get('status')}"
                           + (f" {r['wall_s']:.3f} s, {r.get('gbps') or 0:.3f} GB/s, cpu {r.get('cpu_s', 0):.2f} s"
                              if r.get("wall_s") is not None else "")
                           + (f" -- {r.get('error')}" if not r.get("ok") else ""))
                    print(msg, file=sys.stderr, flush=True)
                    if r.get("status") == "skipped":
                        stop_method = True
                        break
                    if op == "save" and not r.get("ok"):
                        break  # nothing to load
                if not args.keep:
                    if METHODS[m].remote and client is not None:
                        _delete_prefix(client, args.bucket, target.prefix)
                    else:
                        shutil.rmtree(target.local_dir, ignore_errors=True)
                if stop_method:
                    break
            runs += mruns
            summaries.append(summarize(m, mruns))
    except BaseException:
        if server is not None:
            print(f"server log kept: {server.log_path}", file=sys.stderr)
            server.log_path = ""  # keep it
        raise
    finally:
        if server is not None:
            server.stop()
            if server.log_path and not args.keep:
                try:
                    os.remove(server.log_path)
                except OSError:
                    pass
        if not args.keep:
            shutil.rmtree(os.path.join(args.local_root, run_id), ignore_errors=True)

    table = markdown_table(summaries, ceiling if ceiling and ceiling.get("status") == "ok" else None)
    notes = []
    for s in summaries:
        for op in OPS:
            d = s[op]
            if d.get("status") not in ("ok", "not run"):
                notes.append(f"- {s['method']} {op}: {d.get('status')}: {d.get('error')}")
    results.update(summary=summaries, runs=runs, table_markdown=table, notes=notes)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(path + ".tmp", path)

    print(f"\n{len(specs)} tensors, {state_bytes / GiB:.3f} GiB, target {args.target}, "
          f"median of {args.repeat}{'' if args.warmup else ', cold clients'}:\n")
    print(table)
    if ceiling:
        if ceiling.get("status") == "ok":
            print(f"\nceiling (raw client, {args.ceiling_part >> 20} MiB parts x {args.ceiling_concurrency}): "
                  f"upload {_f(ceiling.get('save_gbps'))} GB/s, download {_f(ceiling.get('load_gbps'))} GB/s")
        else:
            print(f"\nceiling {ceiling.get('status')}: {ceiling.get('error')}")
    if notes:
        print("\n" + "\n".join(notes))
    print(f"\nresults: {os.path.relpath(path, REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
