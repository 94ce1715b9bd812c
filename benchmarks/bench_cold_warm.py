"""Cold and warm save/load, objckpt against its peers, each method in its own new process.

    python -m benchmarks.bench_cold_warm --scale 0.05                       # quick check (~1 min)
    python -m benchmarks.bench_cold_warm --scale 1 --rounds 2 --name cold-warm
    python -m benchmarks.bench_cold_warm --target moto --ref dcp_s3fs --methods objckpt_s3,dcp_s3fs   # on moto
    python -m benchmarks.bench_cold_warm --device cuda --rounds 2 --name cold-warm-gpu   # loads onto a GPU
    python -m benchmarks.bench_cold_warm --touched --methods objckpt_s3,tensorstore_ocdbt   # what is not page faults

Why a separate scenario: ``bench_save_load`` warms every client with one request and
loads into a template it zeroed (its pages already touched), which is the situation of a
job's second checkpoint, not of a restart. A restarting job imports the library, creates
its client, allocates its model's tensors (never touched yet) and loads once. Here, per
method and round, one process saves ``--reps`` times (rep 0 cold: the first call after
``setup``, no warm-up request), then a second new process loads ``--reps`` times, each rep
into **fresh** destinations (the template's shapes on pages the process never touched, as
``to_empty`` of a meta-built model gives in a new process: each tensor in a mapping of its
own, see :func:`fresh_tensor`; the previous rep's are unmapped first). Rep 0 is **cold**; **warm** is the median
of reps 1..n. ``setup_s`` (imports, client objects) is reported apart, never in the op.

Per rep: wall seconds, process CPU seconds (all threads), peak RSS during the op
(``VmHWM`` reset just before) and the RSS before it. Loads are verified after the timer
(crc32 of every tensor). Methods run interleaved round by round, so drift of the shared
machine spreads over all of them; ratios are taken within one run.

``--touched`` writes every byte of each rep's destinations before its timer starts: still
a new process and a cold client, but no page to fault in, which separates a method's own
cost from the kernel's for fresh memory (the fresh-page floor, measured in each round).
"""
from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch

from . import harness as h
from .bench_save_load import _crc
from .gpt_state import gpt_specs, iter_gpt_state, make_gpt_state, scaled_bytes
from .methods import METHODS, Target

DEFAULT = ["objckpt_s3", "tensorstore_ocdbt", "dcp_s3fs", "torchsave_s3tc"]


def _timed(fn: Any, cuda: bool = False) -> dict[str, Any]:
    """Run ``fn()``; wall, CPU and peak RSS of the call (with ``cuda``: until the device is done)."""
    gc.collect()
    with h.PeakRss() as rss:
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, t0 = time.process_time(), time.perf_counter()
        err = None
        try:
            fn()
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported
            err = f"{type(e).__name__}: {e}"
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": wall, "cpu_s": cpu, "user_s": ru1.ru_utime - ru0.ru_utime, "sys_s": ru1.ru_stime - ru0.ru_stime,
            "minor_faults": ru1.ru_minflt - ru0.ru_minflt, "peak_rss_bytes": rss.op_peak or rss.lifetime,
            "rss_before_bytes": rss.before, "error": err}


def fresh_tensor(shape: tuple[int, ...], device: str = "cpu") -> torch.Tensor:
    """An fp32 tensor whose pages this process never touched: on the host, in a mapping of
    its own, unmapped when the tensor goes.

    Why not ``torch.empty``: glibc serves a large block from its own mapping only until a
    first such block is freed; then it raises its mmap threshold (up to 32 MiB) and serves
    later blocks of that size from the heap, whose freed pages stay present.  A second
    rep's destinations then fault in ~35% fewer pages than the first's (measured: 265,750
    against 170,600 minor faults for 1.03 GiB), so "warm" would be warm memory as much as
    a warm client.  A restarting job's ``to_empty`` gets pages never touched, every time."""
    if device != "cpu":
        return torch.empty(shape, dtype=torch.float32, device=device)
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(mmap.mmap(-1, n * 4), dtype=torch.float32, count=n).view(shape)


