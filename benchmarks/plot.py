"""Bar chart of save/load seconds per method from a results JSON.

    python -m benchmarks.plot benchmarks/results/NAME.json docs/bench_save_load.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional


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
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="benchmarks/results/NAME.json")
    ap.add_argument("out", help="PNG path, e.g. docs/bench_save_load.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    print(plot(results, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
