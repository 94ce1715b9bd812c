"""Bar charts of a results JSON: save/load seconds per method (``bench_save_load``), or
cold and warm seconds per method (``bench_cold_warm``: told apart by its summary).

    python -m benchmarks.plot benchmarks/results/NAME.json docs/bench_save_load.png
    python -m benchmarks.plot benchmarks/results/cold-warm-all-fresh.json docs/cold_warm.png
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


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="benchmarks/results/NAME.json")
    ap.add_argument("out", help="PNG path, e.g. docs/bench_save_load.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    cold_warm = isinstance(results.get("summary"), dict) and "fresh_page_floor" in results
    print((plot_cold_warm if cold_warm else plot)(results, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
