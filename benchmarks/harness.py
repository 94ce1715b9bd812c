"""What every benchmark script needs, in one place, so the scripts say only what they measure.

* **targets**: an S3 server in its own process (objckpt's in-memory test server,
  stock moto or moto serving ranged GETs cheaply), its URL, its request/byte
  counters and its CPU seconds;
* **processes**: one subprocess per operation (its last stdout line is a JSON
  result), and a world of gloo ranks;
* **/proc sampling**: ``VmHWM`` / ``VmRSS``, the peak reset through
  ``clear_refs``, I/O counters, another process's CPU seconds;
* **statistics and output**: medians, number formatting, markdown tables,
  result JSON with the environment (no paths of this machine, no host name).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join("benchmarks", "results")  # relative to REPO_ROOT, where the scripts run
GiB = 1 << 30
MiB = 1 << 20
REGION, ACCESS_KEY, SECRET_KEY = "us-east-1", "testing", "testing"
CRED_ENV = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_id(kind: str) -> str:
    """A prefix no earlier run used (checkpoints of concurrent runs never collide)."""
    return f"{kind}-{_dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"


# --------------------------------------------------------------------------- S3 target


def s3_options(endpoint: Optional[str]) -> dict[str, Any]:
    """objckpt ``storage_options`` for the benchmark target."""
    return {"endpoint_url": endpoint, "region_name": REGION, "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY}


def boto3_client(endpoint: str, max_pool_connections: int = 16) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=max_pool_connections), **s3_options(endpoint))


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix/`` and abort its multipart uploads (untimed clean-up)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
    try:
        for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    except Exception:  # noqa: BLE001 - not every server lists uploads
        pass


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_stats(endpoint: str, reset: bool = False) -> Any:
    """The target's ``/_objckpt/stats`` (requests by operation, bytes in/out), or reset them.

    Returns an error string when the server has none, so a run without counters still runs."""
    try:
        if reset:
            _NO_PROXY.open(urllib.request.Request(f"{endpoint}/_objckpt/reset_stats", data=b"", method="POST"),
                           timeout=30).read()
            return None
        with _NO_PROXY.open(f"{endpoint}/_objckpt/stats", timeout=30) as r:
            return json.loads(r.read())
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


TARGETS = {
    "fast": ["-m", "testkit.s3server", "--port", "0"],
    "moto": ["-m", "benchmarks.moto_server"],
    "moto-ranged": ["-m", "benchmarks.moto_server", "--ranged-reads"],
}


class Server:
    """An S3 server in its own process (client and server CPU apart); its first stdout line is its URL."""

    def __init__(self, kind: str = "fast", bucket: Optional[str] = None) -> None:
        self.kind = kind
        self._log = tempfile.NamedTemporaryFile(prefix=f"bench-{kind}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, *TARGETS[kind]], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                     stderr=self._log, env=dict(os.environ, **CRED_ENV))
        box: list[bytes] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        self.url = box[0].decode().strip() if box else ""
        if not self.url.startswith("http"):
            self.stop(keep_log=True)
            raise RuntimeError(f"{kind} server printed no URL (got {self.url!r}); log: {self._log.name}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        self.pid = self.proc.pid
        if bucket:
            try:
                boto3_client(self.url).create_bucket(Bucket=bucket)
            except BaseException:
                self.stop(keep_log=True)
                raise
        log(f"{kind} S3 server at {self.url} (pid {self.pid})")

    def cpu_s(self) -> Optional[float]:
        return cpu_seconds(self.pid)

    def stop(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if keep_log:
            log(f"server log kept: {self._log.name}")
        else:
            os.remove(self._log.name)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.stop(keep_log=exc_type is not None)


# --------------------------------------------------------------------------- /proc


def proc_status(field: str, pid: str = "self") -> Optional[int]:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmHWM``, ``VmRSS``) in bytes.

    ``VmHWM``, not ``ru_maxrss``: the latter is inherited through fork + exec, so a child
    never reports less than its parent's RSS at spawn time."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0), so the next peak is the op's own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` (``rchar``/``wchar``: bytes through read/write syscalls, i.e. local files)."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except OSError:
        return {}


def cpu_seconds(pid: Optional[int]) -> Optional[float]:
    """User + system CPU seconds of a whole process (all its threads), e.g. the server's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, TypeError):
        return None


class PeakRss:
    """Peak RSS of this process over a block: ``peak`` (VmHWM after a reset before it, else the
    lifetime peak), ``before`` (RSS at the start) and ``delta`` (peak - before)."""

    def __enter__(self) -> "PeakRss":
        self.lifetime_before = proc_status("VmHWM")
        self.reset = reset_peak_rss()
        self.before = proc_status("VmRSS")
        return self

    def __exit__(self, *_: Any) -> None:
        hwm = proc_status("VmHWM")
        self.op_peak = hwm if self.reset else None
        self.lifetime = max(hwm or 0, self.lifetime_before or 0) or None
        peak = self.op_peak if self.op_peak is not None else self.lifetime
        self.delta = peak - self.before if peak is not None and self.before else None


