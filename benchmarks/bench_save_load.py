"""Save, load and one-tensor read: objckpt against its peers, each op in its own process.

    python -m benchmarks.bench_save_load --target fast --scale 0.05 --repeat 1     # quick check
    python -m benchmarks.bench_save_load --target fast --repeat 3 --ceiling --name fast-full

Starts the S3 target in its own process (:class:`benchmarks.harness.Server`), then per
method and repeat runs ``save``, ``load`` and ``read_one`` each in a fresh subprocess
(this module with ``--one OP``), so CPU seconds and peak RSS belong to one method and one
op. The state (or the load template and the expected values) is built before the timer
starts; a load is verified (crc32 of every tensor, four compared in full), a one-tensor
read compared in full. Medians of ``--repeat`` go to a markdown table and everything to
``benchmarks/results/<name>.json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import traceback
import zlib
from typing import Any, Optional

import torch

from . import harness as h
from .gpt_state import gpt_specs, iter_gpt_state, make_gpt_state, make_tensor, partial_read_key, scaled_bytes
from .methods import DEFAULT_METHODS, METHODS, Target

OPS = ("save", "load", "read_one")


# --------------------------------------------------------------------------- one op, in its own process


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def _verify_load(loaded: Any, crcs: dict[str, int], shapes: dict[str, tuple], full: dict[str, torch.Tensor]) -> str:
    """'' if ``loaded`` matches, else the first problems."""
    if not isinstance(loaded, dict):
        return f"load returned {type(loaded).__name__}, not a dict"
    problems = [f"{k}: missing" for k in crcs if k not in loaded][:3]
    for k, crc in crcs.items():
        t = loaded.get(k)
        if t is None or len(problems) >= 5:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[k] or t.dtype != torch.float32:
            problems.append(f"{k}: got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        elif k in full and not torch.equal(t.cpu(), full[k]):
            problems.append(f"{k}: values differ")
        elif _crc(t.cpu()) != crc:
            problems.append(f"{k}: crc32 differs")
    return "; ".join(problems)


def one_op(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.one`` once in this process; the result printed as one JSON line."""
    out: dict[str, Any] = {"method": args.method, "op": args.one, "scale": args.scale, "ok": False}
    target = Target(args.endpoint_url, args.bucket, args.prefix, args.local_root)
    method = METHODS[args.method]()
    try:
        method.setup(target)
    except Exception as e:  # noqa: BLE001 - e.g. a peer library that is not installed
        return {**out, "status": "skipped", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=5)}
    if args.warmup:
        try:
            method.warmup(target)
        except Exception as e:  # noqa: BLE001 - the op itself reports real failures
            out["warmup_error"] = f"{type(e).__name__}: {e}"
    total = scaled_bytes(args.scale)
    specs = gpt_specs(total)
    key = partial_read_key(total)
    crcs: dict[str, int] = {}
    full: dict[str, torch.Tensor] = {}
    if args.one == "save":
        state = make_gpt_state(total, args.seed)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
    elif args.one == "load":  # expected values one tensor at a time: RSS stays at the template's
        keep = {specs[1].key, specs[3].key, specs[-1].key, key}
        for k, t in iter_gpt_state(total, args.seed):
            crcs[k] = _crc(t)
            if k in keep:
                full[k] = t.clone()
        template = {s.key: torch.zeros(s.shape, dtype=torch.float32) for s in specs}
        nbytes = sum(s.nbytes for s in specs)
    else:
        spec = next(s for s in specs if s.key == key)
        expected, like, nbytes = make_tensor(spec, args.seed), torch.empty(spec.shape), spec.nbytes
    stats = args.server_stats and method.remote and args.endpoint_url
    gc.collect()
    if stats:
        h.server_stats(args.endpoint_url, reset=True)
    result: Any = None
    with h.PeakRss() as rss:
        io0 = h.proc_io()
        cpu0, t0 = time.process_time(), time.perf_counter()
        try:
            if args.one == "save":
                method.save(state, target)
            elif args.one == "load":
                result = method.load(template, target)
            else:
                result = method.read_one(key, target, like)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            out.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        io1 = h.proc_io()
    if stats:
        out["server"] = h.server_stats(args.endpoint_url)
    out.update(bytes=nbytes, wall_s=wall, cpu_s=cpu, gbps=nbytes / wall / 1e9, cpu_s_per_gb=cpu / (nbytes / 1e9),
               peak_rss_bytes=rss.lifetime, op_peak_rss_bytes=rss.op_peak, rss_before_bytes=rss.before,
               peak_minus_before_bytes=rss.delta, info=method.info,
               file_read_bytes=io1.get("rchar", 0) - io0.get("rchar", 0) if io0 else None,
               file_write_bytes=io1.get("wchar", 0) - io0.get("wchar", 0) if io0 else None)
    if out.get("status") == "failed":
        return out
    if args.one == "save":
        verify, how = "", "not checked (see load)"
    elif args.one == "load":
        verify, how = _verify_load(result, crcs, {s.key: s.shape for s in specs}, full), "crc32 all + full compare of 4"
    else:
        ok = isinstance(result, torch.Tensor) and result.shape == expected.shape and torch.equal(result.cpu(), expected)
        verify, how = ("" if ok else f"{key}: values differ"), "full compare"
    return {**out, "ok": not verify, "status": "verify_failed" if verify else "ok", "verify": verify or how}


