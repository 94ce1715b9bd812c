"""The measurements :mod:`benchmarks.device_check` runs in child processes.

    python -m benchmarks.device_probes stall|restore-save|restore-load '<json config>'

* ``stall``: async saves from the device state against a copy of the same bytes into
  pre-allocated pinned host buffers (on a CPU-only host: plain host buffers);
* ``restore-save``: each method of :mod:`benchmarks.methods` saves the state to the S3 server;
* ``restore-load``: the reference rates (the server's raw ranged-GET rate, the pinned
  host-to-device copy rate), then each saved method restores into fresh tensors on the
  device, verified against the state rebuilt from its seed.

Every probe writes its record to ``cfg["partial"]`` after each measurement (JSON, replaced
atomically), so a probe killed at its deadline keeps what it measured; ``cfg["until"]``
(epoch seconds) is the deadline it plans by: a measurement that would not fit is recorded
as ``"not run: out of time"`` instead of being started.
"""
from __future__ import annotations

import http.client
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from . import harness as h
from .gpt_state import gpt_specs
from .methods import METHODS, Target, dcp

OUT_OF_TIME = "not run: out of time"


def say(msg: str) -> None:
    h.log(f"[{time.strftime('%H:%M:%S')}] {msg}")


def failure(e: BaseException) -> str:
    return f"failed: {type(e).__name__}: {str(e)[:500]}"


class Record:
    """The probe's results, written to ``path`` after every change (a kill keeps them)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def set(self, key: str, value: Any) -> Any:
        self.data[key] = value
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=repr)
        os.replace(self.path + ".tmp", self.path)
        return value


class Clock:
    """The probe's deadline: whether a step of ``est`` seconds still fits (2 s kept in hand)."""

    def __init__(self, until: float) -> None:
        self.until = until

    def left(self) -> float:
        return self.until - time.time()

    def fits(self, est: float) -> bool:
        return self.left() > est + 2.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def _dtype(spec: Any, mixed: bool) -> torch.dtype:
    return torch.bfloat16 if mixed and spec.kind == "weight" and ".mlp." in spec.key else torch.float32


def make_state(nbytes: int, device: str, seed: int = 0, mixed: bool = False) -> dict[str, torch.Tensor]:
    """The GPT-like shapes of :func:`benchmarks.gpt_state.gpt_specs`, generated on ``device``
    itself (a 4 GiB state takes a second on a GPU, a minute through the CPU), deterministic
    from ``seed`` so another process rebuilds the same bytes to verify a load.
    ``mixed``: the MLP weights in bf16, the rest fp32, sized so the total is still ~``nbytes``."""
    def total(specs: list[Any]) -> int:
        return sum(math.prod(s.shape) * _dtype(s, mixed).itemsize for s in specs)

    specs = gpt_specs(nbytes)
    if mixed:
        specs = gpt_specs(int(nbytes * nbytes / total(specs)))
    out = {}
    for s in specs:
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + s.index)
        out[s.key] = torch.randn(s.shape, generator=g, device=device).mul_(0.02).to(_dtype(s, mixed))
    sync(device)
    return out


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def timed_within(f: Callable[[], float], repeat: int, clock: Clock) -> dict[str, Any]:
    """One untimed warm-up, then up to ``repeat`` runs while the next still fits; ``f`` returns
    the figure (e.g. a stall), the wall of each call is what the deadline is planned with."""
    t = time.perf_counter()
    f()
    walls, xs = [time.perf_counter() - t], []  # type: list[float], list[float]
    while len(xs) < repeat and (not xs or clock.fits(1.5 * max(walls))):
        t = time.perf_counter()
        xs.append(f())
        walls.append(time.perf_counter() - t)
    return {"median_s": h.median(xs), "runs_s": xs}


def scratch_dir(need: int) -> tuple[str, str]:
    """Where local saves go: /dev/shm when it has room for ``need`` bytes (storage is not what
    is measured), else the temporary directory."""
    for base, kind in (("/dev/shm", "/dev/shm"), (tempfile.gettempdir(), "tmp")):
        try:
            if shutil.disk_usage(base).free > need:
                return tempfile.mkdtemp(prefix="objckpt-devcheck-", dir=base), kind
        except OSError:
            continue
    return tempfile.mkdtemp(prefix="objckpt-devcheck-"), "tmp"


