"""The standing fault campaign: one function per trial kind, each running one trial
against real parts (files, the in-memory S3 server over HTTP, moto, real processes)
and returning a :class:`Trial` that says ``ok``, ``detected`` or ``FAILED``.

Why a library module: ``tests/test_reliability.py`` runs a small seeded sample of
every kind on each test run, and ``python -m benchmarks.fault_campaign`` runs
thousands; both must judge outcomes by the same rules, kept here:

* ``ok``: the operation succeeded and every tensor and value is bit-exact;
* ``detected``: an :class:`~objckpt.errors.ObjckptError` was raised (the fault was
  seen and named), and nothing that was committed before got damaged;
* ``FAILED``: silently wrong data, a built-in exception, a hang, a damaged previous
  checkpoint, a half checkpoint, or garbage gc would not remove.

This module holds the shared judging helpers and the kill, race and dead-endpoint
kinds; :mod:`testkit.campaign_io` holds fault and corrupt, and
:mod:`testkit.campaign_hostile` the hostile manifests.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

OK, DETECTED, FAILED = "ok", "detected", "FAILED"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # testkit/ is not installed: children import it from the checkout


@dataclass
class Trial:
    """One trial's verdict: what was tried (``params``), what came of it, and why."""

    kind: str
    params: dict[str, Any]
    outcome: str
    detail: str = ""
    faults: int = 0  # faults injected during the trial
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # kind-specific figures (peak RSS, detect time)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params, "outcome": self.outcome, "detail": self.detail[:2000],
                "faults": self.faults, "seconds": round(self.seconds, 4), **self.extra}


# --------------------------------------------------------------------------- states and judging


def make_state(seed: int, *, big: int = 40_000, n: int = 5) -> dict[str, Any]:
    """A small training-like state whose every byte depends on ``seed``: several tensors
    of mixed dtypes (one large enough for multipart uploads with tiny parts), a tied pair
    and plain values, so any mix-up between versions shows in the bytes."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": torch.randn(17 + 13 * i, 7, generator=g) for i in range(n)}
    big_t = torch.randn(big, generator=g)
    return {
        "model": {**tensors, "big": big_t, "half": torch.randn(300, generator=g).to(torch.bfloat16),
                  "ids": torch.randint(-(2 ** 40), 2 ** 40, (64,), generator=g)},
        "optim": {"step": seed, "lr": 1.0 / (seed + 3), "betas": (0.9, 0.99), "tag": f"v{seed}"},
    }


def same(a: Any, b: Any) -> bool:
    """Bit-exact deep equality (tensors compared as bytes, NaN-safe; tuples stay tuples)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return a.numel() == 0 or torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                             b.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def which_version(value: Any, versions: dict[int, Any]) -> Optional[int]:
    """The seed of the saved version ``value`` is bit-exactly equal to, else None (mixed/wrong)."""
    for seed, v in versions.items():
        if same(v, value):
            return seed
    return None


def judge_error(e: BaseException) -> tuple[str, str]:
    """``detected`` for an ObjckptError, ``FAILED`` for anything else (a built-in leaked)."""
    from objckpt.errors import ObjckptError

    what = f"{type(e).__module__}.{type(e).__name__}: {str(e)[:400]}"
    return (DETECTED if isinstance(e, ObjckptError) else FAILED), what


def timed(kind: str, params: dict[str, Any], fn: Callable[[], Trial]) -> Trial:
    """Run one trial body; an exception escaping the checks themselves is a FAILED trial."""
    t0 = time.perf_counter()
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - a campaign reports, it does not stop
        r = Trial(kind, params, FAILED, f"trial crashed: {type(e).__name__}: {e}")
    r.seconds = time.perf_counter() - t0
    return r


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """Where a trial's checkpoints live: a local directory or an S3 bucket (fast server or moto)."""

    kind: str  # "local" | "s3"
    root: str  # directory, or bucket
    storage_options: dict[str, Any] = field(default_factory=dict)

    def uri(self, name: str) -> str:
        return os.path.join(self.root, name) if self.kind == "local" else f"s3://{self.root}/{name}"


def s3_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1", **extra}


def make_bucket(endpoint: str, name: str) -> str:
    import boto3

    boto3.client("s3", **s3_options(endpoint)).create_bucket(Bucket=name)
    return name


