"""Run one operation of one method once, in this process, and print one JSON line.

    python -m benchmarks.run_one --method dcp_s3fs --op save \
        --endpoint-url http://127.0.0.1:5000 --bucket bench --prefix run1/dcp_s3fs \
        --scale 0.05 --seed 0

The state (or the load template / expected values) is built before the timed
region; only the operation itself is timed.  Reported:

* ``wall_s``: ``time.perf_counter`` around the op; ``cpu_s``:
  ``time.process_time`` delta (all threads of this process, user + system).
* ``gbps`` = bytes / wall / 1e9; ``cpu_s_per_gb`` = cpu_s / (bytes / 1e9).
* ``peak_rss_bytes``: the process's lifetime peak RSS (for load and read_one
  the expected values are generated one tensor at a time, so before the op the
  process never held much more than the template).  Taken from Linux
  ``VmHWM`` (before and after the op), not ``ru_maxrss``: ``ru_maxrss`` is
  inherited across fork/vfork + exec, so a child's value is never below its
  parent's peak RSS at spawn time (the driver's RSS leaked into every method's
  number).  ``ru_maxrss_bytes`` is reported too, and used if ``/proc`` is
  missing.  ``op_peak_rss_bytes``: the peak during the op alone (``VmHWM``
  after resetting it through ``/proc/self/clear_refs``; null if that is not
  allowed); ``rss_before_bytes`` and ``peak_minus_before_bytes``.
* ``file_read_bytes`` / ``file_write_bytes``: ``rchar``/``wchar`` deltas of
  ``/proc/self/io`` (read()/write() syscalls: local files; sockets through
  send/recv are not counted).
* ``server``: the target's request/byte counters for the op (``--server-stats``).
* By default the method makes one cheap request first (``Method.warmup``), so
  a warm client is timed, as in a training job's later checkpoints.
* ``ok`` / ``verify``: load checks crc32 of every tensor and compares a few in
  full; read_one compares the tensor in full.

Exit status 0 whenever a JSON line was printed (``ok`` says how it went).
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
import traceback
import zlib
from typing import Any, Optional

import torch

from .gpt_state import gpt_specs, iter_gpt_state, make_gpt_state, make_tensor, partial_read_key, scaled_bytes
from .methods import Target, make_method


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def _proc_status(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _proc_io() -> dict[str, int]:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def _reset_peak_rss() -> bool:
    """Reset VmHWM (Linux >= 4.0); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _server_stats(endpoint_url: str, reset: bool = False) -> Any:
    """objckpt's test server: POST reset_stats (returns None) or GET stats (a dict).

    Returns an error string when the server does not offer them.
    """
    import urllib.request

    try:
        if reset:
            req = urllib.request.Request(f"{endpoint_url}/_objckpt/reset_stats", data=b"", method="POST")
            urllib.request.urlopen(req, timeout=10).read()
            return None
        with urllib.request.urlopen(f"{endpoint_url}/_objckpt/stats", timeout=10) as r:
            return json.loads(r.read())
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _verify_load(
    loaded: Any, expected_crc: dict[str, int], shapes: dict[str, tuple[int, ...]], full: dict[str, torch.Tensor]
) -> str:
    """'' if ``loaded`` matches, else a description of the first problems."""
    if not isinstance(loaded, dict):
        return f"load returned {type(loaded).__name__}, not a dict"
    problems: list[str] = []
    missing = [k for k in expected_crc if k not in loaded]
    if missing:
        problems.append(f"{len(missing)} keys missing, e.g. {missing[:3]}")
    for k, crc in expected_crc.items():
        if k not in loaded:
            continue
        t = loaded[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[k] or t.dtype != torch.float32:
            problems.append(f"{k}: got {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        elif k in full and not torch.equal(t.cpu(), full[k]):
            problems.append(f"{k}: values differ")
        elif _crc(t.cpu()) != crc:
            problems.append(f"{k}: crc32 differs")
        if len(problems) >= 5:
            break
    return "; ".join(problems)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Do the op once; the result dict printed as JSON."""
    out: dict[str, Any] = {
        "method": args.method,
        "op": args.op,
        "scale": args.scale,
        "seed": args.seed,
        "prefix": args.prefix,
        "ok": False,
    }
    try:
        method = make_method(args.method)
        target = Target(args.endpoint_url, args.bucket, args.prefix, args.local_root)
        method.setup(target)
    except Exception as e:  # noqa: BLE001 - e.g. objckpt not importable yet
        out.update(status="skipped", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))
        return out
    if args.warmup:
        try:
            method.warmup(target)
        except Exception as e:  # noqa: BLE001 - the op itself will report real failures
            out["warmup_error"] = f"{type(e).__name__}: {e}"

    total = scaled_bytes(args.scale)
    specs = gpt_specs(total)
    shapes = {s.key: s.shape for s in specs}
    state: Optional[dict[str, torch.Tensor]] = None
    template: Optional[dict[str, torch.Tensor]] = None
    expected_crc: dict[str, int] = {}
    full: dict[str, torch.Tensor] = {}
    key = partial_read_key(total)
    like: Optional[torch.Tensor] = None
    expected_one: Optional[torch.Tensor] = None

    if args.op == "save":
        state = make_gpt_state(total, args.seed)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
    elif args.op == "load":
        # Compared in full after the load: small ones (so the copies do not inflate RSS); crc32 for all.
        keep = {specs[1].key, specs[3].key, specs[-1].key, key}
        for k, t in iter_gpt_state(total, args.seed):
            expected_crc[k] = _crc(t)
            if k in keep:
                full[k] = t.clone()
            del t
        template = {s.key: torch.zeros(s.shape, dtype=torch.float32) for s in specs}
        nbytes = sum(s.nbytes for s in specs)
    else:
        spec = next(s for s in specs if s.key == key)
        expected_one = make_tensor(spec, args.seed)
        like = torch.empty(spec.shape, dtype=torch.float32)
        nbytes = spec.nbytes
        out["key"] = key

    gc.collect()
    pre_peak = _proc_status("VmHWM")
    if args.server_stats:
        out["server_stats_error"] = _server_stats(args.endpoint_url, reset=True)
    hwm_reset = _reset_peak_rss()
    rss_before = _proc_status("VmRSS")
    io0 = _proc_io()
    result: Any = None
    error: Optional[str] = None
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    try:
        if args.op == "save":
            method.save(state, target)  # type: ignore[arg-type]
        elif args.op == "load":
            result = method.load(template, target)  # type: ignore[arg-type]
        else:
            result = method.read_one(key, target, like)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - reported, not raised
        error = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=8)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    io1 = _proc_io()
    if args.server_stats:
        stats = _server_stats(args.endpoint_url)
        if isinstance(stats, dict):
            out["server"] = stats
            out.pop("server_stats_error", None)
        else:
            out["server_stats_error"] = stats
    hwm = _proc_status("VmHWM")
    op_peak = hwm if hwm_reset else None
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if hwm is not None:
        peak = max(hwm, pre_peak or 0)
    else:
        peak = ru_maxrss

    out.update(
        bytes=nbytes,
        wall_s=wall,
        cpu_s=cpu,
        gbps=nbytes / wall / 1e9 if wall > 0 else None,
        cpu_s_per_gb=cpu / (nbytes / 1e9) if nbytes else None,
        peak_rss_bytes=peak,
        ru_maxrss_bytes=ru_maxrss,
        op_peak_rss_bytes=op_peak,
        rss_before_bytes=rss_before,
        peak_minus_before_bytes=(op_peak if op_peak is not None else peak) - rss_before if rss_before else None,
        file_read_bytes=io1.get("rchar", 0) - io0.get("rchar", 0) if io0 else None,
        file_write_bytes=io1.get("wchar", 0) - io0.get("wchar", 0) if io0 else None,
        info=method.info,
    )
    if error is not None:
        out.update(status="failed", error=error)
        return out

    if args.op == "save":
        verify = ""
    elif args.op == "load":
        verify = _verify_load(result, expected_crc, shapes, full)
    else:
        if not isinstance(result, torch.Tensor):
            verify = f"read_one returned {type(result).__name__}"
        elif tuple(result.shape) != tuple(expected_one.shape) or not torch.equal(result.cpu(), expected_one):  # type: ignore[union-attr]
            verify = f"{key}: values differ (got {tuple(result.shape)})"
        else:
            verify = ""
    out.update(ok=not verify, status="ok" if not verify else "verify_failed",
               verify=verify or ("crc32 all + full compare of 4" if args.op == "load" else
                                 "not checked (see load)" if args.op == "save" else "full compare"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Run one benchmark op in this process; print one JSON line.")
    ap.add_argument("--method", required=True)
    ap.add_argument("--op", required=True, choices=["save", "load", "read_one"])
    ap.add_argument("--endpoint-url", default=None)
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-root", default="/tmp/objckpt-bench")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time a cold client (first request of the process) instead of a warm one")
    ap.add_argument("--server-stats", action="store_true",
                    help="reset/read the target's /_objckpt/stats around the op (objckpt's test server)")
    args = ap.parse_args(argv)
    out = run(args)
    sys.stdout.flush()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
