"""crc32c implementations side by side, and what each makes of a verified read from node memory.

    python -m benchmarks.bench_crc32c --out benchmarks/results/crc32c.json

Every restore checks the crc32c of every byte it reads, so on a host where reading is a
memcpy (``/dev/shm``, a peer's bytes already in memory) the hash is most of what a restore
spends beside the copy.  Measured, in one run, for the ``crc32c`` package (SSE4.2, the
reference) and ``crc32c_rs`` (AVX-512 / VPCLMULQDQ where the CPU has them):

* **cached**: GB/s hashing a 256 KiB buffer over and over (a piece just read, in L2),
  on one thread and on two at once (the GIL is released: two should be ~2x);
* **streaming**: GB/s over 512 MiB in memory, one and two threads;
* **verified read**: a 512 MiB file in ``--dir`` (``/dev/shm``; or a tmpfs mounted
  ``huge=within_size``) read into touched memory on two threads, each looping over its
  half in pieces (``preadv``), each piece hashed right after it landed, against ``torch``
  copying the same bytes between two touched tensors (two threads, like the reads); and
  the same reads with no hash.  The ratio is the ceiling of any verifying restore from
  node memory.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import torch

from . import harness as h

MiB = 1 << 20


def implementations() -> dict[str, Callable[..., int]]:
    import crc32c

    out: dict[str, Callable[..., int]] = {"crc32c": crc32c.crc32c}
    try:
        import crc32c_rs

        out["crc32c_rs"] = crc32c_rs.crc32c
    except ImportError:
        pass
    return out


def rate(fn: Callable[..., int], bufs: list[memoryview], reps: int) -> float:
    """GB/s of ``fn`` over ``reps`` passes of each buffer, one thread per buffer."""
    def run(b: memoryview) -> None:
        for _ in range(reps):
            fn(b)

    ts = [threading.Thread(target=run, args=(b,)) for b in bufs]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(len(b) for b in bufs) * reps / (time.perf_counter() - t0) / 1e9


def verified_read(fn: Callable[..., int], path: str, dst: torch.Tensor, piece: int, threads: int = 2) -> float:
    """Seconds for ``threads`` threads, each looping over its part of the file: ``preadv`` of
    ``piece`` bytes into ``dst``, then ``fn`` over them while they are in cache (as
    ``LocalStore`` reads with a checksum tally)."""
    size = dst.numel()
    view = memoryview(dst.numpy())
    part = -(-size // threads)
    fd = os.open(path, os.O_RDONLY)

    def run(start: int) -> None:
        for off in range(start, min(start + part, size), piece):
            v = view[off:min(off + piece, start + part, size)]
            os.preadv(fd, [v], off)
            fn(v)

    try:
        ts = [threading.Thread(target=run, args=(i * part,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm", help="where the file is (a tmpfs; e.g. one mounted huge=within_size)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(2)
    fns = implementations()
    src = torch.randint(0, 256, (a.mib * MiB,), dtype=torch.uint8)
    big = memoryview(src.numpy())
    half = len(big) // 2
    small = [memoryview(torch.randint(0, 256, (256 << 10,), dtype=torch.uint8).numpy()) for _ in range(2)]
    ref = fns["crc32c"](big)
    assert all(fn(big) == ref for fn in fns.values()), "the implementations disagree"
    dst = torch.ones_like(src)
    copies = []
    for _ in range(a.repeat + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    memcpy_s = statistics.median(copies[1:])
    fd, path = tempfile.mkstemp(prefix="objckpt-bench-crc-", dir=a.dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(big)
        from objckpt.tier.mounts import mount_of

        m = mount_of(a.dir)
        result: dict[str, Any] = {"mib": a.mib, "repeat": a.repeat, "dir": a.dir, "memcpy_s": memcpy_s,
                                  "mount": f"{m.fstype} {m.option('huge') and 'huge=' + str(m.option('huge')) or ''}"
                                  .strip() if m else "", "implementations": {}}
        for name, fn in fns.items():
            r: dict[str, Any] = {
                "cached_1t_gbps": statistics.median(rate(fn, small[:1], 4000) for _ in range(a.repeat)),
                "cached_2t_gbps": statistics.median(rate(fn, small, 4000) for _ in range(a.repeat)),
                "stream_1t_gbps": statistics.median(rate(fn, [big], 1) for _ in range(a.repeat)),
                "stream_2t_gbps": statistics.median(rate(fn, [big[:half], big[half:]], 1) for _ in range(a.repeat)),
            }
            for piece in (512 << 10, 4 << 20):
                reads = [verified_read(fn, path, dst, piece) for _ in range(a.repeat)]
                r[f"verified_read_{piece >> 10}k_over_memcpy"] = memcpy_s / statistics.median(reads)
            result["implementations"][name] = r
        reads = [verified_read(lambda v: 0, path, dst, 4 << 20) for _ in range(a.repeat)]
        result["read_only_4096k_over_memcpy"] = memcpy_s / statistics.median(reads)
    finally:
        os.unlink(path)
    h.emit(result, a.out)


if __name__ == "__main__":
    main()
