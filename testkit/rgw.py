"""A real Ceph RADOS Gateway on loopback: one monitor, one in-memory OSD, radosgw.

Why: moto and the test kit's own server answer S3 the way their authors read the spec; a
real RGW signs, conditions, lists and sizes parts the way a deployed Ceph does, so the suite
runs objckpt against it too (tests/test_s3_rgw.py).  Everything lives under one directory:
the configuration, the monitor's store, the logs, the sockets.  Nothing system-wide is read
or written (no /etc/ceph, no /var/lib/ceph, no service manager), so it runs as root or as a
plain user, and several can run at once on free ports picked at start.

The cluster: ``auth none`` everywhere (then every messenger mode must be ``crc``: with the
default ``secure`` radosgw never reaches the monitor), one OSD on ``memstore`` (2 GiB of RAM,
nothing on disk), pools of size 1, radosgw's beast frontend on 127.0.0.1.  RGW's garbage
collector runs every 5 s with no minimum wait: by default the parts of a replaced or deleted
object stay for 2 h and a few large saves fill the 2 GiB.

    from testkit import rgw
    if (why := rgw.available()) is None:
        with rgw.start() as gw:
            boto3.client("s3", **gw.client_options()).create_bucket(Bucket="b")

``python -m testkit.rgw start [DIR]`` starts one that outlives the command (it prints the
endpoint, keys and directory as JSON) and ``python -m testkit.rgw stop DIR`` stops it.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional

__all__ = ["BINARIES", "Rgw", "RgwStartError", "available", "start"]

#: what a start runs; a machine without them cannot run RGW (Debian/Ubuntu: radosgw ceph-mon ceph-osd)
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "monmaptool", "ceph-authtool")
MEMSTORE_BYTES = 2 << 30
STOP_GRACE = 15.0  # seconds a daemon gets after SIGTERM before SIGKILL
READY_TRIES = 180  # S3 requests 0.5 s apart (radosgw answers about 10-15 s after an empty start)
_STATE = "rgw.json"  # in the directory: what `python -m testkit.rgw stop` needs
_LOGS = ("mon.a.log", "osd.0.log", "client.rgw.log", "mon.out", "osd.out", "rgw.out")
_running: List["Rgw"] = []


class RgwStartError(RuntimeError):
    """The cluster did not come up; the message has each daemon's last log lines."""


@dataclasses.dataclass
class Rgw:
    """A running cluster: where its S3 endpoint is, the user's keys, and its daemons."""

    endpoint_url: str
    access_key: str
    secret_key: str
    dir: str
    pids: Dict[str, int]  # daemon name ("mon", "osd", "rgw") -> pid, in start order
    region: str = "us-east-1"
    _procs: Dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict, repr=False)

    def storage_options(self, **extra: Any) -> Dict[str, Any]:
        """objckpt ``storage_options`` for this endpoint and user."""
        return {"endpoint_url": self.endpoint_url, "aws_access_key_id": self.access_key,
                "aws_secret_access_key": self.secret_key, "region_name": self.region, **extra}

    def client_options(self) -> Dict[str, Any]:
        """``boto3.client("s3", **...)`` keyword arguments for this endpoint and user."""
        return {"endpoint_url": self.endpoint_url, "aws_access_key_id": self.access_key,
                "aws_secret_access_key": self.secret_key, "region_name": self.region}

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of each daemon's log, for an error message."""
        return _log_tails(self.dir, lines)

    def stop(self) -> None:
        """Stop every daemon by its pid (SIGTERM, SIGKILL after ``STOP_GRACE``), wait for each,
        then remove the directory.  Idempotent."""
        for name in reversed(list(self.pids)):  # radosgw first, the monitor last
            _stop_one(self.pids[name], self._procs.get(name), self.dir)
        self.pids.clear()
        self._procs.clear()
        if self in _running:
            _running.remove(self)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Rgw":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def available() -> Optional[str]:
    """Why RGW cannot run here (a missing binary or module), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"Ceph daemons run on Linux only, not {sys.platform}"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"Ceph binaries not found on PATH: {', '.join(missing)} "
                "(Debian/Ubuntu: apt-get install radosgw ceph-mon ceph-osd)")
    try:
        import boto3  # noqa: F401  (the readiness check signs an S3 request)
    except ImportError:
        return "boto3 is not installed (the test extra)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf(d: str, fsid: str, mon_port: int, rgw_port: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
ms mon cluster mode = crc
ms mon service mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
ms bind msgr1 = false
run dir = {d}/run
admin socket = {d}/run/$name.asok
pid file = {d}/run/$name.pid
log file = {d}/log/$name.log
mon cluster log file = {d}/log/cluster.log
mon debug dump location = {d}/log/$name.tdump
crash dir = {d}/crash
keyring = {d}/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon max pg per osd = 1000
mon data avail warn = 1
mon data avail crit = 0
[mon]
mon data = {d}/mon/$name
[osd]
osd data = {d}/osd/$name
osd objectstore = memstore
memstore device bytes = {MEMSTORE_BYTES}
[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw data = {d}/rgw
rgw gc obj min wait = 0
rgw gc processor period = 5
"""


