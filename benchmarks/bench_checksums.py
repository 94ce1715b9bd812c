"""What server-verified uploads cost: a save with and without part checksums.

    python -m benchmarks.bench_checksums --gib 1 --repeat 3 --out benchmarks/results/checksums.json

With ``checksums`` (the default) every part carries ``x-amz-checksum-crc32c``,
combined from the chunk crcs the save computes anyway, and the server
recomputes it. Each save runs in a fresh subprocess (cold: first call, new
client) against the in-memory S3 server in its own process; the two modes
alternate so drift on a shared machine hits both. Reported: client CPU-s per
GB of the save call alone, wall seconds, server CPU-s per GB (it verifies the
crc of every byte it receives).
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from . import harness as h

CHILD = r"""
import json, resource, sys, time, torch, objckpt
gib, url, mode, i = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
n = int(gib * (1 << 30)) // 4 // 64
g = torch.Generator().manual_seed(0)
state = {f"t{k}": torch.randn(n, generator=g) for k in range(64)}
opts = {"endpoint_url": url, "aws_access_key_id": "k", "aws_secret_access_key": "s", "region_name": "us-east-1",
        "checksums": mode == "on"}
ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
r = objckpt.save(state, f"s3://bench/ck-{mode}-{i}", storage_options=opts)
ru1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
print(json.dumps({"bytes": r.bytes, "cpu_s": cpu, "wall_s": t1 - t0}))
"""


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with h.Server("fast", bucket="bench") as srv:
        for i in range(args.repeat):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                s0 = srv.cpu_s() or 0.0
                r = h.run_json(["-c", CHILD, str(args.gib), srv.url, mode, str(i)], timeout=600)
                r["server_cpu_s"] = (srv.cpu_s() or 0.0) - s0
                rows[mode].append(r)
                h.log(f"{mode} rep {i}: {json.dumps(r)}")
    out = []
    for mode in ("on", "off"):
        rs = rows[mode]
        gb = rs[0]["bytes"] / 1e9
        out.append([f"checksums={mode}", h.fmt(h.median(r["cpu_s"] / gb for r in rs)),
                    h.fmt(h.median(r["wall_s"] for r in rs)), h.fmt(h.median(r["server_cpu_s"] / gb for r in rs))])
    print(h.md_table(["mode", "client CPU-s/GB", "save s", "server CPU-s/GB"], out))
    if args.out:
        h.write_results(args.out, {"meta": {"gib": args.gib, "repeat": args.repeat, "environment": h.environment()},
                                   "rows": rows})


if __name__ == "__main__":
    main()
