"""One command for a GPU host: the CUDA tests, the async-save stall from GPU tensors, the
restore to GPU against its ceiling and its peers, and multi-rank scaling on the host's cores.

    python3 benchmarks/device_check.py --out OUT --budget-s 470     # the GPU host: under 8 minutes
    python3 benchmarks/device_check.py --dry --out /tmp/devcheck    # its CPU mirror, run by the tests

Steps, in order, each under its own slice of ``--budget-s`` (a step that ends early leaves its
time to the later ones; one that overruns is stopped at its slice's end and keeps what it
measured):

1. **tests**: ``pytest -m cuda`` over the test files that hold CUDA tests (found by reading
   them), and the tests that skip without CUDA but lack the ``cuda`` mark (there should be none);
2. **stall**: ``async_save`` from a ``--gib`` bf16/fp32 state on the device against a copy of the
   same bytes into pre-allocated pinned host buffers, measured in the same process; DCP's two
   stagers beside it (:mod:`benchmarks.device_probes`);
3. **restore**: the in-memory S3 server in its own process pinned to cores of its own, the rest
   for the clients; objckpt, TensorStore and DCP each save the ``--gib`` fp32 state and load it
   into fresh device tensors in a new process (cold, then warm), verified, against
   min(the server's raw ranged-GET rate, the pinned host-to-device rate) measured in that process;
4. **multirank**: :func:`benchmarks.bench_multirank.rank_main` on gloo CPU ranks (``--worlds``)
   against the same pinned server;
5. **tier**: ``bench_tier`` with the state on the device (the tiered save's stall against a
   pinned D2H copy, the local tier's restore against a pinned H2D copy), ``bench_crc32c`` on
   the host (crc32c rates, a verified read of node memory), then
   ``bench_tier_peers`` on the host's cores (replication; a lost node's share restored from
   its peer against gloo from memory and from a file), ``--tier-mib``.

Results: ``OUT/<step>.json`` as each step ends, ``OUT/device_check.json`` (every section) and
``OUT/device_check.md`` (the tables), both rewritten after every step. Progress lines carry
the time. SIGTERM or SIGINT stop the run with what was measured written.

Dependencies: when objckpt's dependencies do not import and the repository has a ``.whl/``
folder of wheels, they are installed (pip, no index, no dependencies) into a temporary folder
put first on the path of this process and its children. Installed with pip, nothing is done.
"""
from __future__ import annotations

import argparse
import ast
import datetime as dt
import glob
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

from benchmarks import device_report  # noqa: E402 - stdlib only at import, like harness
from benchmarks import harness as h  # noqa: E402

#: top-level modules objckpt, its peers and the test fixtures import; a missing one triggers the wheel install
NEEDED = ("boto3", "botocore", "aiobotocore", "s3transfer", "s3fs", "crc32c", "crc32c_rs", "zstandard", "moto")
#: the in-memory server as a script: it skips importing torch (a second faster start)
h.TARGETS.setdefault("fast-script", [os.path.join("testkit", "s3server.py"), "--port", "0"])
BUCKET = "devcheck"
#: nominal seconds per step at the default budget (scaled to the budget given)
WEIGHTS = {"tests": 150.0, "stall": 90.0, "restore": 120.0, "multirank": 90.0, "tier": 80.0}
OUT_OF_TIME = "not run: out of time"


def _portable(value: Any) -> Any:
    """A setting as the results record it: paths inside the repository relative to it, other
    absolute paths by their last part only (results are committed; no machine's paths in them)."""
    if isinstance(value, str) and os.path.isabs(value):
        rel = os.path.relpath(value, REPO_ROOT)
        return rel if not rel.startswith("..") else os.path.join("<abs>", os.path.basename(value))
    return value


class StepTimeout(Exception):
    """Raised in the main thread when a step outlives its slice (SIGALRM)."""


class Stopped(BaseException):
    """SIGTERM/SIGINT: stop, write what was measured."""


# --------------------------------------------------------------------------- dependencies


