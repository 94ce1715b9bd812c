"""Async checkpoint stall benchmark: how long a save blocks the training loop.

    python -m benchmarks.bench_async                       # 1.03 GiB, median of 3 (~3 min on 2 cores)
    python -m benchmarks.bench_async --scale 0.05 --repeat 1   # quick check (~30 s)
    python -m benchmarks.bench_async --methods memcpy,objckpt_async,dcp_async_cached

Starts the fast S3 server (``python -m objckpt.testing.s3server --port 0``) in its own
process, then runs every method in its **own subprocess** (``--worker``), so peak RSS
and CPU seconds belong to that method.  A worker builds the same GPT-like fp32 state as
the other benchmarks (:mod:`benchmarks.gpt_state`), makes one cheap request with its
client (so botocore/s3fs set-up is not timed), then saves ``1 + --repeat`` times to
fresh prefixes, waiting for each save to finish and deleting it (untimed) before the
next.  The first save is the **cold** call (first touch of staging memory: 2-4 CPU-s/GB
on this VM); the **steady** numbers are medians of the other ``--repeat`` (a training
job saves every N steps and reuses its buffers).  Per save:

* ``stall``: from the call until it returns, i.e. until training may go on.  For the
  lazy / background-staging variants training may run forward/backward after that
  but must wait for ``ready`` before it mutates the tensors (``optimizer.step()``).
* ``ready``: until the state is safe to mutate (``stall`` for the blocking variants,
  ``handle.wait_staged()`` / DCP's ``staging_completion``).
* ``done``: until the checkpoint is committed (``handle.result()`` / the DCP future).
* ``cpu_s``: the client process's CPU seconds (all threads) from the call to ``done``;
  ``server_cpu_s``: the S3 server's over the same span (psutil).
* peak RSS: ``VmHWM`` over the worker's life (state + staging), and over the steady
  saves only after resetting it (``/proc/self/clear_refs``), minus the RSS before them.

The reference is ``memcpy``: ``dst.copy_(src)`` of every tensor into preallocated,
pre-touched tensors, the least a copy-then-upload save can stall for.  Ratios are
``stall / memcpy`` (steady) and ``cold stall / cold memcpy``, against the faster of
``memcpy`` and ``memcpy_1t`` (on a 2-core VM with another busy process, each OpenMP
parallel region of a multi-threaded ``copy_`` can wait a scheduler slice for its second
thread, ~8 ms per tensor; one thread then copies 5x faster).

Methods (``--methods``):

==========================  =================================================================
``memcpy``                  the reference above (cold: copy into untouched ``empty_like``),
                            torch's default intra-op threads (OpenMP, one per core)
``memcpy_1t``               the same after ``torch.set_num_threads(1)``
``objckpt_sync``            ``objckpt.save`` (zero-copy upload from the tensors; blocks to the end)
``objckpt_async``           ``objckpt.async_save`` (stage everything, return; upload behind)
``objckpt_async_256m``      the same with ``staging_bytes=256 MiB`` (returns when the last part
                            is staged: staging and upload pipelined within the budget)
``objckpt_async_2x``        the same with ``staging_bytes`` = 2x the state: a workaround, see
                            :class:`ObjckptAsync2x` (same memory, no part waits for an upload)
``objckpt_lazy``            ``objckpt.async_save(lazy=True)``; ``wait_staged()`` is ``ready``
``dcp_async``               ``dcp.async_save`` + ``FsspecWriter`` over s3fs, defaults: the writer
                            stages (``BlockingAsyncStager``, a fresh CPU copy every save)
``dcp_async_cached``        ``async_stager=DefaultStager(StagingOptions(False, False, False, False))``
                            kept across saves: staged storages are cached and reused
``dcp_async_bgstage``       ``DefaultStager(StagingOptions(use_async_staging=True, others False))``
                            kept across saves: staging in a background thread, returns an
                            ``AsyncSaveResponse``; ``staging_completion`` is ``ready``
``dcp_async_pinned_cache``  ``async_stager=BlockingAsyncStager(cache_staged_state_dict=True)``:
                            DCP's reusable pinned staging buffers (``FileSystemWriter``'s
                            ``cache_staged_state_dict=True``, which ``FsspecWriter`` does not take:
                            its kwargs go to s3fs); pins, so fails without CUDA
``dcp_async_defaultstager`` ``DefaultStager(StagingOptions())`` (pinned, shared, async, non-blocking
                            copies): refuses to start without an accelerator
==========================  =================================================================

DCP runs with ``no_dist=True`` (single process, no process group needed; DCP's thread
executor then calls ``dcp.save(no_dist=True)``) and ``FsspecWriter(sync_files=False)``
with the s3fs options of :mod:`benchmarks.methods`.  Results:
``benchmarks/results/<--name, default async>.json`` and a markdown table on stdout.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Optional

from .run_one import _proc_status, _reset_peak_rss

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
GiB = 1 << 30
MiB = 1 << 20

METHODS = [
    "memcpy",
    "memcpy_1t",
    "objckpt_sync",
    "objckpt_async",
    "objckpt_async_256m",
    "objckpt_async_2x",
    "objckpt_lazy",
    "dcp_async",
    "dcp_async_cached",
    "dcp_async_bgstage",
    "dcp_async_pinned_cache",
    "dcp_async_defaultstager",
]


# --------------------------------------------------------------------------- worker side


class Timing:
    """What one save reports (seconds from the call)."""

    def __init__(self) -> None:
        self.stall = self.ready = self.done = 0.0


class AsyncMethod:
    """One way to checkpoint; ``save`` fills a :class:`Timing` and returns when done."""

    remote = True

    def __init__(self, args: argparse.Namespace) -> None:
        from .methods import Target

        self.args = args
        self.target_of = lambda prefix: Target(args.endpoint_url, args.bucket, prefix)

    def setup(self, state: dict) -> None:
        pass

    def warm_client(self) -> None:
        pass

    def save(self, state: dict, prefix: str, t: Timing) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Memcpy(AsyncMethod):
    remote = False

    def setup(self, state: dict) -> None:
        import torch

        # Untouched: the cold (first) call pays first-touch page faults, later calls do not.
        self.dst = {k: torch.empty_like(v) for k, v in state.items()}

    def save(self, state: dict, prefix: str, t: Timing) -> None:
        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            for k, v in state.items():
                self.dst[k].copy_(v)
        t.stall = t.ready = t.done = time.perf_counter() - t0


class Memcpy1T(Memcpy):
    def setup(self, state: dict) -> None:
        import torch

        torch.set_num_threads(1)  # one copy loop, no OpenMP fork/join per tensor
        super().setup(state)


class _ObjckptBase(AsyncMethod):
    def setup(self, state: dict) -> None:
        import objckpt

        self.objckpt = objckpt
        self.opts = self.target_of("x").storage_options()

    def warm_client(self) -> None:
        try:  # a manifest GET on a checkpoint that does not exist: client and connections
            self.objckpt.inspect(self.target_of("__warmup__").s3_uri, storage_options=self.opts)
        except Exception:  # noqa: BLE001 - NotFound expected
            pass


class ObjckptSync(_ObjckptBase):
    def save(self, state: dict, prefix: str, t: Timing) -> None:
        t0 = time.perf_counter()
        self.objckpt.save(state, self.target_of(prefix).s3_uri, storage_options=self.opts)
        t.stall = t.ready = t.done = time.perf_counter() - t0


class ObjckptAsync(_ObjckptBase):
    lazy = False
    staging_bytes: Optional[int] = None

    def save(self, state: dict, prefix: str, t: Timing) -> None:
        t0 = time.perf_counter()
        h = self.objckpt.async_save(state, self.target_of(prefix).s3_uri, storage_options=self.opts,
                                    lazy=self.lazy, staging_bytes=self.staging_bytes)
        t.stall = time.perf_counter() - t0
        h.wait_staged()
        t.ready = time.perf_counter() - t0
        h.result()
        t.done = time.perf_counter() - t0


class ObjckptAsync256(ObjckptAsync):
    staging_bytes = 256 * MiB


class ObjckptAsync2x(ObjckptAsync):
    """``staging_bytes`` = twice the state: enough buffer *slots* for every part at once
    (the default budget, the state's size, is divided by the largest part, so a few parts
    wait for earlier uploads); the pool still allocates only what the parts need."""

    def setup(self, state: dict) -> None:
        super().setup(state)
        self.staging_bytes = 2 * sum(t.numel() * t.element_size() for t in state.values())


class ObjckptLazy(ObjckptAsync):
    lazy = True


class _DcpBase(AsyncMethod):
    def setup(self, state: dict) -> None:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        from .methods import ACCESS_KEY, REGION, SECRET_KEY

        self.dcp, self.writer_cls = dcp, FsspecWriter
        self.fs_options = {"endpoint_url": self.args.endpoint_url, "key": ACCESS_KEY, "secret": SECRET_KEY,
                           "client_kwargs": {"region_name": REGION}}
        self.stager: Any = None

    def warm_client(self) -> None:
        from fsspec.core import url_to_fs

        fs, _ = url_to_fs(self.target_of("__warmup__").s3_uri, **self.fs_options)
        fs.exists(f"{self.args.bucket}/__warmup__/x")
        fs.invalidate_cache()

    def writer(self, prefix: str, **kw: Any) -> Any:
        return self.writer_cls(self.target_of(prefix).s3_uri, sync_files=False, **self.fs_options, **kw)

    def save(self, state: dict, prefix: str, t: Timing) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        w = self.writer(prefix, **self.writer_kwargs())
        t0 = time.perf_counter()
        kw = {"async_stager": self.stager} if self.stager is not None else {}
        r = self.dcp.async_save(state, storage_writer=w, no_dist=True, **kw)
        t.stall = time.perf_counter() - t0
        if isinstance(r, AsyncSaveResponse):
            r.staging_completion.result()
            t.ready = time.perf_counter() - t0
            r.upload_completion.result()
        else:
            t.ready = t.stall
            r.result()
        t.done = time.perf_counter() - t0

    def writer_kwargs(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class DcpAsync(_DcpBase):
    pass


class DcpAsyncCached(_DcpBase):
    bg = False

    def setup(self, state: dict) -> None:
        super().setup(state)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=self.bg, use_non_blocking_copy=False))


class DcpAsyncBgStage(DcpAsyncCached):
    bg = True


class DcpAsyncPinnedCache(_DcpBase):
    def setup(self, state: dict) -> None:
        super().setup(state)
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        self.stager = BlockingAsyncStager(cache_staged_state_dict=True)


class DcpAsyncDefaultStager(_DcpBase):
    def setup(self, state: dict) -> None:
        super().setup(state)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions())  # pinned + shared + async + non-blocking


WORKERS: dict[str, Callable[[argparse.Namespace], AsyncMethod]] = {
    "memcpy": Memcpy,
    "memcpy_1t": Memcpy1T,
    "objckpt_sync": ObjckptSync,
    "objckpt_async": ObjckptAsync,
    "objckpt_async_256m": ObjckptAsync256,
    "objckpt_async_2x": ObjckptAsync2x,
    "objckpt_lazy": ObjckptLazy,
    "dcp_async": DcpAsync,
    "dcp_async_cached": DcpAsyncCached,
    "dcp_async_bgstage": DcpAsyncBgStage,
    "dcp_async_pinned_cache": DcpAsyncPinnedCache,
    "dcp_async_defaultstager": DcpAsyncDefaultStager,
}


def _server_cpu(pid: Optional[int]) -> Callable[[], Optional[float]]:
    if not pid:
        return lambda: None
    try:
        import psutil

        p = psutil.Process(pid)
    except Exception:  # noqa: BLE001 - psutil optional
        return lambda: None

    def f() -> Optional[float]:
        try:
            c = p.cpu_times()
            return c.user + c.system
        except Exception:  # noqa: BLE001
            return None

    return f


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Run one method's cold + steady saves in this process; the result dict."""
    from .gpt_state import make_gpt_state, scaled_bytes

    out: dict[str, Any] = {"method": args.worker, "ok": False, "runs": []}
    state = make_gpt_state(scaled_bytes(args.scale), args.seed)
    out["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
    try:
        m = WORKERS[args.worker](args)
        m.setup(state)
        m.warm_client()
    except Exception as e:  # noqa: BLE001
        out.update(status="skipped", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
        return out
    client = None
    if m.remote:
        from .bench_save_load import _client

        client = _client(args.endpoint_url)
    server_cpu = _server_cpu(args.server_pid)
    out["rss_after_setup_bytes"] = _proc_status("VmRSS")
    steady_rss_before = None
    steady_hwm_reset = False
    for i in range(1 + args.repeat):
        gc.collect()
        if i == 1:
            out["cold_peak_rss_bytes"] = _proc_status("VmHWM")  # state + the cold save
            steady_hwm_reset = _reset_peak_rss()
            steady_rss_before = _proc_status("VmRSS")
        prefix = f"{args.prefix}/{args.worker}/s{i}"
        t = Timing()
        s0, c0 = server_cpu(), time.process_time()
        try:
            m.save(state, prefix, t)
        except BaseException as e:  # noqa: BLE001 - reported; DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            out.update(status="failed", error=f"{type(e).__name__}: {str(e)[:400]}",
                       traceback=traceback.format_exc(limit=8), failed_at=i)
            break
        c1, s1 = time.process_time(), server_cpu()
        run = {"i": i, "cold": i == 0, "stall_s": t.stall, "ready_s": t.ready, "done_s": t.done,
               "cpu_s": c1 - c0, "server_cpu_s": (s1 - s0) if s0 is not None and s1 is not None else None}
        out["runs"].append(run)
        print(f"  {args.worker} {'cold' if i == 0 else 'save'} {i}: stall {t.stall:.3f} s, "
              f"ready {t.ready:.3f} s, done {t.done:.3f} s, cpu {run['cpu_s']:.2f} s", file=sys.stderr, flush=True)
        if client is not None:
            from .bench_save_load import _delete_prefix

            _delete_prefix(client, args.bucket, prefix)
    else:
        out.update(ok=True, status="ok")
    try:
        m.close()
    except Exception:  # noqa: BLE001
        pass
    hwm = _proc_status("VmHWM")
    # Lifetime peak (state + staging): VmHWM, or the larger of its value before and after the reset.
    out["steady_peak_rss_bytes"] = hwm if steady_hwm_reset else None
    out["steady_rss_before_bytes"] = steady_rss_before
    vals = [v for v in (hwm, out.get("cold_peak_rss_bytes")) if v]
    out["lifetime_peak_rss_bytes"] = max(vals) if vals else None
    return out


# --------------------------------------------------------------------------- driver side


def run_worker(method: str, args: argparse.Namespace, endpoint: str, server_pid: int, prefix: str) -> dict[str, Any]:
    from .methods import ACCESS_KEY, REGION, SECRET_KEY

    cmd = [sys.executable, "-m", "benchmarks.bench_async", "--worker", method, "--endpoint-url", endpoint,
           "--server-pid", str(server_pid), "--bucket", args.bucket, "--prefix", prefix,
           "--scale", str(args.scale), "--seed", str(args.seed), "--repeat", str(args.repeat)]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_DEFAULT_REGION=REGION, PYTHONWARNINGS="ignore")
    try:
        p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "ok": False, "status": "timeout", "error": f"no result in {args.timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                pass
    return {"method": method, "ok": False, "status": "crashed", "error": f"exit {p.returncode}, no JSON line"}


