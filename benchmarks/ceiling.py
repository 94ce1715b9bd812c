"""Raw throughput ceiling of an S3 endpoint, as seen by a near-zero-cost client.

Why: a checkpoint library can be no faster than the endpoint plus the HTTP
stack.  This script does only what any client must do -- send pre-made bytes
as a multipart upload with many parts in flight, then read the object back
with concurrent 16 MiB ranged GETs into a preallocated buffer -- using aiohttp
directly, with no signing, hashing or retries.  Its numbers are the bar that
objckpt's own save/load throughput is compared against.

Requests are unsigned.  Our test server (``testkit.s3server``) ignores
auth; moto also accepts unsigned requests by default (it does not check
signatures unless ``INITIAL_NO_AUTH_ACTION_COUNT`` is set).

    python -m benchmarks.ceiling --endpoint-url http://127.0.0.1:PORT --bucket b
    python -m benchmarks.ceiling --spawn-server --size-mib 256   # start our server in a child process

GB below means 1e9 bytes.  Client CPU is this process's user+system time
(``time.process_time``), so run the server in another process; with
``--spawn-server`` or ``--server-pid`` the server's CPU s/GB is reported too.
One untimed warm-up round runs first by default (see ``measure_ceiling``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import uuid
from typing import Any, Dict, List, Optional

import aiohttp

from .harness import Server, cpu_seconds


async def _check(resp: aiohttp.ClientResponse, what: str) -> None:
    if resp.status >= 300:
        raise RuntimeError(f"{what}: HTTP {resp.status}: {(await resp.text())[:500]}")


async def _run_pool(n_tasks: int, concurrency: int, fn: Any) -> None:
    """``concurrency`` workers pull task indices; the first failure cancels the rest."""
    it = iter(range(n_tasks))

    async def worker() -> None:
        for i in it:
            await fn(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_tasks))))


async def _round(s: aiohttp.ClientSession, base: str, bucket: str, view: memoryview, dview: memoryview,
                 part_bytes: int, range_bytes: int, concurrency: int, server_pid: Optional[int]) -> Dict[str, Any]:
    """One multipart upload of ``view`` and one ranged read-back into ``dview``, each timed."""
    size = len(view)
    url = f"{base}/{bucket}/ceiling/{uuid.uuid4().hex}"
    n_parts = (size + part_bytes - 1) // part_bytes
    n_ranges = (size + range_bytes - 1) // range_bytes
    etags: List[str] = [""] * n_parts
    out: Dict[str, Any] = {"parts": n_parts, "ranges": n_ranges}

    async def put_part(i: int) -> None:
        chunk = view[i * part_bytes: min(size, (i + 1) * part_bytes)]
        async with s.put(url, params={"partNumber": str(i + 1), "uploadId": upload_id}, data=chunk) as r:
            await _check(r, f"UploadPart {i + 1}")
            etags[i] = r.headers["ETag"]

    async def get_range(i: int) -> None:
        start, end = i * range_bytes, min(size, (i + 1) * range_bytes)
        async with s.get(url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
            await _check(r, f"GET range {i}")
            pos = start
            while True:
                c = await r.content.readany()
                if not c:
                    break
                dview[pos: pos + len(c)] = c
                pos += len(c)
            if pos != end:
                raise RuntimeError(f"range {i}: got {pos - start} bytes, wanted {end - start}")

    for phase in ("upload", "download"):
        srv0 = cpu_seconds(server_pid) if server_pid else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        if phase == "upload":
            async with s.post(url + "?uploads") as r:
                await _check(r, "CreateMultipartUpload")
                m = re.search(r"<UploadId>([^<]+)</UploadId>", await r.text())
                assert m, "no UploadId"
                upload_id = m.group(1)
            await _run_pool(n_parts, concurrency, put_part)
            xml = "<CompleteMultipartUpload>" + "".join(
                f"<Part><PartNumber>{i + 1}</PartNumber><ETag>{e}</ETag></Part>" for i, e in enumerate(etags)
            ) + "</CompleteMultipartUpload>"
            async with s.post(url, params={"uploadId": upload_id}, data=xml.encode()) as r:
                await _check(r, "CompleteMultipartUpload")
                body = await r.text()
                if "<Error>" in body:  # S3 may answer 200 with an error body
                    raise RuntimeError(f"CompleteMultipartUpload: {body[:500]}")
        else:
            await _run_pool(n_ranges, concurrency, get_range)
        secs, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        gb = size / 1e9
        out[f"{phase}_s"] = round(secs, 3)
        out[f"{phase}_GBps"] = round(gb / secs, 3)
        out[f"{phase}_client_cpu_s_per_GB"] = round(cpu / gb, 3)
        srv1 = cpu_seconds(server_pid) if server_pid else None
        if srv0 is not None and srv1 is not None:
            out[f"{phase}_server_cpu_s_per_GB"] = round((srv1 - srv0) / gb, 3)
    async with s.delete(url) as r:
        await _check(r, "DeleteObject")
    return out


async def _measure(endpoint_url: str, bucket: str, data: bytes, part_bytes: int, range_bytes: int,
                   concurrency: int, server_pid: Optional[int], warmup: int) -> Dict[str, Any]:
    base = endpoint_url.rstrip("/")
    dest = bytearray(len(data))  # preallocated destination, touched before timing
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     skip_auto_headers=("Content-Type",)) as s:
        async with s.put(f"{base}/{bucket}") as r:  # create; "already exists" (409) is fine
            if r.status >= 300 and r.status != 409:
                await _check(r, "CreateBucket")
        rounds = [await _round(s, base, bucket, memoryview(data), memoryview(dest), part_bytes, range_bytes,
                               concurrency, server_pid) for _ in range(warmup + 1)]
    if dest != data:
        raise RuntimeError("downloaded bytes differ from uploaded bytes")
    out: Dict[str, Any] = {"endpoint_url": endpoint_url, "size_bytes": len(data), "part_bytes": part_bytes,
                           "range_bytes": range_bytes, "concurrency": concurrency, "warmup_rounds": warmup}
    out.update(rounds[-1])
    if warmup:
        out["first_round"] = {k: v for k, v in rounds[0].items() if "GB" in k}
    return out


def make_data(size_bytes: int) -> bytes:
    """Incompressible-looking bytes, made fast (1 MiB of randomness repeated)."""
    block = os.urandom(1 << 20)
    reps = size_bytes // len(block) + 1
    return (block * reps)[:size_bytes]


def measure_ceiling(endpoint_url: str, bucket: str, size_bytes: int, part_bytes: int = 16 << 20,
                    concurrency: int = 16, range_bytes: int = 16 << 20,
                    server_pid: Optional[int] = None, warmup: int = 1) -> Dict[str, Any]:
    """Upload ``size_bytes`` as a multipart object, read it back with ranged GETs; return a dict
    of GB/s and client CPU s/GB per phase (server CPU s/GB too when ``server_pid`` is given).

    ``warmup`` untimed rounds come first (their GB/s are kept under ``first_round``): on
    this project's VMs the first touch of fresh memory costs 2-3 CPU-s/GB on either side,
    a one-off cost that would otherwise swamp the steady-state numbers."""
    data = make_data(size_bytes)
    return asyncio.run(_measure(endpoint_url, bucket, data, part_bytes, range_bytes, concurrency, server_pid,
                                warmup))


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint-url", help="S3 endpoint; omit with --spawn-server")
    p.add_argument("--spawn-server", action="store_true", help="run testkit.s3server in a child process")
    p.add_argument("--server-pid", type=int, help="pid of the server, to report its CPU per GB")
    p.add_argument("--bucket", default="ceiling")
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--part-mib", type=int, default=16)
    p.add_argument("--range-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (fresh memory is slow to touch)")
    a = p.parse_args(argv)
    server = Server("fast") if a.spawn_server else None
    if server:
        a.endpoint_url, a.server_pid = server.url, server.pid
    elif not a.endpoint_url:
        p.error("give --endpoint-url or --spawn-server")
    try:
        res = measure_ceiling(a.endpoint_url, a.bucket, a.size_mib << 20, a.part_mib << 20, a.concurrency,
                              a.range_mib << 20, a.server_pid, a.warmup)
    finally:
        if server:
            server.stop()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