def versions(dists: tuple[str, ...]) -> dict[str, Optional[str]]:
    """Installed versions, read from metadata (importing tensorstore or s3fs here costs seconds)."""
    from importlib import metadata

    out: dict[str, Optional[str]] = {}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def missing_modules() -> list[str]:
    return [m for m in NEEDED if importlib.util.find_spec(m) is None]


def ensure_deps(wheels: str, site: str) -> dict[str, Any]:
    """Install ``wheels/*.whl`` into ``site`` when a needed module does not import (a GPU host
    with torch but without objckpt's other dependencies, and no network)."""
    rec: dict[str, Any] = {"missing": missing_modules()}
    if not rec["missing"]:
        return rec
    files = sorted(glob.glob(os.path.join(wheels, "*.whl")))
    if not files:
        rec["error"] = f"{', '.join(rec['missing'])} do not import and {wheels} holds no wheels"
        return rec
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", site, *files]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rec.update(wheels=len(files), target=site, pip_exit=p.returncode, pip_tail=(p.stdout + p.stderr)[-1500:])
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, REPO_ROOT] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    importlib.invalidate_caches()
    rec["missing_after"] = missing_modules()
    rec["imports"] = {}
    for mod in ("boto3", "aiobotocore", "s3fs", "crc32c", "crc32c_rs", "zstandard", "moto.server", "jsonschema"):
        try:  # what the steps and the test fixtures import; a version clash with the host shows here
            importlib.import_module(mod)
            rec["imports"][mod] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded; the steps report their own failures
            rec["imports"][mod] = f"{type(e).__name__}: {e}"
    return rec


# --------------------------------------------------------------------------- processes and cores


def run_child(cmd: list[str], timeout: float, log: Optional[str] = None) -> dict[str, Any]:
    """Run ``python <cmd>`` from the repository root in a session of its own; at ``timeout``, or
    when this process is stopped, kill that whole group (ranks or stagers the child started
    too). Output goes to ours (progress lines), or to ``log``."""
    env = dict(os.environ, **h.CRED_ENV, PYTHONWARNINGS="ignore")
    out = open(log, "w") if log else None
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, *cmd], cwd=REPO_ROOT, env=env, stdout=out,
                         stderr=subprocess.STDOUT if out else None, start_new_session=True)
    status = "killed"
    try:
        rc = p.wait(timeout=max(timeout, 1.0))
        status = "ok" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
        status = f"timeout: killed after {timeout:.0f} s"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if out:
            out.close()
    return {"status": status, "seconds": time.perf_counter() - t}


def kill_children(keep: set[int]) -> None:
    """SIGKILL this process's children except ``keep`` (ranks left behind by an interrupted spawn)."""
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in keep:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me:
                os.kill(int(d), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def split_cpus() -> tuple[list[int], list[int]]:
    """(client cores, server cores): the last quarter (at most 4) for the server, the rest for
    the clients. Below 4 cores the server still gets the last one, the clients keep them all
    (one core for two ranks and this process would only measure the queue)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 4:
        return cpus, cpus[-1:]
    k = max(1, min(4, len(cpus) // 4))
    return cpus[:-k], cpus[-k:]


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (affinity is per thread on Linux)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- the run


@dataclass
class Step:
    name: str
    fn: Callable[["Run", float], dict[str, Any]]
    weight: float


class Run:
    """Budget, results and output of one check."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.out = args, os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.t0 = time.monotonic()
        self.safety = min(5.0, 0.1 * args.budget_s)  # for the last writes and the server's stop
        self.deadline = self.t0 + args.budget_s - self.safety
        self.results: dict[str, Any] = {"config": {k: _portable(v) for k, v in vars(args).items() if k not in ("out",)},
                                        "steps": {}}
        self._server: Optional[h.Server] = None
        self._affinity: Optional[set[int]] = None

    def say(self, msg: str) -> None:
        print(f"[{dt.datetime.now():%H:%M:%S} +{time.monotonic() - self.t0:4.0f}s] {msg}", flush=True)

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)

    def put(self, section: str, data: Any, step_file: bool = True) -> None:
        """Record a section; rewrite the JSON and the tables (atomically: a kill never leaves half a file)."""
        self.results[section] = data
        self.results["elapsed_s"] = time.monotonic() - self.t0
        files = [("device_check.json", json.dumps(self.results, indent=1, default=repr)),
                 ("device_check.md", device_report.markdown(self.results))]
        if step_file:
            files.append((f"{section}.json", json.dumps(data, indent=1, default=repr)))
        for name, text in files:
            with open(self.path(name) + ".tmp", "w") as f:
                f.write(text)
            os.replace(self.path(name) + ".tmp", self.path(name))

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def server(self) -> h.Server:
        """The S3 server, started once for the restore and multi-rank steps, pinned to its own
        cores; this process (so every child started later) moves to the other ones."""
        if self._server is None:
            client, srv_cpus = split_cpus()
            self._server = h.Server("fast-script", BUCKET)
            pin(self._server.pid, srv_cpus)
            self._affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, client)
            self.results["server"] = {"server_cpus": srv_cpus, "client_cpus": client,
                                      "apart": not set(client) & set(srv_cpus)}
            self.say(f"S3 server at {self._server.url}, pid {self._server.pid}, cores {srv_cpus}; clients on {client}")
        return self._server

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._affinity is not None:
            os.sched_setaffinity(0, self._affinity)
            self._affinity = None