def _med(runs: list[dict[str, Any]], f: str) -> Optional[float]:
    vals = [r[f] for r in runs if isinstance(r.get(f), (int, float))]
    return statistics.median(vals) if vals else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    runs = res.get("runs", [])
    cold = [r for r in runs if r.get("cold")]
    steady = [r for r in runs if not r.get("cold")]
    d: dict[str, Any] = {"method": res["method"], "status": res.get("status"), "error": res.get("error"),
                         "n": len(steady)}
    for f in ("stall_s", "ready_s", "done_s", "cpu_s", "server_cpu_s"):
        d[f] = _med(steady, f)
        d["cold_" + f] = cold[0].get(f) if cold else None
    d["peak_rss_bytes"] = res.get("lifetime_peak_rss_bytes")
    sp, sb = res.get("steady_peak_rss_bytes"), res.get("steady_rss_before_bytes")
    d["steady_peak_rss_bytes"] = sp
    d["steady_peak_minus_before_bytes"] = sp - sb if sp and sb else None
    return d


def _f(x: Optional[float], fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown_table(rows: list[dict[str, Any]], ref: Optional[dict[str, Any]]) -> str:
    head = ["method", "stall s", "stall / memcpy", "ready s", "done s", "cold stall s (/ cold memcpy)",
            "cold done s", "client CPU-s / save", "server CPU-s / save", "peak RSS GiB (steady Δ)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mref = ref.get("stall_s") if ref else None
    cref = ref.get("cold_stall_s") if ref else None
    for r in rows:
        if r.get("status") != "ok" and not r.get("n"):
            err = (r.get("error") or "")[:160].replace("|", "/").replace("\n", " ")
            out.append(f"| {r['method']} | {r.get('status')}: {err} |" + " |" * (len(head) - 2))
            continue
        ratio = _f(r["stall_s"] / mref, "{:.2f}×") if mref and r.get("stall_s") is not None else "–"
        cold = _f(r.get("cold_stall_s"))
        if cref and r.get("cold_stall_s") is not None:
            cold += f" ({r['cold_stall_s'] / cref:.2f}×)"
        rss = "–"
        if r.get("peak_rss_bytes"):
            rss = f"{r['peak_rss_bytes'] / GiB:.2f}"
            if r.get("steady_peak_minus_before_bytes") is not None:
                rss += f" (+{r['steady_peak_minus_before_bytes'] / GiB:.2f})"
        out.append("| " + " | ".join([
            r["method"], _f(r.get("stall_s")), ratio, _f(r.get("ready_s")), _f(r.get("done_s")), cold,
            _f(r.get("cold_done_s")), _f(r.get("cpu_s"), "{:.2f}"), _f(r.get("server_cpu_s"), "{:.2f}"), rss,
        ]) + " |")
    return "\n".join(out)


def driver(args: argparse.Namespace) -> int:
    from .bench_save_load import S3Target, _client, _environment
    from .gpt_state import gpt_specs, scaled_bytes

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in WORKERS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; known: {', '.join(WORKERS)}")
    specs = gpt_specs(scaled_bytes(args.scale))
    state_bytes = sum(s.nbytes for s in specs)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_id = f"async-{stamp}-{os.getpid()}"
    print(f"state: {len(specs)} tensors, {state_bytes / GiB:.3f} GiB; methods {methods}; "
          f"1 cold + {args.repeat} steady saves each", file=sys.stderr)
    server = S3Target("fast", os.path.join("/tmp", f"{run_id}-server.log"))
    results: dict[str, Any] = {
        "name": args.name, "created": _dt.datetime.now().isoformat(timespec="seconds"),
        "config": dict(vars(args), methods=methods, state_bytes=state_bytes, tensors=len(specs)),
        "environment": _environment(), "endpoint_url": server.endpoint_url,
    }
    raw: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        _client(server.endpoint_url).create_bucket(Bucket=args.bucket)
        for m in methods:
            print(f"{m} ...", file=sys.stderr, flush=True)
            r = run_worker(m, args, server.endpoint_url, server.proc.pid, run_id)
            if r.get("status") != "ok":
                print(f"  {m}: {r.get('status')}: {r.get('error')}", file=sys.stderr, flush=True)
            raw.append(r)
    finally:
        server.stop()
        try:
            os.remove(server.log_path)
        except OSError:
            pass
    rows = [summarize(r) for r in raw]
    refs = [r for r in rows if r["method"].startswith("memcpy") and r.get("stall_s")]
    ref = None
    if refs:
        ref = {"stall_s": min(r["stall_s"] for r in refs),
               "cold_stall_s": min((r["cold_stall_s"] for r in refs if r.get("cold_stall_s")), default=None)}
    results["reference"] = ref
    table = markdown_table(rows, ref)
    results.update(summary=rows, raw=raw, table_markdown=table, total_s=time.perf_counter() - t_start)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{args.name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(path + ".tmp", path)
    print(f"\n{len(specs)} tensors, {state_bytes / GiB:.3f} GiB, fast S3 server (own process); steady = median of "
          f"{args.repeat} after 1 cold save; stall / memcpy is steady vs the faster steady memcpy"
          + (f" ({ref['stall_s']:.3f} s)" if ref else "") + ":\n")
    print(table)
    print(f"\nresults: {os.path.relpath(path, REPO_ROOT)} ({time.perf_counter() - t_start:.0f} s)")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated; known: {', '.join(WORKERS)}")
    ap.add_argument("--scale", type=float, default=1.0, help="state size relative to 1.03 GiB")
    ap.add_argument("--repeat", type=int, default=3, help="steady saves after the cold one (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--name", default="async", help="benchmarks/results/<name>.json")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per method subprocess")
    # worker mode (one method, in this process; prints one JSON line)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint-url", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="async", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = worker(args)
        print(json.dumps(out, default=repr), flush=True)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
