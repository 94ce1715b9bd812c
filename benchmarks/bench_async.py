"""Async save stall (CPU): how long a save blocks the training loop, against a memcpy of the state.

    python -m benchmarks.bench_async                            # 1.03 GiB, 1 cold + 3 steady saves per method
    python -m benchmarks.bench_async --scale 0.05 --repeat 1    # quick check
    python -m benchmarks.bench_async --methods memcpy_1t,objckpt_async,objckpt_lazy,dcp_async_bgstage

Starts the fast S3 server (own process); each method runs in its **own subprocess**
(``--worker``), so peak RSS and CPU are that method's. A worker builds the GPT-like state,
warms its client with one cheap request, then saves ``1 + --repeat`` times to fresh prefixes,
waiting for each save to commit and deleting it (untimed) before the next. The first save is
the **cold** one (first touch of staging memory); the table's main columns are medians of the
**steady** saves. Per save: ``stall`` (the call returns), ``ready`` (the tensors may be
mutated: ``wait_staged()``, DCP's ``staging_completion``), ``done`` (committed), client CPU-s
(all threads, call to done), server CPU-s, and peak RSS (``VmHWM``; "steady Δ": the peak over
the steady saves minus the RSS before them). Stall ratios are against the faster of ``memcpy``
(``copy_`` into pre-touched tensors, torch's threads) and ``memcpy_1t`` (one thread).

Methods: ``memcpy``, ``memcpy_1t``, ``objckpt_sync``, ``objckpt_async``, ``objckpt_async_256m``
(``staging_bytes=256 MiB``), ``objckpt_async_2x`` (``staging_bytes`` = 2x the state),
``objckpt_lazy``; DCP ``async_save`` + ``FsspecWriter(sync_files=False)`` over s3fs with
``no_dist=True``: ``dcp_async`` (defaults: a fresh CPU copy every save), ``dcp_async_cached``
(a ``DefaultStager(StagingOptions(False, False, False, False))`` kept across saves),
``dcp_async_bgstage`` (the same with ``use_async_staging=True``), and two that refuse to run
without CUDA: ``dcp_async_pinned_cache`` (``BlockingAsyncStager(cache_staged_state_dict=True)``)
and ``dcp_async_defaultstager`` (``DefaultStager(StagingOptions())``).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from typing import Any, Optional

from . import harness as h

METHODS = ["memcpy", "memcpy_1t", "objckpt_sync", "objckpt_async", "objckpt_async_256m", "objckpt_async_2x",
           "objckpt_lazy", "dcp_async", "dcp_async_cached", "dcp_async_bgstage", "dcp_async_pinned_cache",
           "dcp_async_defaultstager"]


class Saver:
    """One method: ``setup`` once, then ``save`` returns (stall, ready, done) seconds from the call."""

    def __init__(self, name: str, args: argparse.Namespace, state: dict) -> None:
        self.name, self.args, self.remote = name, args, not name.startswith("memcpy")
        self.uri = lambda prefix: f"s3://{args.bucket}/{prefix}"
        if not self.remote:
            import torch

            if name == "memcpy_1t":
                torch.set_num_threads(1)  # one copy loop, no OpenMP fork/join per tensor
            # Untouched: the cold (first) call pays first-touch page faults, later calls do not.
            self.dst = {k: torch.empty_like(v) for k, v in state.items()}
        elif name.startswith("objckpt"):
            import objckpt

            self.objckpt, self.opts = objckpt, h.s3_options(args.endpoint_url)
            self.staging = {"objckpt_async_256m": 256 * h.MiB,
                            "objckpt_async_2x": 2 * sum(t.numel() * t.element_size() for t in state.values())
                            }.get(name)  # 2x: a buffer slot for every part at once, see benchmarks/README.md
        else:
            self._setup_dcp(name)

    def _setup_dcp(self, name: str) -> None:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

        from .methods import dcp

        self.dcp = dcp()
        cpu_only = dict(use_pinned_memory=False, use_shared_memory=False, use_non_blocking_copy=False)
        self.stager = {"dcp_async": lambda: None,
                       "dcp_async_cached": lambda: DefaultStager(StagingOptions(use_async_staging=False, **cpu_only)),
                       "dcp_async_bgstage": lambda: DefaultStager(StagingOptions(use_async_staging=True, **cpu_only)),
                       "dcp_async_pinned_cache": lambda: BlockingAsyncStager(cache_staged_state_dict=True),
                       "dcp_async_defaultstager": lambda: DefaultStager(StagingOptions())}[name]()

    def warm_client(self) -> None:
        from .methods import warm_s3fs

        if self.name.startswith("objckpt"):
            try:  # a manifest GET on a checkpoint that does not exist: client and connections
                self.objckpt.inspect(self.uri("__warmup__"), storage_options=self.opts)
            except Exception:  # noqa: BLE001 - NotFound expected
                pass
        elif self.remote:
            warm_s3fs(self.uri("__warmup__"), self.args.endpoint_url, self.args.bucket)

    def save(self, state: dict, prefix: str) -> tuple[float, float, float]:
        import torch

        t0 = time.perf_counter()
        if not self.remote:
            with torch.no_grad():
                for k, v in state.items():
                    self.dst[k].copy_(v)
            stall = ready = time.perf_counter() - t0
        elif self.name == "objckpt_sync":
            self.objckpt.save(state, self.uri(prefix), storage_options=self.opts)
            stall = ready = time.perf_counter() - t0
        elif self.name.startswith("objckpt"):
            hd = self.objckpt.async_save(state, self.uri(prefix), storage_options=self.opts,
                                         lazy=self.name == "objckpt_lazy", staging_bytes=self.staging)
            stall = time.perf_counter() - t0
            hd.wait_staged()
            ready = time.perf_counter() - t0
            hd.result()
        else:
            from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

            from .methods import fsspec_writer

            w = fsspec_writer(self.uri(prefix), self.args.endpoint_url)
            t0 = time.perf_counter()
            kw = {"async_stager": self.stager} if self.stager is not None else {}
            r = self.dcp.async_save(state, storage_writer=w, no_dist=True, **kw)
            stall = time.perf_counter() - t0
            if isinstance(r, AsyncSaveResponse):
                r.staging_completion.result()
                ready = time.perf_counter() - t0
                r.upload_completion.result()
            else:
                ready = stall
                r.result()
        return stall, ready, time.perf_counter() - t0

    def close(self) -> None:
        if getattr(self, "stager", None) is not None:
            self.stager.close()


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One method's cold + steady saves in this process; the result dict."""
    from .gpt_state import make_gpt_state, scaled_bytes

    out: dict[str, Any] = {"method": args.worker, "ok": False, "runs": []}
    state = make_gpt_state(scaled_bytes(args.scale), args.seed)
    out["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    try:
        m = Saver(args.worker, args, state)
        m.warm_client()
    except Exception as e:  # noqa: BLE001
        return {**out, "status": "skipped", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=6)}
    client = h.boto3_client(args.endpoint_url) if m.remote else None
    out["rss_after_setup_bytes"] = h.proc_status("VmRSS")
    steady = h.PeakRss()
    for i in range(1 + args.repeat):
        gc.collect()
        if i == 1:
            out["cold_peak_rss_bytes"] = h.proc_status("VmHWM")  # state + the cold save
            steady.__enter__()
        prefix = f"{args.prefix}/{args.worker}/s{i}"
        s0, c0 = h.cpu_seconds(args.server_pid), time.process_time()
        try:
            stall, ready, done = m.save(state, prefix)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            out.update(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}",
                       traceback=traceback.format_exc(limit=8), failed_at=i)
            break
        c1, s1 = time.process_time(), h.cpu_seconds(args.server_pid)
        out["runs"].append({"i": i, "cold": i == 0, "stall_s": stall, "ready_s": ready, "done_s": done,
                            "cpu_s": c1 - c0, "server_cpu_s": s1 - s0 if s0 is not None and s1 is not None else None})
        h.log(f"  {args.worker} {'cold' if i == 0 else 'save'} {i}: stall {stall:.3f} s, ready {ready:.3f} s, "
              f"done {done:.3f} s, cpu {c1 - c0:.2f} s")
        if client is not None:
            h.delete_prefix(client, args.bucket, prefix)
    else:
        out.update(ok=True, status="ok")
    try:
        m.close()
    except Exception:  # noqa: BLE001
        pass
    if hasattr(steady, "before"):  # the steady saves started
        steady.__exit__()
        out.update(steady_peak_rss_bytes=steady.op_peak, steady_rss_before_bytes=steady.before)
    out["lifetime_peak_rss_bytes"] = max(h.proc_status("VmHWM") or 0, out.get("cold_peak_rss_bytes") or 0) or None
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    runs = res.get("runs", [])
    cold = [r for r in runs if r["cold"]][:1]
    steady = [r for r in runs if not r["cold"]]
    d: dict[str, Any] = {"method": res["method"], "status": res.get("status"), "error": res.get("error"),
                         "n": len(steady)}
    for f in ("stall_s", "ready_s", "done_s", "cpu_s", "server_cpu_s"):
        d[f], d["cold_" + f] = h.median(r[f] for r in steady), cold[0][f] if cold else None
    sp, sb = res.get("steady_peak_rss_bytes"), res.get("steady_rss_before_bytes")
    d.update(peak_rss_bytes=res.get("lifetime_peak_rss_bytes"), steady_peak_rss_bytes=sp,
             steady_peak_minus_before_bytes=sp - sb if sp and sb else None)
    return d