# --------------------------------------------------------------------------- async save stall


def stall(cfg: dict[str, Any]) -> None:
    import objckpt
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

    rec, clock, dev = Record(cfg["partial"]), Clock(cfg["until"]), cfg["device"]
    cuda, repeat = dev.startswith("cuda"), cfg["repeat"]
    t0 = time.perf_counter()
    state = make_state(cfg["bytes"], dev, mixed=True)
    nbytes = state_bytes(state)
    rec.data.update(device=device_name(dev), torch=torch.__version__, bytes=nbytes, tensors=len(state),
                    dtypes=sorted({str(v.dtype) for v in state.values()}), make_s=time.perf_counter() - t0,
                    repeat=repeat)
    root, kind = scratch_dir(3 * nbytes)
    rec.set("target", kind)
    say(f"stall: {len(state)} tensors, {nbytes / h.GiB:.2f} GiB on {dev}; saves go to {kind}")
    ref_name = "pinned_d2h" if cuda else "host_copy"

    def measure(name: str, f: Callable[[], float]) -> None:
        if not clock.fits(5.0):
            rec.set(name, OUT_OF_TIME)
            return
        try:
            r = timed_within(f, repeat, clock)
            ref = rec.data.get(ref_name)
            if r["median_s"] and isinstance(ref, dict) and ref.get("median_s"):
                r["x_ref"] = r["median_s"] / ref["median_s"]
            rec.set(name, r)
        except Exception as e:  # noqa: BLE001 - recorded, the next measurement goes on
            rec.set(name, failure(e))
        say(f"stall: {name}: {rec.data[name] if isinstance(rec.data[name], str) else round(rec.data[name]['median_s'] or -1, 4)}")

    dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}

    def copy_once() -> float:
        t = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v, non_blocking=cuda)
        sync(dev)
        return time.perf_counter() - t

    measure(ref_name, copy_once)
    if isinstance(rec.data[ref_name], dict) and rec.data[ref_name]["median_s"]:
        rec.data[ref_name].update(gbps=nbytes / rec.data[ref_name]["median_s"] / 1e9, x_ref=1.0)
    del dst
    n = itertools.count()
    for name, lazy in (("objckpt_async", False), ("objckpt_lazy", True)):
        ready: list[float] = []
        done: list[float] = []

        def save(lazy: bool = lazy, ready: list[float] = ready, done: list[float] = done) -> float:
            uri = os.path.join(root, f"ock-{next(n)}")
            t = time.perf_counter()
            hd = objckpt.async_save(state, uri, lazy=lazy)
            stall_s = time.perf_counter() - t
            hd.wait_staged()
            ready.append(time.perf_counter() - t)
            hd.result()
            done.append(time.perf_counter() - t)
            shutil.rmtree(uri, ignore_errors=True)
            return stall_s

        measure(name, save)
        if isinstance(rec.data[name], dict):
            rec.data[name].update(ready_s=h.median(ready[1:]), done_s=h.median(done[1:]))

    def dcp_save(stager: Any) -> float:
        path = os.path.join(root, f"dcp-{next(n)}")
        t = time.perf_counter()
        r = dcp().async_save(state, storage_writer=dcp().FileSystemWriter(path), no_dist=True, async_stager=stager)
        stall_s = time.perf_counter() - t
        for fut in (r.staging_completion, r.upload_completion) if hasattr(r, "upload_completion") else (r,):
            fut.result()
        shutil.rmtree(path, ignore_errors=True)
        return stall_s

    # the defaults on a GPU; without one, the options DCP can run on the CPU (what the dry run checks)
    stagers = (("dcp_default_stager", lambda: DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                                           use_non_blocking_copy=cuda))),
               ("dcp_pinned_cached", lambda: BlockingAsyncStager(cache_staged_state_dict=cuda)))
    for name, make in stagers:
        try:
            stager = make()
        except Exception as e:  # noqa: BLE001
            rec.set(name, failure(e))
            continue
        measure(name, lambda: dcp_save(stager))
        try:
            stager.close()
        except Exception:  # noqa: BLE001 - closing a stager that failed
            pass
    shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- restore


