"""Tiered checkpoints (one process; the state on the CPU or, with ``--device cuda``, a GPU): save stall
and restore against a memcpy, O_DIRECT against buffered.

    python -m benchmarks.bench_tier                      # 512 MiB share, 3 repeats
    python -m benchmarks.bench_tier --mib 64 --repeat 1  # quick check
    python -m benchmarks.bench_tier --device cuda        # the state on a GPU: pinned D2H / H2D references
    python -m benchmarks.bench_tier --local-parent /mnt/huge   # the local tier on a tmpfs mounted huge=within_size

Measures, in one run (ratios within the run):

* **stall**: ``CheckpointManager(tier=TierSettings(local_dir=/dev/shm/..., replicas=0, persist_every=None)).save``,
  synchronous (the local commit the training waits for) and with ``async_save=True`` (the
  staging copy; the local commit follows in the background), ``objckpt.async_save`` to object storage (the
  in-memory S3 server of testkit/, in this process) until it returns, and a memcpy of the
  share into pre-touched host tensors;
* **restore**: ``CheckpointManager.load`` from the local tier into pre-touched tensors, against
  a copy of the share back from host memory (a pinned host-to-device copy on a GPU), and
  on the CPU against the *verified-read floor*: the step's blob files read into touched
  memory and crc32c'd piece by piece on two threads, no planning (what any restore that
  checks what it reads pays at least);
* **O_DIRECT vs buffered** on a disk directory (``--disk``, default a temporary folder under
  /var/tmp): write throughput of ``objckpt.save`` through ``LocalStore(direct=...)``, and the
  page-cache growth: the blob files' resident pages right after the save (``mincore``) and
  the change of ``Cached`` in /proc/meminfo.

Peers (``bench_tier_peers``) and draining under a cap are measured elsewhere; the
1,024-node model is in docs/tiering.md's numbers from this script's rates.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

import objckpt
from objckpt.storage.local import LocalStore

from . import harness as h

MiB = 1 << 20


def make_state(mib: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    n = mib * MiB // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(n + 13 * i, generator=g).to(device) for i in range(8)}  # unaligned sizes


def touched_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def host_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pre-touched host tensors of the state's shapes: pinned when the state is on a GPU, so the
    reference copy is the fastest one the host allows (a pinned device-to-host DMA)."""
    pin = any(v.is_cuda for v in state.values())
    return {k: torch.zeros(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in state.items()}


def _sync(state: dict[str, torch.Tensor]) -> None:
    if any(v.is_cuda for v in state.values()):
        torch.cuda.synchronize()


def memcpy(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> float:
    """Seconds to copy ``src`` into ``dst`` (non-blocking per tensor, then one synchronize on a GPU)."""
    _sync(src)
    t0 = time.perf_counter()
    for k, v in src.items():
        dst[k].copy_(v, non_blocking=True)
    _sync(src)
    _sync(dst)
    return time.perf_counter() - t0


_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache (mincore over a mapping of it)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # private: from_buffer needs writable
        anchor = None
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            base = ctypes.addressof(anchor)
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            n = sum(1 for b in vec if b & 1) * page
        finally:
            del anchor
            mm.close()
    return min(n, size)


def cached_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1])
    return 0


def bench_direct(state: dict[str, torch.Tensor], disk: str, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    for direct in (False, True):
        rates, resident, cached = [], [], []
        for i in range(repeat):
            d = os.path.join(disk, f"{'direct' if direct else 'buffered'}-{i}")
            before = cached_kib()
            t0 = time.perf_counter()
            objckpt.save(state, d, store=LocalStore("/", direct=direct))
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
            cached.append((cached_kib() - before) * 1024 / nbytes)
            blobs = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(d, "blobs")) for f in fs]
            resident.append(sum(resident_bytes(b) for b in blobs) / nbytes)
            shutil.rmtree(d)
        out["direct" if direct else "buffered"] = {
            "gb_per_s": statistics.median(rates), "resident_share": statistics.median(resident),
            "cached_growth_share": statistics.median(cached)}
    return out