def markdown_table(rows: list[dict[str, Any]], ref: Optional[dict[str, Any]]) -> str:
    head = ["method", "stall s", "stall / memcpy", "ready s", "done s", "cold stall s (/ cold memcpy)",
            "cold done s", "client CPU-s / save", "server CPU-s / save", "peak RSS GiB (steady Δ)"]
    out = []
    for r in rows:
        if r.get("status") != "ok" and not r.get("n"):
            out.append([r["method"], f"{r.get('status')}: " + (r.get("error") or "")[:160].replace("|", "/")
                        .replace("\n", " ")] + [""] * (len(head) - 2))
            continue
        cold = h.fmt(r["cold_stall_s"], "{:.3f}") + (f" ({h.ratio(r['cold_stall_s'], ref['cold_stall_s'], '{:.2f}×')})"
                                                      if ref and ref.get("cold_stall_s") else "")
        rss = "–" if not r["peak_rss_bytes"] else f"{r['peak_rss_bytes'] / h.GiB:.2f}" + (
            "" if r["steady_peak_minus_before_bytes"] is None else f" (+{r['steady_peak_minus_before_bytes'] / h.GiB:.2f})")
        out.append([r["method"], h.fmt(r["stall_s"], "{:.3f}"),
                    h.ratio(r["stall_s"], ref and ref["stall_s"], "{:.2f}×"), h.fmt(r["ready_s"], "{:.3f}"),
                    h.fmt(r["done_s"], "{:.3f}"), cold, h.fmt(r["cold_done_s"], "{:.3f}"),
                    h.fmt(r["cpu_s"], "{:.2f}"), h.fmt(r["server_cpu_s"], "{:.2f}"), rss])
    return h.md_table(head, out)