# --------------------------------------------------------------------------- processes


def run_json(cmd: Sequence[str], timeout: float, show_stderr: bool = False, **what: Any) -> dict[str, Any]:
    """Run ``python <cmd>`` (test credentials in the environment); its last JSON stdout line.

    A crash or a timeout comes back as a result with ``ok: False`` and a ``status``, so one
    failing method never stops the comparison. ``show_stderr``: its progress lines go to ours."""
    env = dict(os.environ, **CRED_ENV, PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *cmd], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True,
                           stderr=None if show_stderr else subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**what, "ok": False, "status": "timeout", "error": f"no result within {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return {**json.loads(line), "process_s": time.perf_counter() - t0}
            except json.JSONDecodeError:
                continue
    return {**what, "ok": False, "status": "crashed",
            "error": f"exit {p.returncode}, no JSON line; stderr tail: {(p.stderr or '')[-1500:]}"}


def _gloo_rank(rank: int, world: int, rdzv: str, fn: Callable[..., Any], cfg: dict[str, Any], path: str,
               extra: tuple) -> None:
    os.environ.update(CRED_ENV)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.get("torch_threads", 1))
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.get("pg_timeout", 900)))
    try:
        out = fn(rank, world, cfg, *extra)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(out, f, default=repr)
    finally:
        dist.destroy_process_group()


def spawn_gloo(world: int, fn: Callable[..., Any], cfg: dict[str, Any], timeout: float,
               extra: tuple = ()) -> Any:
    """Run ``fn(rank, world, cfg, *extra)`` in ``world`` spawned processes of one gloo group
    (a file rendezvous: a free port picked here could be taken before rank 0 binds it);
    rank 0's return value. A failing rank kills the rest."""
    import torch.multiprocessing as tmp

    fd, path = tempfile.mkstemp(prefix=f"bench-w{world}-", suffix=".json")
    os.close(fd)
    rdzv = "file://" + path + ".rdzv"
    try:
        ctx = tmp.spawn(_gloo_rank, args=(world, rdzv, fn, cfg, path, extra), nprocs=world, join=False,
                        start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"world {world}: no result within {timeout:.0f} s (ranks killed)")
        with open(path) as f:
            return json.load(f)
    finally:
        os.remove(path)
        if os.path.exists(path + ".rdzv"):
            os.remove(path + ".rdzv")


def local(t: Any) -> Any:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def zero_(state: dict[str, Any]) -> None:
    """Zero a load template in place (each load must really write every byte)."""
    import torch

    with torch.no_grad():
        for v in state.values():
            local(v).zero_()


def differing(state: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """Keys whose loaded values (this rank's shards) differ from the source."""
    import torch

    return [k for k, v in state.items() if k not in loaded or not torch.equal(local(loaded[k]), local(v))]


# --------------------------------------------------------------------------- statistics and output


def median(values: Iterable[Any]) -> Optional[float]:
    xs = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return statistics.median(xs) if xs else None


def fmt(x: Optional[float], spec: str = "{:.3g}") -> str:
    return "–" if x is None else spec.format(x)


def ratio(a: Optional[float], b: Optional[float], spec: str = "{:.2f}x") -> str:
    return spec.format(a / b) if a is not None and b else "–"


def md_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def environment(*modules: str) -> dict[str, Any]:
    """Versions and core count; deliberately no host name and no paths."""
    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count(), "system": f"{platform.system()} {platform.release()}"}
    for mod in ("torch", "objckpt", *modules):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                    text=True).stdout.strip()
    except OSError:
        pass
    return env


def emit(result: dict[str, Any], out: str = "") -> None:
    """``result`` with its ``environment`` (:func:`environment`, and the crc32c implementation
    objckpt hashes with) printed as JSON and, with ``out``, also written there as given."""
    from objckpt.checksum import IMPLEMENTATION

    result["environment"] = {**environment(), "crc32c": IMPLEMENTATION}
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)


def export_objckpt(ref: str) -> str:
    """The ``objckpt/`` package of git ``ref`` in a new temporary directory (returned): a
    process that puts it first on ``sys.path`` runs that commit's objckpt (A/B against
    this tree in the same run)."""
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    root = tempfile.mkdtemp(prefix=f"objckpt-{commit}-")
    archive = subprocess.run(["git", "archive", commit, "objckpt"], cwd=REPO_ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", root], input=archive.stdout, check=True)
    return root


def write_results(path: str, results: dict[str, Any]) -> str:
    """Write ``results`` (plus ``created``) as JSON; ``path`` relative to the repository root.
    Returns the relative path, which is what the scripts print and record."""
    rel = os.path.relpath(os.path.join(REPO_ROOT, path), REPO_ROOT) if not os.path.isabs(path) else path
    full = os.path.join(REPO_ROOT, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    results = {"created": _dt.datetime.now().isoformat(timespec="seconds"), **results}
    with open(full + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=repr)
    os.replace(full + ".tmp", full)
    return rel


def result_path(name: str) -> str:
    """``benchmarks/results/<name>.json`` (relative)."""
    return os.path.join(RESULTS_DIR, f"{name}.json")