def verified_read_floor(folder: str, threads: int = 2, piece: int = 4 << 20) -> float:
    """Seconds to read every blob file under ``folder`` into touched host memory and
    crc32c each piece while it is in cache (``threads`` threads, ``piece``-byte ``preadv``):
    what any restore that checks what it reads from the local tier pays at least.  No
    planning, no manifest: only the bytes and their checksums."""
    import concurrent.futures

    from objckpt.checksum import crc32c

    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(folder, "blobs")) for f in fs]
    sizes = [os.path.getsize(f) for f in files]
    bufs = [torch.ones(n, dtype=torch.uint8) for n in sizes]
    fds = [os.open(f, os.O_RDONLY) for f in files]
    jobs = [(i, off) for i, n in enumerate(sizes) for off in range(0, n, piece)]

    def one(job: tuple[int, int]) -> None:
        i, off = job
        view = memoryview(bufs[i].numpy())[off:off + piece]
        os.preadv(fds[i], [view], off)
        crc32c(view)

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, jobs[:threads]))  # threads started
            t0 = time.perf_counter()
            list(ex.map(one, jobs))
            return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def bench_stall(state: dict[str, torch.Tensor], repeat: int, local_parent: str = "/dev/shm") -> dict[str, Any]:
    from testkit.s3server import S3Server

    import boto3

    dst = host_like(state)  # the share into host memory: the stall's reference
    memcpy(dst, state)
    copies = [memcpy(dst, state) for _ in range(repeat)]
    back = touched_like(state)  # host (pinned on a GPU) into the state's device: the restore's reference
    memcpy(back, dst)
    loads = [memcpy(back, dst) for _ in range(repeat)]
    server = S3Server()
    server.start()
    opts = {"endpoint_url": server.endpoint_url, "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing", "region_name": "us-east-1"}
    boto3.client("s3", **opts).create_bucket(Bucket="bench")
    shm = tempfile.mkdtemp(prefix="objckpt-bench-tier-", dir=local_parent)
    try:
        tiered: dict[bool, list[float]] = {}
        for mode in (False, True):
            m = objckpt.CheckpointManager(f"s3://bench/tiered{int(mode)}", storage_options=opts, async_save=mode,
                                          tier=objckpt.TierSettings(local_dir=shm, replicas=0, persist_every=None,
                                                                    local_keep=2))
            tiered[mode] = []
            for step in range(1, repeat + 2):
                t0 = time.perf_counter()
                m.save(step, state)
                tiered[mode].append(time.perf_counter() - t0)
                m.wait()  # untimed: the next save starts from a committed one
            m.close()
            for name in os.listdir(shm):
                shutil.rmtree(os.path.join(shm, name))
        asyncs = []
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            h = objckpt.async_save(state, f"s3://bench/async/{i}", storage_options=opts)
            asyncs.append(time.perf_counter() - t0)
            h.result()
        m = objckpt.CheckpointManager("s3://bench/tiered", storage_options=opts, tier=objckpt.TierSettings(
            local_dir=shm, replicas=0, persist_every=None, local_keep=2))
        m.save(1, state)
        step_dir = next(os.path.join(shm, n) for n in os.listdir(shm) if n.startswith("step"))
        floors = [verified_read_floor(step_dir) for _ in range(repeat)] if state_on_cpu(state) else [float("nan")]
        restores = []
        for _ in range(repeat):
            dst2 = touched_like(state)
            t0 = time.perf_counter()
            res = m.load(dst2)
            _sync(dst2)
            restores.append(time.perf_counter() - t0)
            assert res.source == "local"
        m.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        server.stop()
    mc, ld = statistics.median(copies), statistics.median(loads)
    sync, asy = statistics.median(tiered[False][1:]), statistics.median(tiered[True][1:])
    return {"memcpy_s": mc, "tiered_sync_stall_s": sync, "tiered_async_stall_s": asy,
            "s3_async_stall_s": statistics.median(asyncs[1:]), "local_restore_s": statistics.median(restores),
            "tiered_sync_over_memcpy": sync / mc, "tiered_async_over_memcpy": asy / mc,
            "s3_async_over_memcpy": statistics.median(asyncs[1:]) / mc,
            "load_memcpy_s": ld, "local_restore_over_memcpy": statistics.median(restores) / ld,
            "verified_read_floor_s": statistics.median(floors),
            "floor_over_memcpy": statistics.median(floors) / ld,
            "local_restore_over_floor": statistics.median(restores) / statistics.median(floors)}


def state_on_cpu(state: dict[str, torch.Tensor]) -> bool:
    return not any(v.is_cuda for v in state.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="the rank's share in MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--disk", default="", help="a directory on a disk for the O_DIRECT comparison")
    ap.add_argument("--device", default="cpu", help="where the state lives for the stall and restore (cuda: "
                    "the references are pinned device-to-host and host-to-device copies)")
    ap.add_argument("--local-parent", default="/dev/shm", help="the folder the local tier is made in (e.g. a "
                    "tmpfs mounted with huge=within_size)")
    ap.add_argument("--out", default="", help="also write the JSON here")
    a = ap.parse_args()
    state = make_state(a.mib)
    disk = a.disk or tempfile.mkdtemp(prefix="objckpt-bench-direct-", dir="/var/tmp")
    try:
        result = {"share_mib": a.mib, "repeat": a.repeat, "direct": bench_direct(state, disk, a.repeat),
                  "device": a.device,
                  "local_parent": a.local_parent,
                  "stall": bench_stall(make_state(a.mib, a.device) if a.device != "cpu" else state, a.repeat,
                                       a.local_parent)}
    finally:
        if not a.disk:
            shutil.rmtree(disk, ignore_errors=True)
    h.emit(result, a.out)


if __name__ == "__main__":
    main()
