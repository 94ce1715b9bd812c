"""The large fault campaign: many seeded trials of every kind in testkit.campaign*,
a markdown table per kind and one JSON file of every trial.

    python -m benchmarks.fault_campaign --kills 100 --faults 1000 --corruptions 100 --hostile \\
        --races 50 --dead --out benchmarks/results/campaign.json

    python -m benchmarks.fault_campaign --disk 200 --op-kills 90 --rank-kills 20 \\
        --out benchmarks/results/campaign-disk-ops.json   # local disk faults, kills in cp/rm/prune and 2-rank saves

    python -m benchmarks.fault_campaign --commit-kills 40 \\
        --out benchmarks/results/campaign-commit.json   # a rank killed at each point of the commit window

    python -m benchmarks.fault_campaign --tier-kills 40 \\
        --out benchmarks/results/campaign-tier.json   # tiered saves: one or two ranks killed, then a restart

The S3 targets run in their own processes (``harness.Server``): the in-memory server for
kills and races, a second one for faults (reset before each fault trial), and moto for
every tenth kill.  Outcomes: ok (bit-exact), detected (an ObjckptError, nothing committed
damaged), FAILED (anything else: see docs/reliability.md).  The exit status is 0 even with
FAILED trials: the campaign reports, the test suite gates.
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

from benchmarks import harness
from testkit.campaign import (
    Target, Trial, dead_endpoint_trial, kill_trial, make_bucket, make_state, race_trial, s3_options,
)
from testkit.campaign_disk import disk_trial
from testkit.campaign_hostile import CASES, hostile_trial
from testkit.campaign_io import FAULT_KINDS, corrupt_trial, fault_trial, make_v2_checkpoint

CORRUPT_SPOTS = [("v1", "blob"), ("v1", "manifest"), ("v2", "blob"), ("v2", "index"), ("v2", "manifest")]


def _signature(t: Trial) -> str:
    """A failure's class for grouping: the exception type (or the first words), without paths/numbers."""
    m = re.search(r"([A-Za-z_.]+(?:Error|Exception|Warning))", t.detail)
    text = m.group(1) if m else t.detail[:60]
    return re.sub(r"\d+", "N", text)


_TMP = re.compile(r"/?(?:[\w.-]+/)*objckpt-(?:campaign|hostile|corrupt)-[\w]+")


