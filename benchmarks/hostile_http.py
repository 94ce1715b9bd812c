"""The ``hostile_http`` kind of the fault campaign: objckpt's own S3 client against a
server that answers the way a broken or hostile endpoint does (``tests/hostile_http.py``:
trickled heads and bodies, interim 1xx answers, chunk announcements of 1 GiB, a 206 of
the wrong range, a Content-Length of 1 TiB, a server that reads uploads slowly).

Each trial runs in a fresh process (its peak RSS is the trial's alone) with the
server on a thread and one store call: a 2 MB ranged read, a whole-object GET or a
16 MiB PUT.  Judged as the campaign judges: ``ok`` (the bytes are right),
``detected`` (an ObjckptError, naming the endpoint), ``FAILED`` (a built-in
exception, a hang past the limit, wrong bytes).

    python -m benchmarks.hostile_http [--limit 120]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Optional

from testkit.campaign import DETECTED, FAILED, OK, Trial

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: mode -> (operation, what a correct client does)
MODES: dict[str, tuple[str, str]] = {
    "ok": ("range", OK), "continue": ("range", OK), "chunked": ("range", OK),
    "trickle_head": ("range", DETECTED), "trickle_body": ("range", DETECTED),
    "huge_chunk": ("range", DETECTED), "wrong_range": ("range", DETECTED),
    "huge_length": ("get", DETECTED), "slow_reader": ("put", DETECTED),
}
#: the deadline settings of the trials (small, so that a trickle is reported in seconds)
OPTIONS = {"deadline_floor": 2.0, "min_rate": float(4 << 20), "read_timeout": 5.0, "max_backoff": 0.1}


def _child(mode: str) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(_ROOT, "tests"))
    from hostile_http import HostileServer  # noqa: E402 - tests/ is not a package

    from objckpt.runtime import loop as _runtime
    from objckpt.errors import ObjckptError
    from objckpt.storage import open_store

    data = os.urandom(3 << 20)
    op = MODES[mode][0]
    with HostileServer(data, mode, interval=0.05 if mode != "slow_reader" else 0.1, flood=256 << 20) as srv:
        opts = {"endpoint_url": srv.endpoint, "aws_access_key_id": "a", "aws_secret_access_key": "b",
                "region_name": "us-east-1", "endpoint_kind": "s3", **OPTIONS}
        store = open_store("s3://b", opts)[0]
        t0 = time.perf_counter()
        try:
            if op == "range":
                got = _runtime.run(store.get_range("k", 100, 2_000_000))
                outcome = OK if got == data[100:2_000_100] else FAILED
                detail = "bytes right" if outcome == OK else "wrong bytes"
            elif op == "get":
                got = _runtime.run(store.get("k"))
                outcome, detail = (OK, "bytes right") if got == data else (FAILED, "wrong bytes")
            else:
                _runtime.run(store.put("k", memoryview(bytearray(16 << 20))))
                outcome, detail = OK, "stored"
        except Exception as e:  # noqa: BLE001 - judged below
            outcome = DETECTED if isinstance(e, ObjckptError) and srv.endpoint in str(e) else FAILED
            detail = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:400]}"
        seconds = time.perf_counter() - t0
    return {"outcome": outcome, "detail": detail, "seconds": seconds,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def hostile_http_trial(mode: str, limit: float = 120.0) -> Trial:
    """One mode, in a fresh process; a child still running after ``limit`` s is a hang."""
    params = {"mode": mode, "op": MODES[mode][0], **OPTIONS}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "benchmarks.hostile_http", "--child", mode], cwd=_ROOT,
                           capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return Trial("hostile_http", params, FAILED, f"hung: no result after {limit:g} s", 1,
                     time.perf_counter() - t0)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return Trial("hostile_http", params, FAILED, f"child exited {p.returncode}: {p.stderr[-600:]}", 1,
                     time.perf_counter() - t0)
    r = json.loads(lines[-1])
    expected = MODES[mode][1]
    outcome = r["outcome"] if r["outcome"] == expected else FAILED
    detail = r["detail"] if outcome != FAILED or r["outcome"] == FAILED else f"expected {expected}: {r['detail']}"
    return Trial("hostile_http", params, outcome, detail, 0 if mode == "ok" else 1, r["seconds"],
                 {"peak_rss": r["peak_rss"], "op_s": round(r["seconds"], 3)})


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=120.0)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child)))
        return 0
    for mode in MODES:
        t = hostile_http_trial(mode, a.limit)
        print(f"{mode:13s} {t.outcome:9s} {t.seconds:6.2f} s  peak RSS {t.extra.get('peak_rss', 0) / 2 ** 20:6.0f} MiB"
              f"  {t.detail[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
