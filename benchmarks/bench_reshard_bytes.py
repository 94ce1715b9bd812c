"""Read amplification of resharded loads: per rank, bytes fetched / bytes of its share.

    python -m benchmarks.bench_reshard_bytes                 # small and large states, local files
    python -m benchmarks.bench_reshard_bytes --only small --pairs 2:3

A state is saved at world N by N gloo ranks (FSDP2's layout: every tensor a ``Shard(0)``
DTensor on a 1-D mesh), then each rank's share at world M is loaded in this process
through a counting store (:mod:`testkit.reshard`). Reported per (N, M): the
worst and the mean rank's ratio of tensor bytes fetched (ranged GETs: crc-block widening
and merged gaps included) to the bytes of its share, and the manifest + rank index bytes
apart. Only bytes are measured, no time: the numbers are the same on any machine.

States: ``small`` is a tiny Llama with AdamW moments (dim 128, 2 layers: 0.5 KB norms,
64-256 KB matrices, 6.3 MB in all); ``large`` has tens-of-MB tensors (dim 1024: 4-32 MB
matrices, 121 MB in all).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from testkit import reshard

STATES = {
    "small": reshard.tiny_llama(),
    "large": reshard.tiny_llama(dim=1024, layers=1, vocab=8192, hidden=2816, moments=False),
}
PAIRS = ((1, 3), (2, 3), (3, 2), (2, 4), (4, 3))


def _save(rank: int, world: int, uri: str, state: str, kw: dict[str, Any]) -> int:
    return reshard.save_rank(rank, world, uri, STATES[state], **kw)


def run(state: str, pairs: Any, root: str, save_kw: dict[str, Any]) -> list[dict[str, Any]]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from mp import run_multiprocess  # the test suite's gloo launcher (forkserver ranks)

    rows = []
    saved: dict[int, str] = {}
    for n, m in pairs:
        if n not in saved:
            saved[n] = os.path.join(root, f"{state}-w{n}")
            if n == 1:
                import objckpt

                objckpt.save({k: reshard.full_tensor(k, s) for k, s in STATES[state].items()}, saved[n], **save_kw)
            else:
                run_multiprocess(n, _save, saved[n], state, save_kw, timeout=600)
        ranks = reshard.measure(saved[n], STATES[state], m)
        ratios = [r.ratio for r in ranks if r.needed]
        rows.append({"state": state, "save_world": n, "load_world": m,
                     "share_bytes": [r.needed for r in ranks], "fetched_bytes": [r.fetched for r in ranks],
                     "metadata_bytes": [r.metadata for r in ranks], "requests": [r.requests for r in ranks],
                     "max_ratio": round(max(ratios), 3), "mean_ratio": round(sum(ratios) / len(ratios), 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| state | N → M | share per rank MB | fetched / share: worst rank | mean | manifest + index KB (max) |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        share = max(r["share_bytes"]) / 1e6
        out.append(f"| {r['state']} | {r['save_world']} → {r['load_world']} | {share:.2f} | {r['max_ratio']:.2f}× | "
                   f"{r['mean_ratio']:.2f}× | {max(r['metadata_bytes']) / 1e3:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(STATES), action="append", help="state(s) to run (default: all)")
    ap.add_argument("--pairs", default=",".join(f"{n}:{m}" for n, m in PAIRS), help="save:load worlds, comma-separated")
    ap.add_argument("--crc-block", type=int, default=None, help="pass crc_block= to save (default: objckpt's)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    pairs = [tuple(int(x) for x in p.split(":")) for p in a.pairs.split(",")]
    save_kw = {} if a.crc_block is None else {"crc_block": a.crc_block}
    rows = []
    with tempfile.TemporaryDirectory(prefix="reshard-bytes-") as root:
        for state in a.only or list(STATES):
            rows += run(state, pairs, root, save_kw)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "table_markdown": table(rows)}, f, indent=1)


if __name__ == "__main__":
    main()
