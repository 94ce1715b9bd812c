"""Hostile manifests for the campaign (see :mod:`testkit.campaign`).

Each case edits a valid manifest (format v1, or v2 for the layout cases) the way a
malicious or broken writer could, and runs read / inspect / verify / load on it in a
subprocess under a memory cap (``RLIMIT_AS``) and a CPU-time cap (``RLIMIT_CPU``): the
work it may do, the same on a busy machine as on an idle one.  Expected: every op
raises an ObjckptError (or, for a harmless edit, succeeds), within bounded work and
memory; a built-in exception, MemoryError, a kill (the CPU cap included) is FAILED.  A
wall-clock limit remains only as a guard against a hang that uses no CPU (a wait that
never ends): generous, so a loaded machine never trips it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Callable, Optional

from objckpt.format.manifest import reseal
from .campaign import DETECTED, FAILED, Trial, last_json, run_child, timed

#: CPU seconds a hostile trial's subprocess may use in all: imports (~3 s) and four ops that
#: each refuse the manifest after reading it once; a loop over a hostile count runs out of it
HOSTILE_CPU_S = 60
#: wall seconds before a trial's subprocess counts as hung (a wait that uses no CPU)
HOSTILE_HANG_S = 240.0

Edit = Callable[[dict[str, Any]], Any]  # edits the manifest dict in place, or returns raw bytes


def _first_tensor(m: dict[str, Any]) -> dict[str, Any]:
    return next(iter(m["tensors"].values()))


def _set_tree(m: dict[str, Any], value: Any) -> None:
    m["tree"]["hostile"] = value


def _deep(m: dict[str, Any], depth: int = 10_000) -> bytes:
    text = json.dumps(m)
    nested = '{"a": ' * depth + "1" + "}" * depth
    return text.replace('"tree": {', f'"tree": {{"deep": {nested}, ', 1).encode()


def _bomb(m: dict[str, Any], size: int = 4 << 30) -> bytes:
    """A zstd manifest of ~100 KiB that decompresses to ``size`` bytes (valid JSON padded with spaces)."""
    import zstandard

    head = json.dumps(m)[:-1].encode()
    c = zstandard.ZstdCompressor(level=1).compressobj()
    out = [c.compress(head + b" ")]
    block = b" " * (64 << 20)
    for _ in range(size // len(block)):
        out.append(c.compress(block))
    out.append(c.compress(b"}"))
    out.append(c.flush())
    return b"".join(out)


def _dup_chunks(m: dict[str, Any]) -> None:
    t = _first_tensor(m)
    t["chunks"] = t["chunks"] + t["chunks"]


def _chunk(m: dict[str, Any], **kv: Any) -> None:
    _first_tensor(m)["chunks"][0].update(kv)


def _blob_name(m: dict[str, Any], name: str) -> None:
    """Name the first blob ``name``: in v4's list, or in a v5 table's name column (every
    blob's name then listed, as a writer with other names lists them)."""
    blobs = m["blobs"]
    if isinstance(blobs, list):
        blobs[0]["name"] = name
        return
    from objckpt.format import tables

    table = tables.decode_blobs(blobs, m.get("attempt", ""), m.get("spread_up", 0), ValueError, lambda e, w: None)
    blobs["name"] = [name] + [b.name for b in table][1:]


def _huge_shape(m: dict[str, Any]) -> None:
    t = _first_tensor(m)
    t["shape"] = [1 << 40]
    t["chunks"][0].update(offsets=[0], shape=[1 << 40])


def _split(m: dict[str, Any]) -> None:
    for t in m["tensors"].values():
        t["layout"]["split"] = 10 ** 12


CASES: dict[str, tuple[str, Edit]] = {
    # name: (base format, edit)
    "tensor_missing_key": ("v1", lambda m: _set_tree(m, {"$tensor": "no.such.key"})),
    "duplicate_chunks": ("v1", _dup_chunks),
    "offset_near_2_64": ("v1", lambda m: _chunk(m, offset=(1 << 64) - 16)),
    "blob_name_dotdot": ("v1", lambda m: _blob_name(m, "blobs/../../../../../../etc/passwd")),
    "blob_name_nul": ("v1", lambda m: _blob_name(m, "blobs/a\u0000b.bin")),
    "shape_2_40": ("v1", _huge_shape),
    "tuple_5": ("v1", lambda m: _set_tree(m, {"$tuple": 5})),
    "size_x": ("v1", lambda m: _set_tree(m, {"$size": ["x"]})),
    "float_zzz": ("v1", lambda m: _set_tree(m, {"$float": "zzz"})),
    "dict_list": ("v1", lambda m: _set_tree(m, {"$dict": [[1]]})),
    "device_warp": ("v1", lambda m: _set_tree(m, {"$device": "warp"})),
    "bytes_bang": ("v1", lambda m: _set_tree(m, {"$bytes": "!!!"})),
    "nesting_10000": ("v1", _deep),
    "v2_split_1e12": ("v2", _split),
    "zstd_bomb_4gib": ("v1", _bomb),
}


def write_case(base: str, name: str, dest: str) -> None:
    """Copy the checkpoint at ``base`` to ``dest`` and apply case ``name`` to its manifest."""
    shutil.copytree(base, dest)
    path = os.path.join(dest, "manifest.json")
    with open(path, "rb") as f:
        m = json.loads(f.read())
    edited = CASES[name][1](m)
    # resealed (format v3 checksum), so the reader's structural checks are what must catch the
    # edit; the byte-level cases (deep nesting, a zstd bomb) stay unsealed
    data = edited if isinstance(edited, bytes) else reseal(json.dumps(m).encode())
    with open(path, "wb") as f:
        f.write(data)


def hostile_trial(name: str, bases: dict[str, str], *, memory_cap: int = 3 << 30, cpu_limit: int = HOSTILE_CPU_S,
                  timeout: float = HOSTILE_HANG_S, ops: Optional[list[str]] = None) -> Trial:
    """Case ``name`` on a copy of ``bases[v1|v2]`` through read/inspect/verify/load in a
    subprocess (``RLIMIT_AS`` = ``memory_cap``, ``RLIMIT_CPU`` = ``cpu_limit`` seconds; ``timeout``
    wall seconds: a hang guard only): peak RSS, the worst op's CPU seconds (``max_op_cpu_s``)
    and wall seconds in ``extra``.  ``detected`` needs every op to raise an ObjckptError or
    succeed, and ``read`` to refuse."""
    params: dict[str, Any] = {"case": name, "memory_cap": memory_cap, "cpu_limit": cpu_limit}

    def body() -> Trial:
        tmp = tempfile.mkdtemp(prefix="objckpt-hostile-")
        try:
            ck = os.path.join(tmp, "ck")
            write_case(bases[CASES[name][0]], name, ck)
            t0 = time.perf_counter()
            code, out = run_child("hostile", {"uri": ck, "memory_cap": memory_cap, "cpu_limit": cpu_limit,
                                              **({"ops": ops} if ops else {})}, timeout)
            took = time.perf_counter() - t0
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if code is None:
            return Trial("hostile", params, FAILED, f"hung: no result within {timeout:.0f} s (wall clock)",
                         extra={"max_op_s": took, "peak_rss": None})
        if code in (-signal.SIGXCPU, -signal.SIGKILL) and last_json(out) is None:
            return Trial("hostile", params, FAILED, f"used more than its {cpu_limit} CPU seconds (exit {code}): "
                         "work that grows with a number in the manifest", extra={"max_op_s": took, "peak_rss": None})
        r = last_json(out)
        if r is None:
            return Trial("hostile", params, FAILED, f"the process died (exit {code}): {out[-600:]}",
                         extra={"max_op_s": took, "peak_rss": None})
        bad = {op: v["error"] for op, v in r["ops"].items() if not v.get("ok") and not v.get("objckpt_error")}
        seen = {op: v.get("error", "ok") for op, v in r["ops"].items()}
        extra = {"peak_rss": r.get("peak_rss"), "max_op_s": max(v["seconds"] for v in r["ops"].values()),
                 "max_op_cpu_s": max(v["cpu_s"] for v in r["ops"].values()), "ops": seen}
        if bad:
            return Trial("hostile", params, FAILED, "; ".join(f"{k}: {v}" for k, v in bad.items()), extra=extra)
        if r["ops"].get("read", {}).get("ok"):  # every case is invalid: reading it whole must refuse
            return Trial("hostile", params, FAILED, "read accepted a hostile manifest", extra=extra)
        return Trial("hostile", params, DETECTED, "; ".join(f"{k}: {v}" for k, v in seen.items())[:1500],
                     extra=extra)

    return timed("hostile", params, body)
