"""Fault and corrupt trials of the campaign (see :mod:`testkit.campaign`).

* **fault**: a save then a read/load, bit-exact, while the S3 server answers 503 SlowDown
  or 500 (its ``/_objckpt/fail`` control), or while a loopback TCP proxy between client
  and server resets connections, cuts them mid-stream or stalls them.  The proxy knows
  nothing of S3, so the same faults apply to any HTTP store.
* **corrupt**: one random byte of a blob, a rank index (format v2) or a manifest flipped
  on local files, then read / verify / load: each must raise an ObjckptError or give
  bit-exact data.
"""
from __future__ import annotations

import copy
import io
import os
import random
import shutil
import socket
import struct
import tempfile
import threading
import time
import urllib.request
from contextlib import redirect_stdout
from typing import Any, Optional

import torch

from .campaign import DETECTED, FAILED, OK, Trial, judge_error, make_state, same, s3_options, timed

NET_FAULTS = ("reset", "cut", "stall")
HTTP_FAULTS = ("503", "500")
FAULT_KINDS = HTTP_FAULTS + NET_FAULTS
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# --------------------------------------------------------------------------- the proxy


class FaultProxy:
    """A loopback TCP proxy to ``upstream`` that, on a random share of new connections,
    injects one network fault after a random number of bytes in one direction:

    * ``reset``: both sockets closed with SO_LINGER 0 (the peer sees ECONNRESET);
    * ``cut``: both closed cleanly (FIN) mid-stream: a truncated body or a lost answer;
    * ``stall``: forwarding pauses for ``stall_s`` (longer than a short read timeout).

    ``direction``: ``up`` (requests), ``down`` (responses) or ``any`` (drawn per connection).

    ``injected`` counts faults that actually fired."""

    def __init__(self, upstream: str, *, kind: str = "reset", probability: float = 0.3, seed: int = 0,
                 stall_s: float = 1.5, max_offset: int = 8192, min_offset: int = 0,
                 direction: str = "any") -> None:
        host, port = upstream.rsplit("//", 1)[-1].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.kind, self.probability, self.stall_s = kind, probability, stall_s
        self.min_offset, self.max_offset, self.direction = min_offset, max_offset, direction
        self.rng = random.Random(seed)
        self.injected = 0
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            client.settimeout(None)
            with self._lock:
                fault = self.rng.random() < self.probability
                upward = self.rng.random() < 0.5 if self.direction == "any" else self.direction == "up"
                offset = self.rng.randint(self.min_offset, self.max_offset)
                self._open += [client, server]
            plan = (self.kind, offset) if fault else None
            threading.Thread(target=self._pump, args=(client, server, plan if upward else None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None if upward else plan), daemon=True).start()

    def _fire(self) -> None:
        with self._lock:
            self.injected += 1

    def _pump(self, src: socket.socket, dst: socket.socket, plan: Optional[tuple[str, int]]) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if plan is not None and sent + len(data) > plan[1]:
                    kind, at = plan
                    plan = None
                    self._fire()
                    if kind == "stall":
                        time.sleep(self.stall_s)
                    else:
                        dst.sendall(data[:max(0, at - sent)])
                        if kind == "reset":
                            for s in (src, dst):
                                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self._close(src, dst)
                        return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        self._close(src, dst)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        """Stop accepting and end every proxied connection with a FIN.

        Why shutdown and not only close: a pump thread blocked in ``recv`` on a socket
        keeps the kernel socket alive past ``close()``, so the server would keep waiting
        on a half-sent request forever (and a server's graceful stop with it)."""
        self._stop.set()
        self.sock.close()
        with self._lock:
            socks, self._open = self._open, []
        self._close(*socks)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def server_control(endpoint: str, name: str, **query: Any) -> None:
    """POST ``/_objckpt/<name>`` on the in-memory S3 server (``fail``, ``reset``)."""
    qs = "&".join(f"{k}={v}" for k, v in query.items())
    req = urllib.request.Request(f"{endpoint}/_objckpt/{name}{'?' + qs if qs else ''}", data=b"", method="POST")
    _NO_PROXY.open(req, timeout=30).read()


# --------------------------------------------------------------------------- fault