def _env() -> Dict[str, str]:
    """The environment for Ceph's tools: ``ceph`` is a Python script of the system's Python,
    which must not see this interpreter's paths."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "CEPH_CONF"}
    env["CEPH_CONF"] = "/dev/null"  # nothing of the machine's (the tools get -c explicitly)
    return env


def _tie_to_parent() -> None:
    """In the daemon, before exec: SIGTERM when the process that started it dies, so a test
    run killed outright leaves no daemon behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _run(d: str, args: List[str], what: str, timeout: float = 60) -> str:
    try:
        r = subprocess.run(args, cwd=d, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RgwStartError(f"{what} did not finish in {timeout:.0f} s: {' '.join(args)}") from None
    if r.returncode != 0:
        raise RgwStartError(f"{what} failed ({r.returncode}): {' '.join(args)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r.stdout


def _log_tails(d: str, lines: int) -> str:
    out = []
    for name in _LOGS:
        path = os.path.join(d, "log", name)
        try:
            with open(path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            continue
        out.append(f"--- {name}:\n" + "\n".join(tail))
    return "\n".join(out) or f"(no logs under {d}/log)"


def _spawn(gw: Rgw, name: str, args: List[str], tie: bool) -> None:
    """A daemon in the foreground (``-f``) as our child, its output in log/NAME.out."""
    with open(os.path.join(gw.dir, "log", f"{name}.out"), "wb") as out:
        p = subprocess.Popen(args, cwd=gw.dir, env=_env(), stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=_tie_to_parent if tie else None)
    gw._procs[name], gw.pids[name] = p, p.pid


def _retry(d: str, args: List[str], what: str, tries: int) -> str:
    """A ``ceph`` command that waits for the monitor: bounded retries, then the last error."""
    last: Exception = RgwStartError(what)
    for _ in range(tries):
        try:
            return _run(d, args, what, timeout=30)
        except RgwStartError as e:
            last = e
            time.sleep(0.5)
    raise last


def _poll(gw: Rgw, tries: int, what: str, request: Any) -> None:
    """Call ``request()`` until it succeeds, 0.5 s apart; a daemon that exits, or no success
    after ``tries`` attempts, is an error."""
    last = ""
    for _ in range(tries):
        dead = [f"{n} (exit {p.poll()})" for n, p in gw._procs.items() if p.poll() is not None]
        if dead:
            raise RgwStartError(f"Ceph daemon(s) exited during start: {', '.join(dead)}")
        try:
            request()
            return
        except Exception as e:  # not listening yet, or the user not known yet: try again
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise RgwStartError(f"radosgw at {gw.endpoint_url}: no {what} after {tries} tries; last: {last}")


def _wait_ready(gw: Rgw, tries: int) -> None:
    """radosgw answers an anonymous S3 request (its zone and pools exist), then the user is
    created and a signed ListBuckets must succeed.  The user is created only after the first
    answer: radosgw-admin and a starting radosgw would both create the default zone."""
    import urllib.request

    import boto3
    from botocore.config import Config

    _poll(gw, tries, "answer to an anonymous ListBuckets",
          lambda: urllib.request.urlopen(gw.endpoint_url + "/", timeout=5).read())
    _retry(gw.dir, ["radosgw-admin", "-c", os.path.join(gw.dir, "ceph.conf"), "user", "create", "--uid", "objckpt",
                    "--display-name", "objckpt tests", "--access-key", gw.access_key, "--secret", gw.secret_key],
           "radosgw-admin user create", 10)
    s3 = boto3.client("s3", **gw.client_options(),
                      config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))
    _poll(gw, tries, "answer to a signed ListBuckets", s3.list_buckets)


def start(dir: Optional[str] = None, *, tie_to_parent: bool = True, ready_tries: int = READY_TRIES) -> Rgw:
    """Start a cluster under ``dir`` (a new temporary directory when None; it must be empty
    or absent, and short: Unix socket paths are at most 107 bytes).  Returns once a signed S3
    request succeeds.  On any failure every daemon started is stopped, the directory removed,
    and :class:`RgwStartError` raised with the daemons' log tails.  ``tie_to_parent``: the
    daemons get SIGTERM when the thread that started them ends (Linux's parent-death signal;
    start from a thread that outlives the cluster, e.g. the main one; the CLI turns it off)."""
    d = os.path.abspath(dir) if dir else tempfile.mkdtemp(prefix="objckpt-rgw-")
    if len(os.path.join(d, "run", "client.rgw.asok")) > 100:
        raise RgwStartError(f"directory path too long for Ceph's admin sockets: {d}")
    os.makedirs(d, exist_ok=True)
    if os.listdir(d):
        raise RgwStartError(f"directory not empty: {d}")
    for sub in ("run", "log", "crash", "mon/mon.a", "osd/osd.0", "rgw"):
        os.makedirs(os.path.join(d, sub))
    mon_port, rgw_port, fsid = _free_port(), _free_port(), str(uuid.uuid4())
    conf = os.path.join(d, "ceph.conf")
    with open(conf, "w") as f:
        f.write(_conf(d, fsid, mon_port, rgw_port))
    gw = Rgw(endpoint_url=f"http://127.0.0.1:{rgw_port}", access_key="OBJCKPTRGW" + uuid.uuid4().hex[:10].upper(),
             secret_key=uuid.uuid4().hex + uuid.uuid4().hex[:8], dir=d, pids={})
    _running.append(gw)
    c = ["-c", conf]
    try:
        _run(d, ["ceph-authtool", "--create-keyring", "keyring", "--gen-key", "-n", "mon.",
                 "--cap", "mon", "allow *"], "ceph-authtool")
        _run(d, ["monmaptool", "--create", "--add", "a", f"v2:127.0.0.1:{mon_port}", "--fsid", fsid, "monmap"],
             "monmaptool")
        _run(d, ["ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", "monmap", "--keyring", "keyring"], "ceph-mon --mkfs")
        _spawn(gw, "mon", ["ceph-mon", *c, "-f", "-i", "a"], tie_to_parent)
        osd_uuid = str(uuid.uuid4())
        osd_id = _retry(d, ["ceph", *c, "--connect-timeout", "5", "osd", "new", osd_uuid], "ceph osd new", 10).strip()
        if osd_id != "0":
            raise RgwStartError(f"ceph osd new gave id {osd_id!r}, not 0")
        _run(d, ["ceph-osd", *c, "-i", "0", "--mkfs", "--osd-uuid", osd_uuid], "ceph-osd --mkfs")
        _spawn(gw, "osd", ["ceph-osd", *c, "-f", "-i", "0"], tie_to_parent)
        _spawn(gw, "rgw", ["radosgw", *c, "-f", "-n", "client.rgw"], tie_to_parent)
        _wait_ready(gw, ready_tries)
    except BaseException as e:
        tails = _log_tails(d, 15)
        gw.stop()
        if isinstance(e, RgwStartError):
            raise RgwStartError(f"{e}\n{tails}") from None
        raise
    with open(os.path.join(d, _STATE), "w") as f:
        json.dump({"endpoint_url": gw.endpoint_url, "access_key": gw.access_key, "secret_key": gw.secret_key,
                   "dir": d, "pids": gw.pids, "region": gw.region}, f)
    return gw


def _is_ours(pid: int, d: str) -> bool:
    """Whether ``pid`` is still a daemon of the cluster in ``d`` (its command line names d's
    ceph.conf): a pid of a daemon that exited may have been reused by anything."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.join(d, "ceph.conf").encode() in f.read()
    except OSError:
        return False


def _stop_one(pid: int, proc: Optional[subprocess.Popen], d: str) -> None:
    if proc is not None:  # our child: signal and reap it
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):  # started by another process (the CLI)
        if not _is_ours(pid, d):
            return
        os.kill(pid, sig)
        end = time.monotonic() + STOP_GRACE
        while time.monotonic() < end and _is_ours(pid, d):
            time.sleep(0.1)


@atexit.register
def _stop_all() -> None:
    """Clusters a program forgot to stop go with it."""
    for gw in list(_running):
        gw.stop()


def _load(d: str) -> Rgw:
    with open(os.path.join(d, _STATE)) as f:
        s = json.load(f)
    return Rgw(endpoint_url=s["endpoint_url"], access_key=s["access_key"], secret_key=s["secret_key"],
               dir=s["dir"], pids={k: int(v) for k, v in s["pids"].items()}, region=s["region"])


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m testkit.rgw start [DIR]`` (prints the endpoint, keys, dir as JSON) or
    ``python -m testkit.rgw stop DIR``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["start"] and len(args) <= 2:
        why = available()
        if why:
            print(f"cannot run RGW: {why}", file=sys.stderr)
            return 2
        t0 = time.monotonic()
        gw = start(args[1] if len(args) > 1 else None, tie_to_parent=False)
        _running.remove(gw)  # it outlives this command
        print(json.dumps({"endpoint_url": gw.endpoint_url, "aws_access_key_id": gw.access_key,
                          "aws_secret_access_key": gw.secret_key, "region_name": gw.region, "dir": gw.dir,
                          "pids": gw.pids, "start_seconds": round(time.monotonic() - t0, 1)}))
        return 0
    if args[:1] == ["stop"] and len(args) == 2:
        _load(args[1]).stop()
        return 0
    print(main.__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