# --------------------------------------------------------------------------- driver


def run_op(method: str, op: str, target: Target, args: argparse.Namespace, server: Optional[h.Server]) -> dict:
    cmd = ["-m", "benchmarks.bench_save_load", "--one", op, "--methods", method, "--bucket", target.bucket,
           "--prefix", target.prefix, "--scale", str(args.scale), "--seed", str(args.seed),
           "--local-root", target.local_root] + (["--endpoint-url", target.endpoint_url] if target.endpoint_url else [])
    cmd += ([] if args.warmup else ["--no-warmup"]) + (["--server-stats"] if server else [])
    scpu0 = server.cpu_s() if server else None
    res = h.run_json(cmd, args.timeout, method=method, op=op)
    scpu1 = server.cpu_s() if server else None
    if scpu0 is not None and scpu1 is not None and METHODS[method].remote:
        res["server_cpu_s"] = scpu1 - scpu0  # the op process's whole life; the server works in warmup + op only
    return res


def _server_totals(run: dict[str, Any]) -> tuple[Optional[float], Optional[int], Optional[int]]:
    s = run.get("server")
    if not isinstance(s, dict):
        return None, None, None
    return sum(s.get("requests", {}).values()), s.get("bytes_in"), s.get("bytes_out")


def summarize(method: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per op over successful repeats; GB/s and CPU-s/GB from the median seconds, so the
    columns agree with each other."""
    out: dict[str, Any] = {"method": method}
    for op in OPS:
        rs = [r for r in runs if r.get("op") == op]
        good = [r for r in rs if r.get("ok")]
        d: dict[str, Any] = {"n": len(good), "of": len(rs), "status": "ok" if good else rs[-1].get("status") if rs
                             else "not run", "error": None if good or not rs else rs[-1].get("error")}
        for f in ("wall_s", "cpu_s", "peak_rss_bytes", "op_peak_rss_bytes", "peak_minus_before_bytes",
                  "file_read_bytes", "file_write_bytes", "server_cpu_s", "bytes"):
            d[f] = h.median(r.get(f) for r in good)
        d["gbps"] = d["bytes"] / d["wall_s"] / 1e9 if d["wall_s"] and d["bytes"] else None
        d["cpu_s_per_gb"] = d["cpu_s"] / (d["bytes"] / 1e9) if d["cpu_s"] is not None and d["bytes"] else None
        tot = [_server_totals(r) for r in good]
        for i, name in enumerate(("requests", "server_bytes_in", "server_bytes_out")):
            d[name] = h.median(t[i] for t in tot)
        for f in ("bytes", "requests"):
            d[f"client_reported_{f}"] = h.median(r.get("info", {}).get(f"objckpt_{f}") for r in good)
        out[op] = d
    return out


def markdown_table(summaries: list[dict[str, Any]], ceiling: Optional[dict[str, Any]]) -> str:
    head = ["method", "save s", "load s", "save GB/s", "load GB/s", "CPU-s/GB save", "CPU-s/GB load",
            "peak RSS load GiB (op Δ)", "save reqs / MB in", "load reqs / MB out", "1-tensor read s",
            "1-tensor MB moved", "server CPU-s save / load"] + (["save/ceiling", "load/ceiling"] if ceiling else [])
    rows = []
    for s in summaries:
        sv, ld, r1 = s["save"], s["load"], s["read_one"]
        remote = METHODS[s["method"]].remote

        def cell(d: dict[str, Any], v: str) -> str:
            return v if d["status"] == "ok" else d["status"]

        def reqs(d: dict[str, Any], way: str) -> str:
            b = d[f"server_bytes_{way}"]
            return "–" if d["requests"] is None else f"{d['requests']:.0f}" + (f" / {b / 1e6:.0f} MB" if b else "")

        rss = "–" if ld["peak_rss_bytes"] is None else f"{ld['peak_rss_bytes'] / h.GiB:.2f}" + (
            "" if ld["peak_minus_before_bytes"] is None else f" (+{ld['peak_minus_before_bytes'] / h.GiB:.2f})")
        moved = next((v for v in (r1["server_bytes_out"], r1["client_reported_bytes"],
                                  None if remote else r1["file_read_bytes"]) if v is not None), None)
        row = [s["method"], cell(sv, h.fmt(sv["wall_s"])), cell(ld, h.fmt(ld["wall_s"])), cell(sv, h.fmt(sv["gbps"])),
               cell(ld, h.fmt(ld["gbps"])), cell(sv, h.fmt(sv["cpu_s_per_gb"])), cell(ld, h.fmt(ld["cpu_s_per_gb"])),
               cell(ld, rss), cell(sv, reqs(sv, "in")), cell(ld, reqs(ld, "out")), cell(r1, h.fmt(r1["wall_s"])),
               cell(r1, h.fmt(moved and moved / 1e6)),
               f"{h.fmt(sv['server_cpu_s'], '{:.2f}')} / {h.fmt(ld['server_cpu_s'], '{:.2f}')}" if remote else "–"]
        if ceiling:
            row += [h.ratio(sv["gbps"], ceiling["save_gbps"], "{:.2f}") if remote else "–",
                    h.ratio(ld["gbps"], ceiling["load_gbps"], "{:.2f}") if remote else "–"]
        rows.append(row)
    return h.md_table(head, rows)


def measure_ceiling(url: str, args: argparse.Namespace, state_bytes: int, server_pid: int) -> dict[str, Any]:
    """What a zero-cost raw client gets from the same server in the same run (:mod:`benchmarks.ceiling`)."""
    from .ceiling import measure_ceiling as raw

    try:
        r = raw(url, args.bucket, state_bytes, args.ceiling_part, args.ceiling_concurrency, server_pid=server_pid)
    except Exception as e:  # noqa: BLE001
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    return {"status": "ok", "raw": r, "save_gbps": r["upload_GBps"], "load_gbps": r["download_GBps"]}


def drive(args: argparse.Namespace, methods: list[str], ops: list[str]) -> int:
    rid = h.run_id("bench")
    total = scaled_bytes(args.scale)
    specs = gpt_specs(total)
    state_bytes = sum(s.nbytes for s in specs)
    name = args.name or f"{args.target}-s{args.scale:g}-{rid.split('-', 1)[1]}"
    h.log(f"state: {len(specs)} tensors, {state_bytes / h.GiB:.3f} GiB; partial read: {partial_read_key(total)}; "
          f"target {args.target}; methods {methods}; repeat {args.repeat}")
    results: dict[str, Any] = {"name": name, "config": dict(vars(args), methods=methods, ops=ops, state_bytes=state_bytes,
                                                            tensors=len(specs), partial_read_key=partial_read_key(total)),
                               "environment": h.environment("boto3", "s3fs", "tensorstore", "moto", "numpy")}
    runs: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    ceiling = None
    server = h.Server(args.target, args.bucket) if args.target != "none" else None
    try:
        client = h.boto3_client(server.url) if server else None
        if args.ceiling and server:
            ceiling = results["ceiling"] = measure_ceiling(server.url, args, state_bytes, server.pid)
            h.log(f"ceiling: {ceiling}")
        for m in methods:
            mruns: list[dict[str, Any]] = []
            for rep in range(args.repeat):
                target = Target(server and server.url, args.bucket, f"{rid}/{m}/r{rep}", args.local_root)
                for op in ops:
                    r = dict(run_op(m, op, target, args, server), repeat=rep)
                    mruns.append(r)
                    h.log(f"{m:18s} {op:8s} rep {rep}: {r.get('status')}"
                          + (f" {r['wall_s']:.3f} s, {r.get('gbps') or 0:.3f} GB/s, cpu {r.get('cpu_s', 0):.2f} s"
                             if r.get("wall_s") is not None else "") + ("" if r.get("ok") else f" -- {r.get('error')}"))
                    if r.get("status") == "skipped" or (op == "save" and not r.get("ok")):
                        break  # nothing to load
                if not args.keep:
                    if client is not None and METHODS[m].remote:
                        h.delete_prefix(client, args.bucket, target.prefix)
                    shutil.rmtree(target.local_dir, ignore_errors=True)
                if mruns[-1].get("status") == "skipped":
                    break
            runs += mruns
            summaries.append(summarize(m, mruns))
    except BaseException:
        if server:
            server.stop(keep_log=True)
        raise
    if server:
        server.stop()
    ok_ceiling = ceiling if ceiling and ceiling["status"] == "ok" else None
    table = markdown_table(summaries, ok_ceiling)
    notes = [f"- {s['method']} {op}: {s[op]['status']}: {s[op]['error']}" for s in summaries for op in OPS
             if s[op]["status"] not in ("ok", "not run")]
    path = h.write_results(h.result_path(name), dict(results, summary=summaries, runs=runs, table_markdown=table,
                                                     notes=notes))
    print(f"\n{len(specs)} tensors, {state_bytes / h.GiB:.3f} GiB, target {args.target}, median of {args.repeat}"
          f"{'' if args.warmup else ', cold clients'}:\n\n{table}")
    if ok_ceiling:
        print(f"\nceiling (raw client, {args.ceiling_part >> 20} MiB parts x {args.ceiling_concurrency}): "
              f"upload {h.fmt(ok_ceiling['save_gbps'])} GB/s, download {h.fmt(ok_ceiling['load_gbps'])} GB/s")
    print("\n".join(["", *notes, f"results: {path}"]))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=["fast", "moto-ranged", "moto", "none"], default="moto-ranged",
                    help="fast: testkit.s3server; moto-ranged: moto serving ranged GETs without copying "
                         "the object; moto: stock; none: local methods only")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated; known: {', '.join(METHODS)}")
    ap.add_argument("--ops", default=",".join(OPS), help="subset of save,load,read_one (load needs save)")
    ap.add_argument("--scale", type=float, default=1.0, help="state size relative to 1.03 GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="repeats per method; medians are reported")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--name", default=None, help="benchmarks/results/<name>.json")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per op subprocess")
    ap.add_argument("--local-root", default="/tmp/objckpt-bench")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time cold clients (by default each op process makes one cheap request first)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--ceiling", action="store_true", help="also measure the raw client's upload/download speed")
    ap.add_argument("--ceiling-part", type=int, default=16 << 20)
    ap.add_argument("--ceiling-concurrency", type=int, default=8)
    ap.add_argument("--one", choices=OPS, help="run this op of the one --methods method here; print one JSON line")
    ap.add_argument("--endpoint-url", default=None, help="with --one: the S3 target")
    ap.add_argument("--prefix", default="manual", help="with --one: the checkpoint's prefix")
    ap.add_argument("--server-stats", action="store_true", help="with --one: record the target's counters")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    ops = [o for o in args.ops.split(",") if o]
    if any(m not in METHODS for m in methods) or any(o not in OPS for o in ops):
        ap.error(f"methods within {list(METHODS)}, ops within {OPS}")
    if args.one:
        args.method = methods[0]
        print(json.dumps(one_op(args), default=repr), flush=True)
        return 0
    if args.target == "none":
        methods = [m for m in methods if not METHODS[m].remote]
    return drive(args, methods, ops)


if __name__ == "__main__":
    sys.exit(main())