def fault_trial(endpoint: str, seed: int, kind: Optional[str] = None) -> Trial:
    """One save + read-back (or load) through injected faults on the in-memory S3 server at
    ``endpoint`` (reset between trials: it must be a dedicated server).  ``ok``: the save and
    the read succeeded bit-exact; ``detected``: an ObjckptError (the retries ran out) and no
    checkpoint half-visible; ``FAILED``: wrong data, a leaked built-in exception, a hang."""
    import boto3

    import objckpt

    rng = random.Random(seed)
    kind = kind or rng.choice(FAULT_KINDS)
    params: dict[str, Any] = {"seed": seed, "fault": kind, "check": rng.choice(("read", "load"))}

    def body() -> Trial:
        server_control(endpoint, "reset")
        boto3.client("s3", **s3_options(endpoint)).create_bucket(Bucket="campaign")
        state = make_state(seed)
        uri = f"s3://campaign/fault-{seed}"
        injected = 0
        proxy: Optional[FaultProxy] = None
        if kind in HTTP_FAULTS:
            op = rng.choice(("*", "PutObject", "GetObject", "CompleteMultipartUpload", "UploadPart"))
            injected = rng.randint(1, 3)
            params.update(op=op, count=injected)
            server_control(endpoint, "fail", op=op, count=injected, status=int(kind))
            url = endpoint
        else:
            proxy = FaultProxy(endpoint, kind=kind, probability=0.35, seed=seed, stall_s=1.5)
            url = proxy.url
        opts = s3_options(url, connect_timeout=2, read_timeout=1)
        try:
            try:
                objckpt.save(state, uri, storage_options=opts, part_size=64 << 10, blob_size=96 << 10)
            except Exception as e:  # noqa: BLE001
                outcome, what = judge_error(e)
                return Trial("fault", params, outcome, f"save: {what}", faults=_count(proxy, injected))
            try:
                if params["check"] == "read":
                    back = objckpt.read(uri, storage_options=opts)
                else:
                    back = _zeroed(state)
                    objckpt.load(back, uri, storage_options=opts)
            except Exception as e:  # noqa: BLE001
                outcome, what = judge_error(e)
                return Trial("fault", params, outcome, f"{params['check']}: {what}", faults=_count(proxy, injected))
        finally:
            if proxy:
                proxy.close()
        if not same(state, back):
            return Trial("fault", params, FAILED, "round trip not bit-exact", faults=_count(proxy, injected))
        return Trial("fault", params, OK, "bit-exact", faults=_count(proxy, injected))

    return timed("fault", params, body)


def _count(proxy: Optional[FaultProxy], http: int) -> int:
    return proxy.injected if proxy is not None else http


def _zeroed(state: Any) -> Any:
    """A load template shaped like ``state``: tensors zeroed, values kept."""
    out = copy.deepcopy(state)

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, torch.Tensor):
            x.zero_()

    walk(out)
    return out


# --------------------------------------------------------------------------- corrupt


