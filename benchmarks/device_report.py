"""The markdown tables of :mod:`benchmarks.device_check`, from its results dictionary.

Rendered after every step from whatever is there, so each section takes partial or missing
data (a step cut at its deadline, a peer that was unavailable) and a rendering error shows
as one line in its section instead of stopping the run.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from . import harness as h


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _f(x: Any, spec: str = "{:.3g}") -> str:
    v = _num(x)
    return h.fmt(v, spec) if v is not None else (str(x) if isinstance(x, str) else "–")


def _gib(n: Any) -> str:
    return f"{n / h.GiB:.2f} GiB" if _num(n) else "? GiB"


def header(r: dict[str, Any]) -> str:
    env = (r.get("setup") or {}).get("environment") or {}
    cfg = r.get("config") or {}
    lines = ["# objckpt GPU check" + (" (dry run, CPU)" if cfg.get("dry") else ""), "",
             f"{env.get('device', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda')}), Python "
             f"{env.get('python', '?')}, {env.get('cpus_allowed', '?')} cores, git {env.get('git', '?')}; "
             f"budget {_f(cfg.get('budget_s'), '{:.0f}')} s, {_f(r.get('elapsed_s'), '{:.0f}')} s used."]
    if r.get("stopped"):
        lines.append(f"**{r['stopped']}**")
    deps = (r.get("setup") or {}).get("dependencies") or {}
    if deps.get("missing"):
        bad = {k: v for k, v in (deps.get("imports") or {}).items() if v != "ok"}
        lines.append(f"Installed from wheels: {deps.get('wheels')} files for {', '.join(deps['missing'])}; "
                     f"still missing: {deps.get('missing_after') or 'none'}; imports failing: {bad or 'none'}."
                     + (f" pip: {deps['error'] if deps.get('error') else deps.get('pip_tail')}"
                        if deps.get("error") or deps.get("pip_exit") else ""))
    steps = r.get("steps") or {}
    if steps:
        lines += ["", h.md_table(["step", "status", "seconds", "slice s", "CPU s"],
                                 [[k, v.get("status"), _f(v.get("seconds")), _f(v.get("timeout_s")), _f(v.get("cpu_s"))]
                                  for k, v in steps.items()])]
    return "\n".join(lines)


def tests_md(t: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted((t.get("counts") or {}).items())) or "no result"
    lines = ["## 1. CUDA tests (`pytest -m cuda`)", "",
             f"Files: {', '.join(t.get('files') or []) or '–'}. Outcome: {counts} (pytest: {t.get('pytest')}).",
             f"Tests that skip without CUDA but lack the `cuda` mark: {', '.join(t.get('unmarked_gpu_skips') or []) or 'none'}."]
    if t.get("tests"):
        lines += ["", h.md_table(["test", "outcome", "message"],
                                 [[x["test"], x["outcome"], x["message"].replace("|", "/").replace("\n", " ")[:160]]
                                  for x in t["tests"]])]
    return "\n".join(lines)


STALL_ROWS = [("pinned_d2h", "pinned D2H copy (reference)"), ("host_copy", "host copy (CPU reference)"),
              ("objckpt_async", "objckpt `async_save`"), ("objckpt_lazy", "objckpt `async_save(lazy=True)`"),
              ("dcp_default_stager", "DCP `async_save` + `DefaultStager(StagingOptions())` (CPU: unpinned)"),
              ("dcp_pinned_cached", "DCP `async_save` + `BlockingAsyncStager(cache_staged_state_dict=True)` "
                                    "(CPU: uncached)")]


def stall_md(s: dict[str, Any]) -> str:
    lines = [f"## 2. Async save stall from {s.get('device', '?')} tensors ({_gib(s.get('bytes'))}, "
             f"{'/'.join(s.get('dtypes') or [])}, {s.get('tensors', '?')} tensors; saves to {s.get('target', '?')})",
             "", f"Median of {s.get('repeat', '?')} after a warm-up. Status: {s.get('status')}."
             + (f" Probe: {s['error']}" if s.get("error") else "")]
    rows = []
    for key, label in STALL_ROWS:
        v = s.get(key)
        if v is None:
            continue
        if isinstance(v, dict):
            rows.append([label, _f(v.get("median_s"), "{:.4f}"), _f(v.get("x_ref"), "{:.2f}x"),
                         _f(v.get("ready_s"), "{:.3f}"), _f(v.get("done_s"), "{:.3f}"),
                         " ".join(f"{x:.4f}" for x in v.get("runs_s") or [])])
        else:
            rows.append([label, str(v)[:160], "", "", "", ""])
    return "\n".join(lines + ["", h.md_table(["method", "stall s", "/ reference", "ready s", "done s", "runs s"], rows)])


def restore_md(r: dict[str, Any]) -> str:
    load, save, srv = r.get("load") or {}, r.get("save") or {}, r.get("server") or {}
    raw: dict[str, Any] = load["raw_get"] if isinstance(load.get("raw_get"), dict) else {}
    copy_key = "h2d_gbps" if "h2d_gbps" in load else "host_copy_gbps"
    ceiling = _num(load.get("ceiling_gbps"))
    lines = [f"## 3. Restore into {load.get('device', '?')} tensors ({_gib(load.get('bytes') or save.get('bytes'))} "
             "fp32) from the in-memory S3 server", "",
             f"Server on cores {srv.get('server_cpus')}, clients on {srv.get('client_cpus')}. Raw ranged GET "
             f"{_f(raw.get('gbps'))} GB/s (by connections: {raw.get('gbps_by_threads') or load.get('raw_get')}); "
             f"{'pinned H2D' if copy_key == 'h2d_gbps' else 'host copy'} {_f(load.get(copy_key))} GB/s; ceiling "
             f"{_f(ceiling)} GB/s. Status: {r.get('status')}." + (f" Load probe: {load['error']}" if load.get("error") else "")]
    rows = []
    for m in list(dict.fromkeys([*save, *load])):
        sv, ld = save.get(m), load.get(m)
        if not any(isinstance(x, dict) and "status" in x for x in (sv, ld)):
            continue  # the reference rates and other fields, not a method
        sv, ld = sv if isinstance(sv, dict) else {}, ld if isinstance(ld, dict) else {}
        reps = ld.get("reps") or []
        cold, warm = (reps[0] if reps else {}), reps[1:]
        warm_gbps = h.median(x["gbps"] for x in warm)
        why = sv.get("error") or ld.get("error") or ld.get("note") or ""
        status = ld.get("status") or ("saved, not loaded" if sv.get("status") == "ok" else sv.get("status"))
        rows.append([m, _f(sv.get("save_s"), "{:.2f}"), _f(ld.get("cold_s"), "{:.3f}"), _f(cold.get("gbps"), "{:.2f}"),
                     h.ratio(_num(cold.get("gbps")), ceiling, "{:.0%}"), _f(ld.get("warm_s"), "{:.3f}"),
                     _f(warm_gbps, "{:.2f}"), h.ratio(warm_gbps, ceiling, "{:.0%}"),
                     ", ".join(x.get("verify", "?") for x in reps) or "–", f"{status} {str(why)[:120]}".strip()])
    head = ["method", "save s", "load cold s", "cold GB/s", "cold / ceiling", "load warm s", "warm GB/s",
            "warm / ceiling", "verify", "status"]
    return "\n".join(lines + ["", h.md_table(head, rows)])


def multirank_md(m: dict[str, Any]) -> str:
    srv = m.get("server") or {}
    sums = m.get("summary") or []
    lines = [f"## 4. Multi-rank save and load, gloo CPU ranks ({', '.join(m.get('methods') or [])})", "",
             f"Server on cores {srv.get('server_cpus')}, ranks on {srv.get('client_cpus')}. Status: {m.get('status')}."]
    firsts: dict[str, dict[str, Any]] = {}
    rows = []
    for s in sums:
        base = firsts.setdefault(s["method"], s)
        sv, ld = s["save"], s["load"]
        rows.append([s["world"], s["method"], _f(sv["wall_s"]), _f(ld["wall_s"]), _f(sv["gbps"], "{:.2f}"),
                     _f(ld["gbps"], "{:.2f}"), h.ratio(sv["gbps"], base["save"]["gbps"]),
                     h.ratio(ld["gbps"], base["load"]["gbps"]), _f(sv["cpu_s_per_gb"]), _f(ld["cpu_s_per_gb"])])
    for w in m.get("worlds") or []:
        if w.get("status") != "ok" or w.get("note"):
            rows.append([w.get("world"), "", w.get("note") or w.get("status"), "", "", "", "", "", "", ""])
    head = ["world", "method", "save s", "load s", "save GB/s", "load GB/s", "save / first world",
            "load / first world", "CPU-s/GB save", "CPU-s/GB load"]
    lines += ["", h.md_table(head, rows)]
    if m.get("table_markdown"):
        lines += ["", "Per world (bench_multirank's columns):", "", m["table_markdown"]]
    return "\n".join(lines)


def tier_md(t: dict[str, Any]) -> str:
    lines = ["## 5. Tiered checkpoints (bench_tier on the device, bench_tier_peers on the host's cores)", "",
             f"Status: {t.get('status')}."]
    local = (t.get("local") or {}).get("result") or {}
    st = local.get("stall") or {}
    if st:
        lines += ["", h.md_table(
            ["share MiB", "device", "tiered async stall s / copy to host s", "S3 async stall s / copy to host s",
             "local restore s", "local restore s / copy back s"],
            [[local.get("share_mib"), local.get("device"), _f(st.get("tiered_async_over_memcpy"), "{:.2f}x"),
              _f(st.get("s3_async_over_memcpy"), "{:.2f}x"), _f(st.get("local_restore_s")),
              _f(st.get("local_restore_over_memcpy"), "{:.2f}x")]])]
    crc = (t.get("crc32c") or {}).get("result") or {}
    if crc.get("implementations"):
        lines += ["", h.md_table(
            ["crc32c on the host", "cached GB/s, 1 / 2 threads", "streaming GB/s, 1 / 2 threads",
             "verified read / memcpy (512 KiB pieces)"],
            [[name, f"{_f(r.get('cached_1t_gbps'), '{:.0f}')} / {_f(r.get('cached_2t_gbps'), '{:.0f}')}",
              f"{_f(r.get('stream_1t_gbps'), '{:.0f}')} / {_f(r.get('stream_2t_gbps'), '{:.0f}')}",
              _f(r.get("verified_read_512k_over_memcpy"), "{:.2f}x")]
             for name, r in crc["implementations"].items()])]
    peers = ((t.get("peers") or {}).get("result") or {}).get("summary") or {}
    p = (peers.get("restore") or {}).get("peer") or {}
    if p:
        lines += ["", h.md_table(
            ["share MiB", "replicate / gloo", "gloo from a file / gloo", "peer restore / gloo",
             "peer restore / gloo from a file"],
            [[peers.get("share_mib"), _f(peers.get("ratio"), "{:.2f}x"), _f(p.get("file_floor_ratio"), "{:.2f}x"),
              _f(p.get("ratio"), "{:.2f}x"), _f(p.get("ratio_to_gloo_file"), "{:.2f}x")]])]
    return "\n".join(lines)


SECTIONS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("tests", tests_md), ("stall", stall_md), ("restore", restore_md), ("multirank", multirank_md),
    ("tier", tier_md)]


def markdown(r: dict[str, Any]) -> str:
    parts = []
    for name, fn in [("header", lambda _: header(r))] + SECTIONS:
        data = r if name == "header" else r.get(name)
        if data is None:
            continue
        try:
            parts.append(fn(data))
        except Exception as e:  # noqa: BLE001 - a table must never stop the run
            parts.append(f"## {name}\n\n(table failed: {type(e).__name__}: {e}; the JSON has the figures)")
    return "\n\n".join(parts) + "\n"