def one_process(args: argparse.Namespace) -> dict[str, Any]:
    """Every rep of one op of one method, in this (new) process."""
    t0 = time.perf_counter()
    method = METHODS[args.method]()
    target = Target(args.endpoint_url, args.bucket, args.prefix)
    try:
        method.setup(target)
    except Exception as e:  # noqa: BLE001
        return {"status": "skipped", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
    out: dict[str, Any] = {"status": "ok", "setup_s": time.perf_counter() - t0, "reps": []}
    total = scaled_bytes(args.scale)
    specs = gpt_specs(total)
    if args.one == "save":
        state = make_gpt_state(total, args.seed)
        for rep in range(args.reps):
            where = Target(args.endpoint_url, args.bucket, f"{args.prefix}/r{rep}")
            out["reps"].append(_timed(lambda: method.save(state, where)))
        return out
    crcs = {k: _crc(t) for k, t in iter_gpt_state(total, args.seed)}
    where = Target(args.endpoint_url, args.bucket, f"{args.prefix}/r0")
    cuda = args.device.startswith("cuda")
    if cuda:
        out["h2d_gbps"] = h2d_gbps(args.device)
    for rep in range(args.reps):
        gc.collect()
        # fresh, untouched destinations each rep (what a restarting job has after to_empty)
        dest = {s.key: fresh_tensor(s.shape, args.device) for s in specs}
        if args.touched:  # every page present before the timer (see the module docstring)
            for t in dest.values():
                t.fill_(0.0)
        r = _timed(lambda: method.load(dest, where), cuda)
        if not r["error"]:
            bad = [k for k, c in crcs.items() if _crc(dest[k].cpu()) != c]
            r["verify"] = f"{len(bad)} tensors differ, e.g. {bad[:3]}" if bad else "ok"
        out["reps"].append(r)
        del dest
    return out


def floor_process(args: argparse.Namespace) -> dict[str, Any]:
    """The fresh-page floor, in a new process like a method's load: the CPU that merely
    writing every byte of fresh destinations costs (the kernel's page faults and zeroing,
    then one pass of stores), with no I/O.  No loader into fresh memory can pay less."""
    specs = gpt_specs(scaled_bytes(args.scale))
    reps = []
    for _ in range(args.reps):
        gc.collect()
        dest = {s.key: fresh_tensor(s.shape) for s in specs}
        reps.append(_timed(lambda d=dest: [t.fill_(1.0) for t in d.values()]))
        del dest
    return {"status": "ok", "reps": reps}


def h2d_gbps(device: str, nbytes: int = 1 << 30) -> float:
    """Pinned host-to-device copy rate (GB/s): the PCIe side of a GPU load's ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def _ok(r: dict[str, Any]) -> bool:
    return not r.get("error") and r.get("verify", "ok") == "ok"


def summarize(runs: list[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    """Cold = rep 0 (median over rounds), warm = median of reps 1.. over rounds; min/max too,
    so the table can say how noisy each figure is."""
    out: dict[str, Any] = {}
    for op in ("save", "load"):
        procs = [r for r in runs if r["op"] == op and r.get("status") == "ok"]
        cold = [p["reps"][0] for p in procs if p["reps"] and _ok(p["reps"][0])]
        warm = [r for p in procs for r in p["reps"][1:] if _ok(r)]
        d: dict[str, Any] = {"processes": len(procs), "setup_s": h.median(p["setup_s"] for p in procs),
                             "h2d_gbps": h.median(p["h2d_gbps"] for p in procs if "h2d_gbps" in p)}
        for name, rs in (("cold", cold), ("warm", warm)):
            walls = [r["wall_s"] for r in rs]
            d[name] = {"n": len(rs), "wall_s": h.median(walls), "wall_min": min(walls, default=None),
                       "wall_max": max(walls, default=None),
                       "cpu_s_per_gb": h.median(r["cpu_s"] / (nbytes / 1e9) for r in rs),
                       "peak_rss_bytes": h.median(r["peak_rss_bytes"] for r in rs)}
        bad = [r.get("error") or r.get("verify") for p in procs for r in p["reps"] if not _ok(r)]
        bad += [r.get("error") for r in runs if r["op"] == op and r.get("status") != "ok"]
        d["problems"] = bad[:3]
        out[op] = d
    return out


def table(summaries: dict[str, dict[str, Any]], state_bytes: int, ref_method: str = "tensorstore_ocdbt") -> str:
    """The markdown table; the "/ REF" columns are ``ref_method``'s seconds over the row's (> 1: faster)."""
    def cell(d: dict[str, Any]) -> str:
        if d["wall_s"] is None:
            return "–"
        spread = "" if d["n"] < 2 else f" ({d['wall_min']:.2f}–{d['wall_max']:.2f})"
        return f"{d['wall_s']:.2f}{spread}"

    ref = summaries.get(ref_method)
    tag = _SHORT.get(ref_method, ref_method)
    head = ["method", "load cold s", "load warm s", "save cold s", "save warm s", f"load cold / {tag}",
            f"load warm / {tag}", f"save cold / {tag}", f"save warm / {tag}",
            "CPU-s/GB load cold / warm", "CPU-s/GB save warm", "peak RSS load − state MiB (cold)", "setup s"]
    rows = []
    for m, s in summaries.items():
        ld, sv = s["load"], s["save"]

        def vs(op: str, kind: str) -> str:
            mine, theirs = s[op][kind]["wall_s"], ref and ref[op][kind]["wall_s"]
            return h.ratio(theirs, mine, "{:.2f}x") if mine and theirs else "–"

        rss = ld["cold"]["peak_rss_bytes"]
        rows.append([m, cell(ld["cold"]), cell(ld["warm"]), cell(sv["cold"]), cell(sv["warm"]), vs("load", "cold"),
                     vs("load", "warm"), vs("save", "cold"), vs("save", "warm"),
                     f"{h.fmt(ld['cold']['cpu_s_per_gb'], '{:.2f}')} / {h.fmt(ld['warm']['cpu_s_per_gb'], '{:.2f}')}",
                     h.fmt(sv["warm"]["cpu_s_per_gb"], "{:.2f}"),
                     "–" if rss is None else f"{(rss - state_bytes) / h.MiB:.0f}", h.fmt(ld["setup_s"], "{:.2f}")])
    return h.md_table(head, rows)


#: short names of the reference method in column headers
_SHORT = {"tensorstore_ocdbt": "TS", "dcp_s3fs": "DCP"}


def warm_server(client: Any, bucket: str, nbytes: int, piece: int = 16 << 20) -> None:
    """Store and delete ``nbytes`` once before any method runs (untimed). A new server
    process first has to fault in the memory it keeps objects in; without this the
    first method of round 0 pays that for the server (measured: objckpt's saves took
    1.5-1.8 s first in round 0, 0.74-0.87 s last in round 1, in the same run).  The
    caller passes what a method holds at its peak (every rep's checkpoint): warmed
    with one state only, round 0's first save was fast and its next two paid again."""
    blob = os.urandom(piece)
    keys = [f"server-warmup/{i}" for i in range(-(-nbytes // piece))]
    for k in keys:
        client.put_object(Bucket=bucket, Key=k, Body=blob)
    h.delete_prefix(client, bucket, "server-warmup")
    h.log(f"server warmed: {len(keys)} x {piece >> 20} MiB stored and deleted")


def _export_baseline(ref: str) -> str:
    """Export ``ref``'s tree to a temporary directory for ``objckpt_s3_base`` (environment
    of the op processes); returns the commit it resolved to."""
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=h.REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    root = tempfile.mkdtemp(prefix="objckpt-baseline-")
    archive = subprocess.run(["git", "archive", commit, "objckpt"], cwd=h.REPO_ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", root], input=archive.stdout, check=True)
    os.environ["OBJCKPT_BASELINE"], os.environ["OBJCKPT_BASELINE_REF"] = root, f"{ref} ({commit})"
    return f"{ref} ({commit})"


def drive(args: argparse.Namespace) -> int:
    methods = [m for m in args.methods.split(",") if m]
    rid = h.run_id("coldwarm")
    specs = gpt_specs(scaled_bytes(args.scale))
    state_bytes = sum(s.nbytes for s in specs)
    name = args.name or f"cold-warm-s{args.scale:g}-{rid.split('-', 1)[1]}"
    h.log(f"state {len(specs)} tensors, {state_bytes / h.GiB:.3f} GiB; methods {methods}; "
          f"{args.rounds} round(s) x {args.reps} reps")
    runs: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    if args.baseline:
        methods_note = _export_baseline(args.baseline)
        h.log(f"objckpt_s3_base runs objckpt at {methods_note}")
    with h.Server(args.target, args.bucket) as server:
        client = h.boto3_client(server.url)
        if args.server_warmup:
            warm_server(client, args.bucket, state_bytes * args.reps)
        for rnd in range(args.rounds):
            if args.device == "cpu":
                floor = h.run_json(["-m", "benchmarks.bench_cold_warm", "--one", "floor", "--scale", str(args.scale),
                                    "--reps", str(args.reps)], args.timeout)
                floors.append(floor)
                h.log(f"round {rnd} fresh-page floor CPU-s/GB: " + " ".join(
                    f"{x['cpu_s'] / (state_bytes / 1e9):.2f}" for x in floor.get("reps", [])))
            order = methods if rnd % 2 == 0 else methods[::-1]  # interleaved, alternating order
            for m in order:
                prefix = f"{rid}/{m}/round{rnd}"
                for op in ("save", "load"):
                    cmd = ["-m", "benchmarks.bench_cold_warm", "--one", op, "--methods", m, "--endpoint-url",
                           server.url, "--bucket", args.bucket, "--prefix", prefix, "--scale", str(args.scale),
                           "--reps", str(args.reps), "--seed", str(args.seed), "--device", args.device]
                    if args.touched:
                        cmd.append("--touched")
                    r = dict(h.run_json(cmd, args.timeout), method=m, op=op, round=rnd)
                    r.setdefault("status", "crashed" if not r.get("ok", True) else "ok")
                    runs.append(r)
                    walls = " ".join(f"{x['wall_s']:.3f}" + ("" if _ok(x) else "!") for x in r.get("reps", []))
                    h.log(f"round {rnd} {m:18s} {op}: {r.get('status')} {walls} {r.get('error') or ''}")
                    if r.get("status") != "ok":
                        break
                h.delete_prefix(client, args.bucket, prefix)
    if os.environ.get("OBJCKPT_BASELINE"):
        shutil.rmtree(os.environ.pop("OBJCKPT_BASELINE"), ignore_errors=True)
    summaries = {m: summarize([r for r in runs if r["method"] == m], state_bytes) for m in methods}
    md = table(summaries, state_bytes, args.ref)
    floor_reps = [f.get("reps", []) for f in floors]
    floor_cold = [r[0]["cpu_s"] / (state_bytes / 1e9) for r in floor_reps if r]
    floor_warm = [x["cpu_s"] / (state_bytes / 1e9) for r in floor_reps for x in r[1:]]
    if floor_cold:
        md += (f"\n\nFresh-page floor (writing every byte of fresh destinations, no I/O, new process): "
               f"{statistics.median(floor_cold):.2f} CPU-s/GB cold, "
               f"{statistics.median(floor_warm) if floor_warm else float('nan'):.2f} warm.")
    cfg = dict(vars(args), methods=methods, baseline=os.environ.get("OBJCKPT_BASELINE_REF"), state_bytes=state_bytes, tensors=len(specs))
    path = h.write_results(h.result_path(name), {
        "name": name, "config": cfg,
        "environment": h.environment("boto3", "aiobotocore", "s3fs", "tensorstore", "s3torchconnector"),
        "summary": summaries, "runs": runs, "fresh_page_floor": floors, "table_markdown": md})
    h2d = [s["load"]["h2d_gbps"] for s in summaries.values() if s["load"].get("h2d_gbps")]
    if h2d:
        print(f"\nloads onto {args.device}; pinned host-to-device copy {max(h2d):.1f} GB/s")
    print(f"\n{len(specs)} tensors, {state_bytes / h.GiB:.3f} GiB, {args.target} server, {args.rounds} round(s) x "
          f"{args.reps} reps; cold = rep 0, warm = median of reps 1..; (min–max):\n\n{md}\n\nresults: {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(DEFAULT))
    ap.add_argument("--scale", type=float, default=1.0, help="state size relative to 1.03 GiB")
    ap.add_argument("--reps", type=int, default=3, help="ops per process: rep 0 cold, the rest warm")
    ap.add_argument("--rounds", type=int, default=1, help="new processes per method and op")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ref", default="tensorstore_ocdbt",
                    help="the method the ratio columns compare with (its seconds over each row's)")
    ap.add_argument("--target", choices=sorted(h.TARGETS), default="fast",
                    help="S3 server: fast (in-memory, default), moto (stock), moto-ranged (ranged GETs patched)")
    ap.add_argument("--touched", action="store_true",
                    help="write every byte of the load destinations before each rep's timer")
    ap.add_argument("--device", default="cpu",
                    help="where load destinations live: cpu, or cuda (each method loads onto the GPU; the "
                         "pinned host-to-device rate is measured beside it)")
    ap.add_argument("--no-server-warmup", dest="server_warmup", action="store_false",
                    help="skip storing and deleting one state's worth of bytes on the new server first")
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--name", default=None, help="benchmarks/results/<name>.json")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="also run objckpt_s3_base: objckpt as of git REF (add it to --methods)")
    ap.add_argument("--one", choices=("save", "load", "floor"), help="internal: run the reps of one op here")
    ap.add_argument("--endpoint-url", default=None)
    ap.add_argument("--prefix", default="manual")
    args = ap.parse_args(argv)
    if args.one == "floor":
        print(json.dumps(floor_process(args), default=repr), flush=True)
        return 0
    if args.one:
        args.method = args.methods.split(",")[0]
        print(json.dumps(one_process(args), default=repr), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