def _on_alarm(*_: Any) -> None:
    raise StepTimeout()


def _on_stop(signum: int, *_: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def _cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (spawned ranks are not waited for)."""
    import resource

    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def run_steps(run: Run, steps: list[Step]) -> None:
    """Each step under its slice: ``timeout`` = what is left minus the later steps' slices, but
    never less than its own slice (and never past the deadline); a SIGALRM a little after that
    stops a step that overran its own planning. Results are written after every step."""
    total_w = sum(s.weight for s in steps) or 1.0
    avail = max(run.left(), 0.0)
    slices = {s.name: avail * s.weight / total_w for s in steps}
    t_start, (old_left, old_every) = time.monotonic(), signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's
    old_alarm = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for i, step in enumerate(steps):
            later = sum(slices[s.name] for s in steps[i + 1:])
            timeout = min(run.left(), max(slices[step.name], run.left() - later))
            if timeout < 0.3 * slices[step.name] or timeout < 1.0:
                run.results["steps"][step.name] = {"status": OUT_OF_TIME}
                run.put(step.name, {"status": OUT_OF_TIME})
                run.say(f"{step.name}: {OUT_OF_TIME} ({timeout:.0f} s left for it)")
                continue
            run.say(f"== step {i + 1}/{len(steps)} {step.name}: {timeout:.0f} s")
            t, cpu0 = time.monotonic(), _cpu_s()
            signal.setitimer(signal.ITIMER_REAL, timeout + min(5.0, 0.1 * timeout))
            data: dict[str, Any]
            try:
                data = step.fn(run, timeout)
                status = data.get("status", "ok")
            except StepTimeout:
                data, status = {}, f"timeout: stopped after {time.monotonic() - t:.0f} s"
            except Stopped:
                run.results["steps"][step.name] = {"status": "stopped", "seconds": round(time.monotonic() - t, 1)}
                raise
            except Exception as e:  # noqa: BLE001 - the next step still runs
                data, status = {"traceback": traceback.format_exc(limit=8)}, f"error: {type(e).__name__}: {e}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            partial = run.results.get(step.name)  # what a step put before it was stopped
            if not data and isinstance(partial, dict):
                data = partial
            data["status"] = status
            run.results["steps"][step.name] = {"status": status, "seconds": round(time.monotonic() - t, 1),
                                               "timeout_s": round(timeout, 1), "cpu_s": round(_cpu_s() - cpu0, 1)}
            run.put(step.name, data)
            run.say(f"{step.name}: {status} in {time.monotonic() - t:.0f} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        if old_left:  # a timer someone else had set goes on where it was
            signal.setitimer(signal.ITIMER_REAL, max(old_left - (time.monotonic() - t_start), 0.01), old_every)


# --------------------------------------------------------------------------- step 1: the CUDA tests


def _mark_texts(node: ast.AST, src: str) -> list[str]:
    """The texts of the marks in a decorator list entry or a ``pytestmark`` value."""
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    return [ast.get_source_segment(src, x) or "" for x in items]


def _cuda_flags(texts: list[str]) -> tuple[bool, bool]:
    """(marked ``cuda``, skips without CUDA)."""
    marked = any(re.search(r"\bmark\.cuda\b", t) for t in texts)
    skips = any("skip" in t and "cuda" in t and not re.search(r"\bmark\.cuda\b", t) for t in texts)
    return marked, skips


def _skips_in_body(fn: ast.AST, src: str) -> bool:
    """An ``if <something about cuda>:`` that calls ``pytest.skip``."""
    return any(isinstance(n, ast.If) and "cuda" in (ast.get_source_segment(src, n.test) or "") and any(
        isinstance(c, ast.Call) and (ast.get_source_segment(src, c.func) or "").endswith("skip") for c in ast.walk(n))
        for n in ast.walk(fn))


def scan_cuda_tests(tests_dir: str) -> dict[str, Any]:
    """Read (not import) every ``test_*.py``: the files holding tests marked ``cuda``, and the
    tests that skip without CUDA (a ``skipif`` naming cuda, or ``pytest.skip`` beside a CUDA
    check in the body) yet lack the mark, which ``pytest -m cuda`` would miss."""
    files: list[str] = []
    unmarked: list[str] = []
    root = os.path.dirname(os.path.abspath(tests_dir))  # paths as pytest takes them from the repository root
    for path in sorted(glob.glob(os.path.join(tests_dir, "test_*.py"))):
        with open(path) as f:
            src = f.read()
        tree = ast.parse(src)
        mod = [t for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(x, ast.Name) and x.id == "pytestmark" for x in n.targets) for t in _mark_texts(n.value, src)]
        scopes: list[tuple[list[str], ast.AST]] = [(mod, n) for n in tree.body]
        scopes += [(mod + [t for d in n.decorator_list for t in _mark_texts(d, src)], c) for n in tree.body
                   if isinstance(n, ast.ClassDef) for c in n.body]
        found = False
        for outer, fn in scopes:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.name.startswith("test"):
                continue
            marked, skips = _cuda_flags(outer + [t for d in fn.decorator_list for t in _mark_texts(d, src)])
            skips = skips or _skips_in_body(fn, src)
            found = found or marked
            if skips and not marked:
                unmarked.append(f"{os.path.relpath(path, root)}::{fn.name}")
        if found:
            files.append(os.path.relpath(path, root))
    return {"files": files, "unmarked_gpu_skips": unmarked}


def junit_outcomes(path: str) -> list[dict[str, str]]:
    out = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                last = [x for x in (child.text or "").splitlines() if x.strip()][-1:]  # e.g. "E   ImportError: ..."
                msg = " / ".join([child.get("message") or ""] + (last if child.tag != "skipped" else []))[:400]
        out.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome, "message": msg})
    return out


def step_tests(run: Run, timeout: float) -> dict[str, Any]:
    scan = scan_cuda_tests(os.path.join(REPO_ROOT, "tests"))
    run.say(f"tests: cuda tests in {scan['files']}; unmarked GPU skips: {scan['unmarked_gpu_skips'] or 'none'}")
    xml, log = run.path("cuda_tests.xml"), run.path("cuda_tests.log")
    base = tempfile.mkdtemp(prefix="objckpt-devcheck-pytest-")
    # a file that fails to import (someone's work in progress) must not stop the others' CUDA tests
    cmd = ["-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={xml}", f"--basetemp={base}", *(scan["files"] or ["tests"])]
    r = run_child(cmd, timeout - 2, log)
    tests = junit_outcomes(xml) if os.path.exists(xml) else []
    counts = dict(Counter(t["outcome"] for t in tests))
    with open(log) as f:
        tail = f.read()[-2000:]
    status = r["status"] if r["status"] != "exit 1" else "ok"  # exit 1: some tests failed, listed
    run.say(f"tests: {counts or 'no junit result'}; pytest {r['status']}")
    return {"status": status, "pytest": r["status"], **scan, "counts": counts, "tests": tests, "log_tail": tail}


# --------------------------------------------------------------------------- steps 2 and 3: probes


def probe(run: Run, kind: str, cfg: dict[str, Any], timeout: float, into: dict[str, Any],
          key: Optional[str] = None) -> str:
    """Run one :mod:`benchmarks.device_probes` probe; its record, however far it got, goes to
    ``into[key]`` (``key`` None: into ``into`` itself), even when this run is stopped
    meanwhile. Returns the probe's status."""
    part = run.path(f".{kind}.probe.json")
    if os.path.exists(part):
        os.remove(part)
    cfg = dict(cfg, partial=part, until=time.time() + timeout - 3.0)
    try:
        return run_child(["-m", "benchmarks.device_probes", kind, json.dumps(cfg)], timeout)["status"]
    finally:
        if os.path.exists(part):
            with open(part) as f:
                rec = json.load(f)
            if key is None:
                into.update(rec)
            else:
                into[key] = rec
            os.remove(part)


def step_stall(run: Run, timeout: float) -> dict[str, Any]:
    a, box = run.args, {}  # type: argparse.Namespace, dict[str, Any]
    run.results["stall"] = box  # kept if the run is stopped meanwhile
    status = probe(run, "stall", {"device": a.device, "bytes": int(a.gib * h.GiB), "repeat": a.repeat}, timeout, box)
    return {"status": status, **box}


def step_restore(run: Run, timeout: float) -> dict[str, Any]:
    a, srv, end = run.args, run.server(), time.monotonic() + timeout
    base = {"device": a.device, "bytes": int(a.gib * h.GiB), "seed": 0, "endpoint": srv.url, "bucket": BUCKET,
            "prefix": h.run_id("devcheck")}
    out: dict[str, Any] = {"server": run.results.get("server")}
    run.put("restore", out, step_file=False)
    methods = a.restore_methods.split(",")
    out["save"], out["load"] = {}, {}
    save_status = probe(run, "restore-save", dict(base, methods=methods), 0.45 * timeout, out, "save")
    run.put("restore", out, step_file=False)
    saved = [m for m in methods if isinstance(out["save"].get(m), dict) and out["save"][m].get("status") == "ok"]
    load_cfg = dict(base, saved=saved, reps=a.restore_reps, get_threads=a.get_threads)
    load_status = probe(run, "restore-load", load_cfg, end - time.monotonic() - 2.0, out, "load")
    try:
        h.delete_prefix(h.boto3_client(srv.url), BUCKET, base["prefix"])  # the server's memory, for multirank
    except Exception as e:  # noqa: BLE001
        out["cleanup"] = f"{type(e).__name__}: {e}"
    out["status"] = save_status if save_status != "ok" else load_status
    return out


# --------------------------------------------------------------------------- step 4: multi-rank


def step_multirank(run: Run, timeout: float) -> dict[str, Any]:
    from benchmarks import bench_multirank as mr
    from benchmarks.gpt_state import FULL_BYTES

    a, srv, end = run.args, run.server(), time.monotonic() + timeout
    methods = a.mr_methods.split(",")
    out: dict[str, Any] = {"server": run.results.get("server"), "methods": methods, "worlds": [], "summary": []}
    last = 0.0
    for world in [int(w) for w in a.worlds.split(",") if w]:
        left = end - time.monotonic() - 2.0
        if left < max(5.0, 1.3 * last):
            out["worlds"].append({"world": world, "status": OUT_OF_TIME})
            run.say(f"multirank: world {world} {OUT_OF_TIME}")
            continue
        cfg = {"endpoint": srv.url, "server_pid": srv.pid, "bucket": BUCKET, "run_id": h.run_id("devcheck-mr"),
               "scale": a.mr_gib * h.GiB / FULL_BYTES, "seed": 0, "repeat": 1, "methods": methods,
               "torch_threads": 1, "pg_timeout": left}
        run.say(f"multirank: world {world}, {a.mr_gib:g} GiB, {left:.0f} s left")
        t = time.monotonic()
        try:
            w = h.spawn_gloo(world, mr.rank_main, cfg, left)
        except Exception as e:  # noqa: BLE001 - a timeout or a failing rank: keep the worlds done
            out["worlds"].append({"world": world, "status": f"{type(e).__name__}: {str(e)[:500]}"})
            break
        except BaseException:  # stopped (SIGTERM, the step's alarm): spawn_gloo leaves its ranks running
            kill_children(keep={srv.pid})
            raise
        last = time.monotonic() - t
        sums = [mr.summarize(world, m, w["runs"], w["state_bytes"]) for m in methods]
        out["summary"] += sums
        out["worlds"].append({"world": world, "status": "ok", "seconds": last, "state_bytes": w["state_bytes"]})
        cores = len(os.sched_getaffinity(0))
        if world > cores:
            out["worlds"][-1]["note"] = f"oversubscribed: {world} ranks on {cores} client cores"
        for s in sums:
            run.say(f"multirank: world {world} {s['method']}: save {s['save']['wall_s']:.3f} s "
                    f"({s['save']['gbps']:.2f} GB/s), load {s['load']['wall_s']:.3f} s ({s['load']['gbps']:.2f} GB/s)")
        run.put("multirank", out, step_file=False)
    out["table_markdown"] = mr.markdown_table(out["summary"]) if out["summary"] else ""
    bad = [w for w in out["worlds"] if w["status"] != "ok"]
    out["status"] = "ok" if not bad else f"{len(bad)} world(s) not measured"
    return out


# --------------------------------------------------------------------------- step 5: tiered checkpoints


def step_tier(run: Run, timeout: float) -> dict[str, Any]:
    """:mod:`benchmarks.bench_tier` with the state on the device (tiered stall against a
    pinned D2H copy, local-tier restore against a pinned H2D copy) and
    :mod:`benchmarks.bench_tier_peers` on the host's cores (replication, a lost node's share
    restored from its peer, against gloo from memory and gloo from a file), and
    :mod:`benchmarks.bench_crc32c` on the host (its crc32c rates, a verified read of node
    memory against a memcpy): issue 25's figures that a 2-core VM cannot give.  Each writes its JSON when it ends; one stopped
    by its share of the slice is recorded as such, the other still runs."""
    a, end = run.args, time.monotonic() + timeout
    out: dict[str, Any] = {}
    run.put("tier", out, step_file=False)
    jobs = [("local", ["-m", "benchmarks.bench_tier", "--mib", str(a.tier_mib), "--repeat", str(a.repeat),
                       "--device", a.device], 0.45),
            # the host's crc32c rates and verified-read ratio (what a restore into the device
            # reads through): the GPU host's crc32c was a bottleneck of local restores
            ("crc32c", ["-m", "benchmarks.bench_crc32c", "--mib", str(min(a.tier_mib, 256)), "--repeat", "2",
                        "--dir", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()], 0.2),
            ("peers", ["-m", "benchmarks.bench_tier_peers", "--mib", str(a.tier_mib // 2 or 1), "--repeat",
                       str(a.repeat), "--dir", "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()],
             1.0)]
    for name, cmd, share in jobs:
        path = run.path(f"tier_{name}.json")
        left = (end - time.monotonic() - 2.0) * share
        if left < 5.0:
            out[name] = {"status": OUT_OF_TIME}
            continue
        run.say(f"tier: {name}, {left:.0f} s")
        r = run_child([*cmd, "--out", path], left, run.path(f"tier_{name}.log"))
        rec: dict[str, Any] = {"status": r["status"], "seconds": round(r["seconds"], 1)}
        if os.path.exists(path):
            with open(path) as f:
                rec["result"] = json.load(f)
        out[name] = rec
        run.put("tier", out, step_file=False)
    bad = [n for n, rec in out.items() if rec.get("status") != "ok"]
    out["status"] = "ok" if not bad else f"not measured: {', '.join(bad)}"
    return out


# --------------------------------------------------------------------------- main


STEPS = {"tests": step_tests, "stall": step_stall, "restore": step_restore, "multirank": step_multirank,
         "tier": step_tier}


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the JSON, the tables and the test log")
    ap.add_argument("--budget-s", type=float, default=None, help="seconds for everything (default 470; dry 150)")
    ap.add_argument("--dry", action="store_true", help="CPU mirror: ~32 MiB, 2 ranks, every code path")
    ap.add_argument("--gib", type=float, default=None, help="state of the stall and restore steps (default 4)")
    ap.add_argument("--device", default=None, help="default cuda when there is one (dry: cpu)")
    ap.add_argument("--repeat", type=int, default=None, help="stall: timed saves after a warm-up (default 3)")
    ap.add_argument("--restore-reps", type=int, default=2, help="loads per method: cold, then warm")
    ap.add_argument("--restore-methods", default="objckpt_s3,tensorstore_ocdbt,dcp_s3fs")
    ap.add_argument("--get-threads", default=None, help="raw GET connections tried (default 1,4,16)")
    ap.add_argument("--worlds", default=None, help="multirank world sizes (default 4,8,12,16; dry 2)")
    ap.add_argument("--mr-gib", type=float, default=None, help="multirank state (default 1; dry 1/32)")
    ap.add_argument("--mr-methods", default="objckpt", help="objckpt and/or dcp")
    ap.add_argument("--tier-mib", type=int, default=None,
                    help="tier step: bench_tier's share in MiB, half of it for bench_tier_peers (default 1024; dry 32)")
    ap.add_argument("--steps", default=",".join(STEPS), help="a subset of " + ",".join(STEPS))
    ap.add_argument("--wheels", default=os.path.join(REPO_ROOT, ".whl"), help="wheels installed when imports fail")
    ap.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "objckpt-device-site"))
    a = ap.parse_args(argv)
    dry = a.dry
    a.budget_s = a.budget_s or (150.0 if dry else 470.0)
    a.gib = a.gib or (1 / 32 if dry else 4.0)
    a.repeat = a.repeat or (1 if dry else 3)
    a.worlds = a.worlds or ("2" if dry else "4,8,12,16")
    a.mr_gib = a.mr_gib or (1 / 32 if dry else 1.0)
    a.tier_mib = a.tier_mib or (32 if dry else 1024)
    a.get_threads = [int(x) for x in (a.get_threads or ("1,2" if dry else "1,4,16")).split(",")]
    return a


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    run = Run(args)
    old = {s: signal.signal(s, _on_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run.say(f"device check{' (dry)' if args.dry else ''}: budget {args.budget_s:.0f} s, out {run.out}")
        deps = ensure_deps(args.wheels, args.site)
        run.say(f"dependencies: missing {deps['missing'] or 'none'}"
                + (f"; installed {deps.get('wheels')} wheels, still missing {deps.get('missing_after')}; "
                   f"imports {deps.get('imports')}" if deps["missing"] else ""))
        import torch

        if args.device is None:
            args.device = "cpu" if args.dry or not torch.cuda.is_available() else "cuda"
        env = h.environment()
        env.update(versions(("boto3", "aiobotocore", "s3fs", "tensorstore", "moto")))
        env.update(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                   cuda=torch.version.cuda, cpus_allowed=len(os.sched_getaffinity(0)))
        run.results["config"].update(device=args.device)
        run.put("setup", {"dependencies": deps, "environment": env}, step_file=False)
        run.say(f"{env['device']}, torch {env['torch']}, {env['cpus_allowed']} cores")
        wanted = [s for s in args.steps.split(",") if s]
        run_steps(run, [Step(n, STEPS[n], WEIGHTS[n]) for n in STEPS if n in wanted])
    except Stopped as e:
        run.results["stopped"] = f"stopped by {e}"
        run.say(f"stopped by {e}: writing what was measured")
    finally:
        run.close()
        for s, handler in old.items():
            signal.signal(s, handler)
        run.put("steps", run.results["steps"], step_file=False)
        run.say(f"done in {time.monotonic() - run.t0:.0f} s: {run.path('device_check.md')}")
        print(device_report.markdown(run.results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