def restore_save(cfg: dict[str, Any]) -> None:
    rec, clock, dev = Record(cfg["partial"]), Clock(cfg["until"]), cfg["device"]
    state = make_state(cfg["bytes"], dev, seed=cfg["seed"])
    nbytes = rec.set("bytes", state_bytes(state))
    rec.set("tensors", len(state))
    for name in cfg["methods"]:
        if not clock.fits(5.0):
            rec.set(name, {"status": OUT_OF_TIME})
            continue
        method, target = METHODS[name](), Target(cfg["endpoint"], cfg["bucket"], f"{cfg['prefix']}/{name}")
        try:
            method.setup(target)
            method.warmup(target)
        except Exception as e:  # noqa: BLE001 - a peer that is not installed here
            rec.set(name, {"status": "unavailable", "error": failure(e)})
            say(f"restore: {name} unavailable: {e}")
            continue
        rec.set(name, {"status": "stopped while saving"})  # what a kill leaves
        t = time.perf_counter()
        try:
            method.save(state, target)
            sync(dev)
        except Exception as e:  # noqa: BLE001
            rec.set(name, {"status": "failed", "error": failure(e), "traceback": traceback.format_exc(limit=4)})
            say(f"restore: {name} save {rec.data[name]['error']}")
            continue
        wall = time.perf_counter() - t
        rec.set(name, {"status": "ok", "save_s": wall, "save_gbps": nbytes / wall / 1e9})
        say(f"restore: {name} saved {nbytes / h.GiB:.2f} GiB from {dev} in {wall:.2f} s")