def _v2_rank(rank: int, world: int, rdzv: str, uri: str, seed: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import faulthandler

    import objckpt

    faulthandler.enable(all_threads=True)  # a fatal signal (an abort at exit) prints every thread's stack
    dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = v2_state(seed)
        state = {"grid": distribute_tensor(full["grid"], mesh, [Shard(0)]),
                 "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                 "rep": full["rep"], "step": full["step"]}
        objckpt.save(state, uri, crc_block=4096)
    finally:
        dist.destroy_process_group()


def v2_state(seed: int) -> dict[str, Any]:
    """The whole (unsharded) state :func:`make_v2_checkpoint` saves from two ranks."""
    g = torch.Generator().manual_seed(seed)
    return {"grid": torch.randn(64, 48, generator=g), "cols": torch.randn(16, 64, generator=g).to(torch.bfloat16),
            "rep": torch.randn(5000, generator=g), "step": 11}


def make_v2_checkpoint(path: str, seed: int = 5, world: int = 2, timeout: float = 120.0) -> dict[str, Any]:
    """Save a format-v2 checkpoint (per-rank index objects) from ``world`` real gloo ranks
    holding DTensors; returns the whole state it holds."""
    import warnings

    import torch.multiprocessing as tmp

    # a file rendezvous: a free TCP port picked here can be taken (an outgoing connection's
    # ephemeral port) before rank 0 binds it, which fails or hangs the group
    with tempfile.TemporaryDirectory(prefix="objckpt-rdzv-") as rd:
        rdzv = "file://" + os.path.join(rd, "store")
        ctx = tmp.spawn(_v2_rank, args=(world, rdzv, path, seed), nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError("v2 save ranks hung")
        except tmp.ProcessExitedException as e:
            # A rank killed by a signal *after* every rank's save returned and the group was
            # destroyed (a C++ thread of the process group aborting at interpreter exit, seen
            # once in many runs; its stacks are on stderr) left a committed checkpoint: verify
            # it whole and go on, saying so.  Anything else fails the fixture.
            if not e.signal_name or not _committed(path, seed):
                raise
            warnings.warn(f"make_v2_checkpoint: save rank {e.error_index} died with {e.signal_name} at exit; "
                          "the checkpoint it had committed verifies and holds the expected state")
    return v2_state(seed)


def _committed(path: str, seed: int) -> bool:
    """``path`` holds a committed checkpoint that reads back (every chunk's crc32c checked) as
    ``v2_state(seed)``."""
    import objckpt

    try:
        return bool(same(objckpt.read(path, no_dist=True), v2_state(seed)))
    except Exception:
        return False


def _files(root: str, where: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if (where == "manifest" and n == "manifest.json") or (where == "index" and n.endswith(".index.json")) \
                    or (where == "blob" and n.endswith(".bin")):
                out.append(p)
    return sorted(out)


def flip_byte(path: str, rng: random.Random) -> tuple[int, int]:
    """XOR one random byte of ``path`` with a random non-zero mask; (offset, mask)."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        at, mask = rng.randrange(size), rng.randint(1, 255)
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ mask]))
    return at, mask


def corrupt_trial(base: str, expected: Any, seed: int, where: str, *, flips: int = 1) -> Trial:
    """Copy the committed checkpoint at ``base``, flip ``flips`` random byte(s) in one random
    ``where`` file (``blob``, ``index`` or ``manifest``), then read it whole, verify it
    (``objckpt verify``) and load it into a zeroed template.  Each must raise an
    ObjckptError or return exactly ``expected``."""
    rng = random.Random(seed)
    params: dict[str, Any] = {"seed": seed, "where": where, "flips": flips}

    def body() -> Trial:
        import objckpt
        from objckpt.cli import main as cli_main

        tmp = tempfile.mkdtemp(prefix="objckpt-corrupt-")
        try:
            ck = os.path.join(tmp, "ck")
            shutil.copytree(base, ck)
            files = _files(ck, where)
            if not files:
                return Trial("corrupt", params, FAILED, f"no {where} file to corrupt")
            victim = rng.choice(files)
            params.update(file=os.path.relpath(victim, ck),
                          at=[flip_byte(victim, rng) for _ in range(flips)])
            results: dict[str, str] = {}
            details: list[str] = []
            try:
                results["read"] = OK if same(expected, objckpt.read(ck)) else FAILED
                if results["read"] == FAILED:
                    details.append("read: silently wrong data")
            except Exception as e:  # noqa: BLE001
                results["read"], what = judge_error(e)
                details.append(f"read: {what}")
            try:
                with redirect_stdout(io.StringIO()):
                    cli_main(["verify", ck])
                results["verify"] = OK
            except Exception as e:  # noqa: BLE001
                results["verify"], what = judge_error(e)
                details.append(f"verify: {what}")
            try:
                tmpl = _zeroed(expected)
                objckpt.load(tmpl, ck)
                results["load"] = OK if same(expected, tmpl) else FAILED
                if results["load"] == FAILED:
                    details.append("load: silently wrong data")
            except Exception as e:  # noqa: BLE001
                results["load"], what = judge_error(e)
                details.append(f"load: {what}")
            outcome = FAILED if FAILED in results.values() else DETECTED if DETECTED in results.values() else OK
            return Trial("corrupt", params, outcome, "; ".join(details) or "bit-exact", faults=flips,
                         extra={"ops": results})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return timed("corrupt", params, body)
