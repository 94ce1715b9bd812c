"""Bar charts of a results JSON: save/load seconds per method (``bench_save_load``), or
cold and warm seconds per method (``bench_cold_warm``: told apart by its summary).

    python -m benchmarks.plot benchmarks/results/NAME.json docs/bench_save_load.png
    python -m benchmarks.plot benchmarks/results/cold-warm-all-fresh.json docs/cold_warm.png
    python -m benchmarks.plot benchmarks/results/crc32c-{shm,huge-always,huge-within-size-2}.json \
        docs/verified_read.png --labels "/dev/shm|huge=always|huge=within_size"  # bench_crc32c runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional


def _finish(fig: Any, ax: Any, out_path: str) -> str:
    """Grid, layout, the PNG written (its folder made), the figure closed."""
    import matplotlib.pyplot as plt

    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def plot(results: dict[str, Any], out_path: str, title: Optional[str] = None) -> str:
    """Write a PNG with save and load seconds (medians) side by side per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in results["summary"] if s["save"].get("wall_s") is not None or s["load"].get("wall_s") is not None]
    names = [s["method"] for s in rows]
    save = [s["save"].get("wall_s") or 0.0 for s in rows]
    load = [s["load"].get("wall_s") or 0.0 for s in rows]
    x = range(len(rows))
    w = 0.38
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    b1 = ax.bar([i - w / 2 for i in x], save, w, label="save", color="#4C72B0")
    b2 = ax.bar([i + w / 2 for i in x], load, w, label="load", color="#DD8452")
    for bars in (b1, b2):
        for b in bars:
            h = b.get_height()
            if h > 0:
                ax.annotate(f"{h:.2g}", (b.get_x() + b.get_width() / 2, h), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=25, ha="right")
    ax.set_ylabel("seconds (median, lower is better)")
    cfg = results.get("config", {})
    gib = cfg.get("state_bytes", 0) / (1 << 30)
    ax.set_title(title or f"{cfg.get('tensors', '?')} tensors, {gib:.2f} GiB, target {cfg.get('target', '?')}, "
                          f"median of {cfg.get('repeat', '?')}")
    ax.legend()
    return _finish(fig, ax, out_path)


NAMES = {"objckpt_s3": "objckpt", "tensorstore_ocdbt": "TensorStore OCDBT", "dcp_s3fs": "DCP + s3fs",
         "torchsave_s3tc": "torch.save +\ns3torchconnector"}


def plot_cold_warm(results: dict[str, Any], out_path: str, title: Optional[str] = None) -> str:
    """A PNG of ``bench_cold_warm``'s medians: per method, load cold and warm, save cold and
    warm (seconds, the range of the runs as error bars; client set-up is in none of them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m, s in results["summary"].items() if s.get("load", {}).get("cold")]
    series = [("load", "cold", "#DD8452"), ("load", "warm", "#F2B48C"), ("save", "cold", "#4C72B0"),
              ("save", "warm", "#9DB3D9")]
    w = 0.2
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(methods) + 2), 4.8))
    for j, (op, kind, color) in enumerate(series):
        xs, hs, lo, hi = [], [], [], []
        for i, m in enumerate(methods):
            r = results["summary"][m].get(op, {}).get(kind) or {}
            if r.get("wall_s") is None:
                continue
            xs.append(i + (j - 1.5) * w)
            hs.append(r["wall_s"])
            lo.append(r["wall_s"] - r.get("wall_min", r["wall_s"]))
            hi.append(r.get("wall_max", r["wall_s"]) - r["wall_s"])
        bars = ax.bar(xs, hs, w, yerr=[lo, hi], capsize=2, label=f"{op} {kind}", color=color)
        for b in bars:
            ax.annotate(f"{b.get_height():.2g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(range(len(methods))))
    ax.set_xticklabels([NAMES.get(m, m) for m in methods])
    ax.set_ylabel("seconds (median of the rounds, lower is better)")
    cfg = results.get("config", {})
    gib = cfg.get("state_bytes", 0) / (1 << 30)
    ax.set_title(title or f"Restart, {gib:.2f} GiB: cold (first call of a new process) and warm, fresh "
                          f"destination pages; {cfg.get('rounds', '?')} rounds", fontsize=10)
    ax.legend(fontsize=8)
    return _finish(fig, ax, out_path)


def plot_verified_read(runs: list[dict[str, Any]], out_path: str, title: Optional[str] = None,
                       labels: Optional[list[str]] = None) -> str:
    """A PNG of ``bench_crc32c`` runs (one group per run's folder): reading a tmpfs file with
    no hash, and verified with each crc32c implementation, as a share of a memcpy's rate
    (the better of the piece sizes), with the 0.8x target of a local-tier restore."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def best(r: dict[str, Any]) -> float:
        return max(v for k, v in r.items() if k.startswith("verified_read_"))

    series = [("read, no hash", "#BBBBBB"), ("verified, crc32c package", "#9DB3D9"),
              ("verified, crc32c-rs", "#4C72B0")]
    w = 0.26
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, run in enumerate(runs):
        impl = run["implementations"]
        values = [run["read_only_4096k_over_memcpy"], best(impl["crc32c"]),
                  best(impl["crc32c_rs"]) if "crc32c_rs" in impl else float("nan")]
        for j, ((label, color), v) in enumerate(zip(series, values)):
            b = ax.bar(i + (j - 1) * w, v, w, color=color, label=label if i == 0 else None)
            ax.annotate(f"{v:.2f}x", (b[0].get_x() + w / 2, v), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
    ax.axhline(0.8, color="#C44E52", linestyle="--", linewidth=1, label="0.8x: the restore target")
    ax.set_xticks(list(range(len(runs))))
    ax.set_xticklabels(labels or [r.get("mount") or r.get("dir", "?") for r in runs], fontsize=8)
    ax.set_ylabel("rate / memcpy's rate (higher is better)")
    mib = runs[0].get("mib", "?")
    ax.set_title(title or f"Reading a {mib} MiB tmpfs file on two threads, against a memcpy", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return _finish(fig, ax, out_path)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="benchmarks/results/NAME.json (several: bench_crc32c runs)")
    ap.add_argument("out", help="PNG path, e.g. docs/bench_save_load.png")
    ap.add_argument("--title", default=None)
    ap.add_argument("--labels", default=None, help="bench_crc32c runs: the groups' names, separated by |")
    args = ap.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as f:
            runs.append(json.load(f))
    results = runs[0]
    if "implementations" in results:
        print(plot_verified_read(runs, args.out, args.title, args.labels.split("|") if args.labels else None))
        return 0
    cold_warm = isinstance(results.get("summary"), dict) and "fresh_page_floor" in results
    print((plot_cold_warm if cold_warm else plot)(results, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