def child_env() -> dict[str, str]:
    """The environment of a trial's subprocess: this objckpt first on the path, test credentials."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return env


def run_child(command: str, args: dict[str, Any], timeout: float) -> tuple[Optional[int], str]:
    """``python -m testkit.campaign_child <command> <json>``: (exit code or None on timeout, output)."""
    try:
        p = subprocess.run([sys.executable, "-m", "testkit.campaign_child", command, json.dumps(args)],
                           env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out
    return p.returncode, p.stdout


def last_json(out: str) -> Optional[dict[str, Any]]:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


# --------------------------------------------------------------------------- kill


def _after_uncommitted(uri: str, opts: dict[str, Any], why: str) -> tuple[str, str, dict[str, Any]]:
    """No manifest: gc (grace 0) must leave nothing under the prefix, no upload either."""
    from objckpt.runtime import loop as _runtime
    from objckpt.ops.gc import collect_garbage
    from objckpt.storage import open_store

    st, prefix = open_store(uri, opts)
    before = len(_runtime.run(st.list(prefix + "/")))
    report = _runtime.run(collect_garbage(st, prefix, grace=0))
    left = [o.key for o in _runtime.run(st.list(prefix + "/"))]
    uploads = _runtime.run(st.list_uploads(prefix + "/"))
    figures = {"version": None, "orphans": before, "gc_deleted": len(report.deleted),
               "gc_aborted": len(report.aborted_uploads)}
    if left or uploads:
        return FAILED, f"gc left {left[:5]} and {len(uploads)} upload(s) of an uncommitted save", figures
    return OK, "nothing committed, nothing left after gc", figures


def _after_crash(uri: str, opts: dict[str, Any], versions: dict[int, Any],
                 fresh: bool = False) -> tuple[str, str, dict[str, Any]]:
    """What must hold after a crashed save: the prefix reads as exactly one saved version
    (or, for a ``fresh`` first save, as no checkpoint at all), gc (grace 0) removes every
    orphan (objects and uploads) and nothing the manifest names."""
    import objckpt
    from objckpt.runtime import loop as _runtime
    from objckpt.ops.gc import collect_garbage
    from objckpt.storage import open_store

    from objckpt.errors import NotFoundError

    try:
        back = objckpt.read(uri, storage_options=opts)
    except NotFoundError as e:
        if fresh:  # a first save that died before its commit: nothing visible, gc leaves nothing
            return _after_uncommitted(uri, opts, str(e))
        return FAILED, f"the previous checkpoint is gone: {judge_error(e)[1]}", {}
    except Exception as e:  # noqa: BLE001
        return FAILED, f"the previous checkpoint no longer reads: {judge_error(e)[1]}", {}
    seen = which_version(back, versions)
    if seen is None:
        return FAILED, "the prefix reads as neither the old nor the new checkpoint (half or mixed)", {}
    st, prefix = open_store(uri, opts)
    m = objckpt.inspect(uri, storage_options=opts)
    named = {f"{prefix}/{b.name}" for b in m.blobs} | {f"{prefix}/{r.name}" for r in m.rank_indexes}
    before = {o.key for o in _runtime.run(st.list(prefix + "/"))}
    report = _runtime.run(collect_garbage(st, prefix, grace=0))
    after = {o.key for o in _runtime.run(st.list(prefix + "/"))}
    uploads = _runtime.run(st.list_uploads(prefix + "/"))
    expected = named | {f"{prefix}/manifest.json"}
    figures = {"version": seen, "orphans": len(before - expected), "gc_deleted": len(report.deleted),
               "gc_aborted": len(report.aborted_uploads)}
    if not named <= after:
        return FAILED, f"gc deleted committed objects: {sorted(named - after)[:5]}", figures
    if after != expected:
        return FAILED, f"gc left orphans: {sorted(after - expected)[:5]}", figures
    if uploads:
        return FAILED, f"gc left {len(uploads)} unfinished multipart upload(s)", figures
    again = objckpt.read(uri, storage_options=opts)
    if not same(versions[seen], again):
        return FAILED, "after gc the checkpoint no longer reads bit-exact", figures
    return OK, f"version {seen} intact", figures


def kill_trial(target: Target, seed: int, *, max_ops: int = 12, timeout: float = 120.0,
               fresh: bool = False) -> Trial:
    """Save version ``seed`` (committed), then in a subprocess overwrite it with version
    ``seed + 1`` and SIGKILL that process just before its N-th storage request (N random
    in 1..max_ops; beyond the save's request count the save completes).  Then judge with
    :func:`_after_crash`.  ``fresh``: no earlier version, the killed save is the first."""
    rng = random.Random(seed)
    kill_at = rng.randint(1, min(max_ops, 10) if fresh else max_ops)  # a first save makes fewer requests
    params = {"target": target.kind, "seed": seed, "kill_at_request": kill_at, "fresh": fresh}

    def body() -> Trial:
        import objckpt

        uri = target.uri(f"kill-{seed}-{os.getpid()}-{time.time_ns()}")
        old, new = make_state(seed), make_state(seed + 1)
        if not fresh:
            objckpt.save(old, uri, storage_options=target.storage_options, part_size=64 << 10, blob_size=96 << 10)
        code, out = run_child("save", {"uri": uri, "opts": target.storage_options, "seed": seed + 1,
                                       "kill_at": kill_at, "overwrite": not fresh}, timeout)
        killed = code == -signal.SIGKILL
        if code is None:
            return Trial("kill", params, FAILED, f"the saving subprocess hung ({timeout:.0f} s): {out[-500:]}")
        if not killed and code != 0:
            return Trial("kill", params, FAILED, f"the save failed by itself (exit {code}): {out[-800:]}")
        versions = {seed + 1: new} if fresh else {seed: old, seed + 1: new}
        outcome, detail, figures = _after_crash(uri, target.storage_options, versions, fresh)
        return Trial("kill", params, outcome, f"{'killed' if killed else 'completed'}; {detail}",
                     faults=int(killed), extra=figures)

    return timed("kill", params, body)


# --------------------------------------------------------------------------- race


def race_trial(target: Target, seed: int, *, writers: int = 3, overwrite: bool = True, reads: int = 6,
               timeout: float = 180.0) -> Trial:
    """``writers`` subprocesses save different versions to one prefix at once while this
    process reads it repeatedly.  overwrite=False: exactly one writer wins, the others get
    CheckpointExistsError/PreconditionFailed, the prefix is the winner's version.
    overwrite=True: every read and the final state is exactly one version (a committed
    version 0 exists from the start, so a read never legitimately fails)."""
    params = {"target": target.kind, "seed": seed, "writers": writers, "overwrite": overwrite}

    def body() -> Trial:
        import objckpt

        uri = target.uri(f"race-{seed}-{os.getpid()}-{time.time_ns()}")
        seeds = [seed * 100 + i for i in range(writers + 1)]
        versions = {s: make_state(s) for s in seeds}
        if overwrite:
            objckpt.save(versions[seeds[0]], uri, storage_options=target.storage_options)
        env = child_env()
        procs = [subprocess.Popen(
            [sys.executable, "-m", "testkit.campaign_child", "save",
             json.dumps({"uri": uri, "opts": target.storage_options, "seed": s, "overwrite": overwrite, "repeat": 2 if overwrite else 1})],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for s in seeds[1:]]
        bad_reads: list[str] = []
        done_reads = 0
        deadline = time.monotonic() + timeout
        while overwrite and done_reads < reads and time.monotonic() < deadline:
            try:
                got = objckpt.read(uri, storage_options=target.storage_options)
                if which_version(got, versions) is None:
                    bad_reads.append("a read returned a mix of versions")
            except Exception as e:  # noqa: BLE001
                bad_reads.append(f"a read of a healthy checkpoint failed: {judge_error(e)[1]}")
            done_reads += 1
        results = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                return Trial("race", params, FAILED, "a writer hung")
            results.append((p.returncode, last_json(out) or {"error": out[-600:]}))
        errors = [r.get("error", "") for _, r in results if r.get("error")]
        if overwrite:
            if any(errors):
                return Trial("race", params, FAILED, f"an overwrite failed: {errors[0]}")
        else:
            wins = [r for _, r in results if r.get("saved")]
            losers = [r for _, r in results if not r.get("saved")]
            if len(wins) != 1 or not all(r.get("exists") for r in losers):
                return Trial("race", params, FAILED, f"{len(wins)} winner(s); losers: {[r.get('error') for r in losers]}")
        final = objckpt.read(uri, storage_options=target.storage_options)
        seen = which_version(final, versions)
        if seen is None:
            return Trial("race", params, FAILED, "the final checkpoint is no single version")
        if not overwrite and seen != wins[0]["seed"]:
            return Trial("race", params, FAILED, f"the prefix holds version {seen}, the winner saved {wins[0]['seed']}")
        if bad_reads:
            return Trial("race", params, FAILED, f"{len(bad_reads)}/{done_reads} reads bad: {bad_reads[0]}")
        return Trial("race", params, OK, f"final version {seen}; {done_reads} reads each one whole version",
                     extra={"reads": done_reads})

    return timed("race", params, body)


# --------------------------------------------------------------------------- dead endpoints


class SilentEndpoint:
    """A TCP port that accepts connections (the kernel completes the handshake) and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._accept, daemon=True)
        self._t.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