def raw_get_gbps(endpoint: str, bucket: str, objects: list[tuple[str, int]], threads: int,
                 piece: int = 16 * h.MiB, limit: int = h.GiB) -> float:
    """Ranged GETs of ``piece`` bytes over the objects (the first ``limit`` bytes of them),
    ``threads`` keep-alive connections, each reading into one reused buffer: the rate the
    server and the loopback sustain with no client library in the way (the server ignores
    signatures)."""
    url = urllib.parse.urlsplit(endpoint)
    pieces = [(k, off, min(piece, size - off)) for k, size in objects for off in range(0, size, piece)]
    jobs = iter(pieces[:max(1, -(-limit // piece))])
    lock = threading.Lock()

    def worker() -> int:
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
        mv, got_all = memoryview(bytearray(piece)), 0
        try:
            while True:
                with lock:
                    job = next(jobs, None)
                if job is None:
                    return got_all
                key, off, n = job
                conn.request("GET", f"/{bucket}/{urllib.parse.quote(key, safe='/')}",
                             headers={"Range": f"bytes={off}-{off + n - 1}"})
                r = conn.getresponse()
                if r.status not in (200, 206):
                    raise RuntimeError(f"GET {key} at {off}: HTTP {r.status} from {endpoint}")
                got = 0
                while got < n:
                    k = r.readinto(mv[got:n])  # type: ignore[arg-type]
                    if not k:
                        raise RuntimeError(f"GET {key} at {off}: {got} of {n} bytes from {endpoint}")
                    got += k
                r.read()
                got_all += got
        finally:
            conn.close()

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(lambda _: worker(), range(threads)))
    return total / (time.perf_counter() - t) / 1e9


def copy_rate_gbps(device: str, nbytes: int) -> float:
    """Pinned host-to-device copy rate (``bench_cold_warm.h2d_gbps``); on a CPU-only host
    its mirror, a host-to-host copy of the same size."""
    if device.startswith("cuda"):
        from .bench_cold_warm import h2d_gbps

        return h2d_gbps(device, nbytes)
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * nbytes / (time.perf_counter() - t) / 1e9


def reference_rates(cfg: dict[str, Any], rec: Record, nbytes: int) -> None:
    """The restore's ceiling: min(the server's raw GET rate, the host-to-device copy rate)."""
    dev = cfg["device"]
    try:
        rec.set("h2d_gbps" if dev.startswith("cuda") else "host_copy_gbps", copy_rate_gbps(dev, min(h.GiB, nbytes)))
    except Exception as e:  # noqa: BLE001
        rec.set("h2d_gbps", failure(e))
    source = next((m for m in cfg["saved"]), None)
    if source is None:
        rec.set("raw_get", "unavailable: no method saved the state")
        return
    client = h.boto3_client(cfg["endpoint"])
    objects = [(o["Key"], o["Size"]) for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=cfg["bucket"], Prefix=f"{cfg['prefix']}/{source}/") for o in page.get("Contents", [])]
    rates: dict[str, Any] = {}
    for threads in cfg["get_threads"]:
        try:
            rates[str(threads)] = raw_get_gbps(cfg["endpoint"], cfg["bucket"], objects, threads)
        except Exception as e:  # noqa: BLE001
            rates[str(threads)] = failure(e)
    best = max((v for v in rates.values() if isinstance(v, float)), default=None)
    rec.set("raw_get", {"of": source, "objects": len(objects), "bytes": sum(s for _, s in objects),
                        "gbps_by_threads": rates, "gbps": best})
    h2d = rec.data.get("h2d_gbps", rec.data.get("host_copy_gbps"))
    if isinstance(h2d, float) and best:
        rec.set("ceiling_gbps", min(h2d, best))
    say(f"restore: raw GET {rates} GB/s, copy {h2d} GB/s")


def restore_load(cfg: dict[str, Any]) -> None:
    rec, clock, dev = Record(cfg["partial"]), Clock(cfg["until"]), cfg["device"]
    ref = make_state(cfg["bytes"], dev, seed=cfg["seed"])
    nbytes = rec.set("bytes", state_bytes(ref))
    rec.set("device", device_name(dev))
    reference_rates(cfg, rec, nbytes)
    for name in cfg["saved"]:
        if not clock.fits(5.0):
            rec.set(name, {"status": OUT_OF_TIME})
            continue
        method, target = METHODS[name](), Target(cfg["endpoint"], cfg["bucket"], f"{cfg['prefix']}/{name}")
        t = time.perf_counter()
        try:
            method.setup(target)  # no warm-up request: rep 0 is a restarting job's first load
        except Exception as e:  # noqa: BLE001
            rec.set(name, {"status": "unavailable", "error": failure(e)})
            continue
        r: dict[str, Any] = {"status": "ok", "setup_s": time.perf_counter() - t, "reps": []}
        for rep in range(cfg["reps"]):
            if rep and not clock.fits(1.5 * r["reps"][-1]["wall_s"]):
                r["note"] = f"{OUT_OF_TIME} after rep {rep - 1}"
                break
            dest = {k: torch.empty(v.shape, dtype=v.dtype, device=dev) for k, v in ref.items()}
            rec.set(name, dict(r, status=f"stopped while loading rep {rep}"))  # what a kill leaves
            t = time.perf_counter()
            try:
                method.load(dest, target)
                sync(dev)
            except Exception as e:  # noqa: BLE001
                r.update(status="failed", error=failure(e))
                break
            wall = time.perf_counter() - t
            bad = [k for k, v in ref.items() if not torch.equal(dest[k], v)]
            r["reps"].append({"wall_s": wall, "gbps": nbytes / wall / 1e9,
                              "verify": f"{len(bad)} tensors differ, e.g. {bad[:3]}" if bad else "ok"})
            del dest
            rec.set(name, r)
            say(f"restore: {name} load rep {rep} into {dev}: {wall:.3f} s ({nbytes / wall / 1e9:.2f} GB/s), "
                f"verify {r['reps'][-1]['verify']}")
        reps = r["reps"]
        r.update(cold_s=reps[0]["wall_s"] if reps else None, warm_s=h.median(x["wall_s"] for x in reps[1:]))
        rec.set(name, r)


PROBES: dict[str, Callable[[dict[str, Any]], None]] = {
    "stall": stall, "restore-save": restore_save, "restore-load": restore_load}


def main(argv: Optional[list[str]] = None) -> int:
    kind, raw = (argv if argv is not None else sys.argv[1:])[:2]
    cfg = json.loads(raw)
    torch.set_num_threads(cfg.get("torch_threads") or torch.get_num_threads())
    try:
        PROBES[kind](cfg)
    except BaseException as e:  # noqa: BLE001 - the parent reads the record; say why it stopped
        rec = Record(cfg["partial"])
        if os.path.exists(cfg["partial"]):
            with open(cfg["partial"]) as f:
                rec.data = json.load(f)
        rec.set("error", failure(e))
        rec.set("traceback", traceback.format_exc(limit=6))
        say(f"{kind}: {failure(e)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