def sanitize(x: Any) -> Any:
    """Replace this run's temporary directories by ``<tmp>`` (no machine paths in results)."""
    if isinstance(x, str):
        return _TMP.sub("<tmp>", x)
    if isinstance(x, dict):
        return {k: sanitize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [sanitize(v) for v in x]
    return x


def _run(label: str, n: int, make: Callable[[int], Trial], trials: list[Trial]) -> None:
    t0 = time.perf_counter()
    for i in range(n):
        r = make(i)
        trials.append(r)
        if r.outcome == "FAILED":
            harness.log(f"  {label} #{i}: FAILED {r.params} {r.detail[:200]}")
    harness.log(f"{label}: {n} trials in {time.perf_counter() - t0:.1f} s")


def _table(trials: Iterable[Trial], group: Callable[[Trial], str]) -> str:
    rows: dict[str, list[Trial]] = collections.defaultdict(list)
    for t in trials:
        rows[group(t)].append(t)
    out = []
    for g, ts in sorted(rows.items()):
        c = collections.Counter(t.outcome for t in ts)
        fails = collections.Counter(_signature(t) for t in ts if t.outcome == "FAILED")
        out.append([g, len(ts), sum(t.faults for t in ts), c["ok"], c["detected"], c["FAILED"],
                    harness.fmt(harness.median(t.seconds for t in ts)),
                    ", ".join(f"{k} x{v}" for k, v in fails.most_common(4)) or "–"])
    return harness.md_table(["variant", "trials", "faults injected", "ok", "detected", "FAILED", "median s",
                             "FAILED by cause"], out)


def _tier_kills(n: int, seed: int, trials: list[Trial], tables: dict[str, str], servers: list[Any]) -> None:
    """``n`` tier kill trials round-robin over testkit.campaign_tier's cases, against moto."""
    from testkit.campaign_tier import tier_kill_cases, tier_kill_trial

    moto = harness.Server("moto")
    servers.append(moto)
    bucket, opts = make_bucket(moto.url, "campaign-tier"), s3_options(moto.url)
    cases = tier_kill_cases(n, seed)
    start = len(trials)
    _run("tier kill", n, lambda i: tier_kill_trial(f"s3://{bucket}/run-{i}", opts, cases[i]), trials)
    done = trials[start:]
    tables["tier kills by point"] = _table(done, lambda t: f"{t.params['point']}, "
                                                          f"{'async_save' if t.params['asynchronous'] else 'save'}")
    tables["tier kills by ranks killed"] = _table(
        done, lambda t: f"world {t.params['world']}, killed {t.params['victims']}, "
                        f"restart world {t.params['restart_world']}")
    tables["tier kill trials"] = harness.md_table(
        ["#", "point", "call", "world", "killed", "restart", "fired on", "outcome", "why"],
        [[i, t.params["point"], "async_save" if t.params["asynchronous"] else "save", t.params["world"],
          t.params["victims"], t.params["restart_world"],
          (f"rank {t.extra['fired']['rank']}, step {t.extra['fired']['step']}" if t.extra.get("fired") else "–"),
          t.outcome, (t.detail if t.outcome == "FAILED" else t.detail.split(": ", 1)[-1])[:240].replace("|", "/")] for i, t in enumerate(done)])


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=0)
    ap.add_argument("--faults", type=int, default=0)
    ap.add_argument("--corruptions", type=int, default=0)
    ap.add_argument("--hostile", action="store_true")
    ap.add_argument("--races", type=int, default=0)
    ap.add_argument("--dead", action="store_true", help="time to detect a refused and a silent endpoint")
    ap.add_argument("--disk", type=int, default=0, help="local disk faults (full, read-only, file/dir in the way)")
    ap.add_argument("--op-kills", type=int, default=0, help="SIGKILL during cp / rm / prune (local and S3)")
    ap.add_argument("--rank-kills", type=int, default=0, help="SIGKILL of one rank during a 2-rank gloo save")
    ap.add_argument("--commit-kills", type=int, default=0,
                    help="SIGKILL of one rank at each point of rank 0's commit in a 2-rank save (local and S3)")
    ap.add_argument("--tier-kills", type=int, default=0,
                    help="tiered saves (2 and 4 ranks on 2 nodes, moto): one or two ranks SIGKILLed at a point of "
                         "the local commit, spread, replication, drain or retention, then a restart and restore")
    ap.add_argument("--hostile-http", action="store_true",
                    help="objckpt's S3 client against trickling, 1xx, huge-chunk, wrong-range answers")
    ap.add_argument("--dead-limit", type=float, default=120.0, help="seconds before a dead-endpoint trial counts as hung")
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", default=harness.result_path("campaign"))
    a = ap.parse_args(argv)
    os.environ.update(harness.CRED_ENV)
    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)
    trials: list[Trial] = []
    tables: dict[str, str] = {}
    work = tempfile.mkdtemp(prefix="objckpt-campaign-")
    servers: list[harness.Server] = []
    bases: dict[str, Any] = {}
    states: dict[str, Any] = {}
    if a.corruptions or a.hostile:  # first: gloo ranks spawned after the servers and trials sometimes abort
        import objckpt

        bases = {"v1": os.path.join(work, "base-v1"), "v2": os.path.join(work, "base-v2")}
        states["v1"] = make_state(7)
        objckpt.save(states["v1"], bases["v1"], crc_block=4096)
        states["v2"] = make_v2_checkpoint(bases["v2"])
    try:
        if a.disk:
            start = len(trials)
            _run("disk", a.disk, lambda i: disk_trial(a.seed + i), trials)
            tables["disk"] = _table(trials[start:], lambda t: f"{t.params['fault']} / {t.params['filesystem']}")
        if a.kills or a.races or a.op_kills or a.rank_kills or a.commit_kills:
            fast = harness.Server("fast")
            servers.append(fast)
            moto = harness.Server("moto") if a.kills >= 10 else None
            if moto:
                servers.append(moto)
            targets = [Target("local", work), Target("s3", make_bucket(fast.url, "campaign-kill"), s3_options(fast.url))]
            moto_t = Target("s3", make_bucket(moto.url, "campaign-kill"), s3_options(moto.url)) if moto else None
            start = len(trials)

            def kill(i: int) -> Trial:
                t = moto_t if moto_t is not None and i % 10 == 9 else targets[i % 2]
                r = kill_trial(t, a.seed + 2 * i, fresh=i % 5 == 3)
                r.params["target"] = ("moto" if t is moto_t else t.kind) + (", first save" if i % 5 == 3 else "")
                return r

            _run("kill", a.kills, kill, trials)
            if a.kills:
                tables["kill"] = _table(trials[start:], lambda t: t.params["target"])
            start = len(trials)
            _run("race", a.races, lambda i: race_trial(targets[i % 2], a.seed + i, overwrite=i % 3 != 0), trials)
            if a.races:
                tables["race"] = _table(trials[start:], lambda t: f"{t.params['target']}, overwrite={t.params['overwrite']}")
            from testkit.campaign_ops import OPS, op_kill_trial, rank_kill_trial

            start = len(trials)
            _run("op kill", a.op_kills, lambda i: op_kill_trial(targets[(i // 3) % 2], a.seed + i, OPS[i % 3]), trials)
            if a.op_kills:
                tables["kill during cp / rm / prune"] = _table(
                    trials[start:], lambda t: f"{t.params['op']}, {t.params['target']}")
            start = len(trials)
            _run("rank kill", a.rank_kills, lambda i: rank_kill_trial(targets[i % 2], a.seed + i), trials)
            if a.rank_kills:
                tables["kill one rank of a 2-rank save"] = _table(
                    trials[start:], lambda t: f"{t.params['target']}, rank {t.params['kill_rank']} killed")
            from testkit.campaign_commit import commit_kill_cases, commit_kill_trial

            start = len(trials)
            cases = commit_kill_cases(a.commit_kills, a.seed)
            _run("commit kill", a.commit_kills,
                 lambda i: commit_kill_trial(targets[(i // 40) % 2], a.seed + i, *cases[i][:2], overwrite=cases[i][2],
                                             asynchronous=cases[i][3]),
                 trials)
            if a.commit_kills:
                tables["kill a rank in the commit window of a 2-rank save"] = _table(
                    trials[start:], lambda t: f"{t.params['point']}, rank {t.params['victim']} killed, "
                                              f"{'overwrite' if t.params['overwrite'] else 'first save'}")
                tables["commit window by target and call"] = _table(
                    trials[start:], lambda t: f"{t.params['target']}, "
                                              f"{'async_save' if t.params['asynchronous'] else 'save'}")
        if a.tier_kills:
            _tier_kills(a.tier_kills, a.seed, trials, tables, servers)
        if a.faults:
            fsrv = harness.Server("fast")
            servers.append(fsrv)
            start = len(trials)
            _run("fault", a.faults, lambda i: fault_trial(fsrv.url, a.seed + i, FAULT_KINDS[i % len(FAULT_KINDS)]), trials)
            tables["fault"] = _table(trials[start:], lambda t: t.params["fault"])
        if a.corruptions or a.hostile:
            start = len(trials)

            def corrupt(i: int) -> Trial:
                fmt_, where = CORRUPT_SPOTS[i % len(CORRUPT_SPOTS)]
                r = corrupt_trial(bases[fmt_], states[fmt_], a.seed + i, where)
                r.params["format"] = fmt_
                return r

            _run("corrupt", a.corruptions, corrupt, trials)
            if a.corruptions:
                tables["corrupt"] = _table(trials[start:], lambda t: f"{t.params['format']} {t.params['where']}")
            if a.hostile:
                hs = []
                _run("hostile", len(CASES), lambda i: hostile_trial(list(CASES)[i], bases, timeout=60), hs)
                trials += hs
                tables["hostile"] = harness.md_table(
                    ["case", "outcome", "peak RSS MiB", "slowest op s", "detail"],
                    [[t.params["case"], t.outcome, harness.fmt((t.extra.get("peak_rss") or 0) / 2 ** 20, "{:.0f}")
                      if t.extra.get("peak_rss") else "–", harness.fmt(t.extra.get("max_op_s")),
                      t.detail[:90].replace("|", "/")] for t in hs])
        if a.dead:
            ds = [dead_endpoint_trial(m, limit=a.dead_limit) for m in ("refused", "silent")]
            trials += ds
            tables["dead endpoint"] = harness.md_table(
                ["mode", "outcome", "time to detect s (default settings)", "detail"],
                [[t.params["mode"], t.outcome, harness.fmt(t.extra.get("detect_s")) if t.extra.get("detect_s")
                  else f"> {a.dead_limit:.0f}", t.detail[:90]] for t in ds])
        if a.hostile_http:
            from benchmarks.hostile_http import MODES, hostile_http_trial

            hh: list[Trial] = []
            _run("hostile_http", len(MODES), lambda i: hostile_http_trial(list(MODES)[i], a.dead_limit), hh)
            trials += hh
            tables["hostile http"] = harness.md_table(
                ["answer", "op", "outcome", "s", "peak RSS MiB", "detail"],
                [[t.params["mode"], t.params["op"], t.outcome, harness.fmt(t.seconds),
                  harness.fmt((t.extra.get("peak_rss") or 0) / 2 ** 20, "{:.0f}"),
                  t.detail[:110].replace("|", "/")] for t in hh])
    finally:
        for s in servers:
            s.stop()
    tables = sanitize(tables)
    for kind, table in tables.items():
        print(f"\n### {kind}\n\n{table}")
    totals = collections.Counter(t.outcome for t in trials)
    print(f"\n{len(trials)} trials: {totals['ok']} ok, {totals['detected']} detected, {totals['FAILED']} FAILED")
    rel = harness.write_results(a.out, {"environment": harness.environment(), "args": vars(a), "tables": tables,
                                        "totals": dict(totals), "trials": sanitize([t.to_json() for t in trials])})
    print(f"results: {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