def refused_url() -> str:
    """A loopback URL nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def dead_endpoint_trial(mode: str, *, limit: float = 60.0, storage_options: Optional[dict[str, Any]] = None) -> Trial:
    """Time for ``objckpt.read`` (default settings unless ``storage_options``) to fail against
    a refused or a silent endpoint, in a subprocess killed after ``limit`` seconds.
    ``detected`` within the limit with an ObjckptError; FAILED on a hang or a built-in error.
    ``extra``: ``detect_s`` (the read's seconds) and, for the silent endpoint, ``connections``
    (how many it accepted: the attempts the read made)."""
    params = {"mode": mode, "limit_s": limit}

    def body() -> Trial:
        silent = SilentEndpoint() if mode == "silent" else None
        url = silent.url if silent else refused_url()
        try:
            t0 = time.perf_counter()
            code, out = run_child("read", {"uri": "s3://bucket/ckpt", "opts": s3_options(url, **(storage_options or {}))},
                                  limit)
            took = time.perf_counter() - t0
        finally:
            if silent:
                silent.close()
        conns = {"connections": len(silent.conns)} if silent else {}
        if code is None:
            return Trial("dead", params, FAILED, f"no answer within {limit:.0f} s", extra={"detect_s": None, **conns})
        r = last_json(out) or {}
        ok = r.get("objckpt_error", False)
        return Trial("dead", params, DETECTED if ok else FAILED, r.get("error", out[-500:]),
                     extra={"detect_s": round(r.get("seconds", took), 2), **conns})

    return timed("dead", params, body)