def driver(args: argparse.Namespace) -> int:
    from .gpt_state import gpt_specs, scaled_bytes

    methods = [m for m in args.methods.split(",") if m]
    if any(m not in METHODS for m in methods):
        raise SystemExit(f"unknown methods; known: {', '.join(METHODS)}")
    specs = gpt_specs(scaled_bytes(args.scale))
    state_bytes = sum(s.nbytes for s in specs)
    rid, t0 = h.run_id("async"), time.perf_counter()
    h.log(f"state: {len(specs)} tensors, {state_bytes / h.GiB:.3f} GiB; methods {methods}; "
          f"1 cold + {args.repeat} steady saves each")
    raw = []
    with h.Server("fast", args.bucket) as server:
        for m in methods:
            h.log(f"{m} ...")
            cmd = ["-m", "benchmarks.bench_async", "--worker", m, "--endpoint-url", server.url, "--server-pid",
                   str(server.pid), "--bucket", args.bucket, "--prefix", rid, "--scale", str(args.scale),
                   "--seed", str(args.seed), "--repeat", str(args.repeat)]
            raw.append(h.run_json(cmd, args.timeout, show_stderr=True, method=m))
            if raw[-1].get("status") != "ok":
                h.log(f"  {m}: {raw[-1].get('status')}: {raw[-1].get('error')}")
    rows = [summarize(r) for r in raw]
    refs = [r for r in rows if r["method"].startswith("memcpy") and r.get("stall_s")]
    ref = {"stall_s": min(r["stall_s"] for r in refs),
           "cold_stall_s": min((r["cold_stall_s"] for r in refs if r["cold_stall_s"]), default=None)} if refs else None
    table = markdown_table(rows, ref)
    path = h.write_results(h.result_path(args.name), {
        "name": args.name, "config": dict(vars(args), methods=methods, state_bytes=state_bytes, tensors=len(specs)),
        "environment": h.environment("s3fs"), "reference": ref, "summary": rows, "raw": raw, "table_markdown": table,
        "total_s": time.perf_counter() - t0})
    print(f"\n{len(specs)} tensors, {state_bytes / h.GiB:.3f} GiB; steady = median of {args.repeat} after 1 cold "
          f"save; stall / memcpy against the faster steady memcpy"
          + (f" ({ref['stall_s']:.3f} s)" if ref else "") + f":\n\n{table}\n\nresults: {path}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated; known: {', '.join(METHODS)}")
    ap.add_argument("--scale", type=float, default=1.0, help="state size relative to 1.03 GiB")
    ap.add_argument("--repeat", type=int, default=3, help="steady saves after the cold one (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--name", default="async", help="benchmarks/results/<name>.json")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per method subprocess")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # worker mode: one method, one JSON line
    ap.add_argument("--endpoint-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="async", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args), default=repr), flush=True)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
