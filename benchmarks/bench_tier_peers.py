"""Peer replication (objckpt.tier.peers.replicate) against what gloo moves between two ranks.

    python -m benchmarks.bench_tier_peers --mib 64 --repeat 1        # quick check
    python -m benchmarks.bench_tier_peers                            # 256 MiB a rank, median of 3

Two gloo ranks standing for two nodes (``OBJCKPT_NODE``), each with its share in its
node's folder (``--dir``, default a temporary directory; ``/dev/shm`` for a tmpfs),
replicas=1: each rank sends its share to the other and receives the other's, at the
same time.  The baseline, in the same run and the same processes: a plain
``dist.isend``/``dist.irecv`` of the same number of bytes in both directions at once
(one tensor each way, nothing read from or written to files).  Each repeat times both
between barriers, interleaved; the shares are written untimed (so they are read from
the page cache), and the received replicas are deleted between repeats.

Also per rank: the peak RSS growth during ``replicate`` (``VmHWM`` reset before it) and the
machine's page cache (``Cached``), ``Shmem`` and ``Dirty`` growth across it (``/proc/meminfo``:
both ranks together).  Received files are fsynced and dropped from the page cache
(``POSIX_FADV_DONTNEED``), so on a disk the cache should not grow by the bytes received;
on tmpfs the files *are* memory (``Shmem`` grows by them).

**Restore** (``--restore``, on by default): a ``CheckpointManager`` per rank (``local_dir``
with ``{node}`` under ``--dir``, ``replicas=1``, ``persist_every=1``, the in-memory S3 server
of testkit/ in the parent process as object storage) saves one step of ``--mib`` MiB a rank
(eight float32 tensors of unaligned sizes) and drains it.  Each repeat then deletes node1's
folder and times ``CheckpointManager.load`` into existing, touched tensors on both ranks
(rank 1's share and the rest of the step come from rank 0 over the tier's gloo group:
``repair``, then the read from the local folder), against a plain one-way ``dist.send`` of
the bytes that restore moved, in the same processes, interleaved, and against the same
send with its bytes read from a file in the sender's folder first (``gloo from a file``:
what any restore from a file-kept replica pays at least).  Then every local folder
is deleted and the same load comes from S3 (the same tensors; every rank reads its share).
Every restore is checked bit-identical.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any, Optional

from . import harness as h


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, rest = line.split(":", 1)
                out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import pathlib

    import torch
    import torch.distributed as dist

    from objckpt.distributed.comm import get_comm
    from objckpt.tier.peers import replicate
    from objckpt.tier.topology import NODE_ENV, Topology

    os.environ[NODE_ENV] = f"node{rank}"
    comm = get_comm()
    topo = Topology.build(comm)
    step = pathlib.Path(cfg["dir"]) / f"node{rank}" / "step-1"
    nbytes, file_bytes = cfg["mib"] * h.MiB, cfg["file_mib"] * h.MiB
    files = []
    gen = torch.Generator().manual_seed(rank)
    for i, off in enumerate(range(0, nbytes, file_bytes)):
        rel = f"blobs/a/r{rank:05d}-{i:04d}.bin"
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        data = torch.randint(0, 256, (min(file_bytes, nbytes - off),), dtype=torch.uint8, generator=gen)
        (step / rel).write_bytes(data.numpy().tobytes())
        files.append(rel)
    other = 1 - rank
    send = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    rows: list[dict[str, Any]] = []
    for rep in range(cfg["repeat"] + 1 if cfg.get("replicate", True) else 0):  # the first round warms up, untimed
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        works = [dist.isend(send, dst=other), dist.irecv(recv, src=other)]
        for w in works:
            w.wait()
        dist.barrier()
        base_s, base_cpu = time.perf_counter() - t0, time.process_time() - c0
        mem0 = meminfo()
        with h.PeakRss() as rss:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            budget = {"memory_bytes": cfg["memory"]} if cfg["memory"] else {}
            report = replicate(comm, topo, step, files, 1, piece_bytes=cfg["piece_mib"] * h.MiB, **budget)
            dist.barrier()
            rep_s, rep_cpu = time.perf_counter() - t0, time.process_time() - c0
        mem1 = meminfo()
        received = [(pathlib.Path(cfg["dir"]) / f"node{rank}" / "step-1" / f"blobs/a/r{other:05d}-{i:04d}.bin")
                    for i in range(len(files))]
        ok = all(p.stat().st_size == min(file_bytes, nbytes - i * file_bytes) for i, p in enumerate(received))
        dist.barrier()
        for p in received:
            p.unlink()
        dist.barrier()
        if rep == 0:
            continue
        rows.append({"baseline_s": base_s, "replicate_s": rep_s, "baseline_cpu_s": base_cpu,
                     "replicate_cpu_s": rep_cpu, "data_phase_s": report.ranks[rank].seconds,
                     "rss_delta": rss.delta, "buffer_bytes": report.ranks[rank].buffer_bytes,
                     "cached_delta": mem1.get("Cached", 0) - mem0.get("Cached", 0),
                     "shmem_delta": mem1.get("Shmem", 0) - mem0.get("Shmem", 0),
                     "dirty_delta": mem1.get("Dirty", 0) - mem0.get("Dirty", 0), "verified_sizes": ok})
    everyone = comm.all_gather_object(rows)
    restore = _restore(rank, comm, cfg) if cfg["restore"] else []
    return {"ranks": everyone, "restore": comm.all_gather_object(restore)}


def _share(rank: int, nbytes: int) -> dict[str, Any]:
    import torch

    n = nbytes // 4 // 8
    g = torch.Generator().manual_seed(100 + rank)
    # unaligned sizes, per-rank keys (each rank's share is its own)
    return {f"rank{rank}.layer{i}.w": torch.randn(n + 13 * i, generator=g) for i in range(8)}


def _gloo_from_file(rank: int, path: Any, buf: Any, piece: int = 16 * h.MiB) -> float:
    """Seconds for gloo to move ``buf.numel()`` bytes from a file in the senders' folder to
    rank 1: on rank 0 a reading thread fills three reused 16 MiB buffers (``preadv``, from the
    page cache) while the calling thread sends them, two sends in flight; rank 1 receives
    into ``buf`` (touched).  The plain send of a tensor already in memory plus the one step
    any restore from a file-kept replica adds: the bytes leave the page cache first.  No
    protocol, no planning, no checksums.  (Sending from a mapping of the file instead of
    reading it measured the same on tmpfs: the page-table work replaces the copy.)"""
    import queue
    import threading

    import torch
    import torch.distributed as dist

    n = int(buf.numel())
    if rank == 0 and (not path.exists() or path.stat().st_size != n):
        with open(path, "wb") as f:
            f.write(os.urandom(min(n, h.MiB)) * (n // h.MiB) + os.urandom(n % h.MiB))
    offs = list(range(0, n, piece))
    stage = [torch.empty(piece, dtype=torch.uint8) for _ in range(3)] if rank == 0 else []
    free: "queue.Queue[int]" = queue.Queue()
    full: "queue.Queue[tuple[int, int]]" = queue.Queue()
    for i in range(len(stage)):
        free.put(i)
    dist.barrier()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY) if rank == 0 else -1

    def reader() -> None:
        for off in offs:
            slot = free.get()
            s = stage[slot][:min(piece, n - off)]
            os.preadv(fd, [memoryview(s.numpy())], off)
            full.put((slot, off))

    th = threading.Thread(target=reader, daemon=True) if rank == 0 else None
    try:
        if th is not None:
            th.start()
        reqs: list[tuple[Any, int]] = []
        for off in offs:
            size = min(piece, n - off)
            if len(reqs) >= 2:
                req, slot = reqs.pop(0)
                req.wait()
                if slot >= 0:
                    free.put(slot)
            if rank == 0:
                slot, _ = full.get()
                reqs.append((dist.isend(stage[slot][:size], 1), slot))
            else:
                reqs.append((dist.irecv(buf[off:off + size], 0), -1))
        for req, _ in reqs:
            req.wait()
        if th is not None:
            th.join()
    finally:
        if fd >= 0:
            os.close(fd)
    dist.barrier()
    return time.perf_counter() - t0


def _restore(rank: int, comm: Any, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """A node's folder deleted, the manager's restore from its peer, against gloo moving the
    same bytes; then every folder deleted, the same restore from S3."""
    import pathlib

    import torch
    import torch.distributed as dist

    import objckpt

    opts = {"endpoint_url": cfg["endpoint"], "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"}
    base = pathlib.Path(cfg["dir"]) / "restore"
    state = _share(rank, cfg["mib"] * h.MiB)
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    m = objckpt.CheckpointManager("s3://bench/peers", storage_options=opts, node_override=f"n{rank}",
                                  tier=objckpt.TierSettings(local_dir=str(base / "{node}"), replicas=1,
                                                            persist_every=1, local_keep=2))
    rows: list[dict[str, Any]] = []
    buf: Optional[torch.Tensor] = None
    try:
        m.save(1, state)
        m.wait()
        for rep in range(cfg["repeat"] + 1):  # the first round warms up, untimed
            dist.barrier()
            if rank == 1:
                shutil.rmtree(base / "n1", ignore_errors=True)  # node n1 replaced: its folder is gone
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            res = m.load(dst)
            dist.barrier()
            peer_s, peer_cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = res.tiers == {0: "local", 1: "peer"} and all(torch.equal(dst[k], v) for k, v in state.items())
            for v in dst.values():
                v.zero_()
            report = getattr(m._tiers, "last_restore", None)
            if report is not None:  # what the restore says it received from peers (held in memory)
                moved = report.bytes_moved
                fetch_s = getattr(report, "fetch_seconds", None)
            else:  # the code before: the files repaired into n1's folder
                moved = sum(p.stat().st_size for p in (base / "n1").rglob("*") if p.is_file()) if rank == 1 else 0
                moved, fetch_s = comm.all_gather_object(moved)[1], None
            if buf is None or buf.numel() != moved:  # touched before timing, on both ranks
                buf = torch.empty(moved, dtype=torch.uint8)
                buf.random_(0, 256) if rank == 0 else buf.zero_()
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, dst=1)
            else:
                dist.recv(buf, src=0)
            dist.barrier()
            base_s = time.perf_counter() - t0
            file_s = _gloo_from_file(rank, base / "gloo-source.bin", buf)
            if rep:
                rows.append({"what": "peer", "restore_s": peer_s, "restore_cpu_s": peer_cpu, "gloo_s": base_s,
                             "gloo_file_s": file_s, "bytes_moved": moved, "fetch_s": fetch_s, "verified": ok})
        for rep in range(cfg["repeat"]):
            dist.barrier()
            shutil.rmtree(base / f"n{rank}", ignore_errors=True)  # every node's folder is gone
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            res = m.load(dst)
            dist.barrier()
            s3_s, s3_cpu = time.perf_counter() - t0, time.process_time() - c0
            ok = res.source == "object" and all(torch.equal(dst[k], v) for k, v in state.items())
            for v in dst.values():
                v.zero_()
            rows.append({"what": "s3", "restore_s": s3_s, "restore_cpu_s": s3_cpu, "verified": ok})
    finally:
        m.close()
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="each rank's share (MiB)")
    ap.add_argument("--file-mib", type=int, default=64, help="size of each file of the share (MiB)")
    ap.add_argument("--piece-mib", type=int, default=16, help="replicate's piece size (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--memory-mib", type=int, default=None,
                    help="replicate's memory budget (MiB; default TIER_COPY_BYTES)")
    ap.add_argument("--no-restore", dest="restore", action="store_false",
                    help="skip the restore measurements (peer, S3)")
    ap.add_argument("--no-replicate", dest="replicate", action="store_false",
                    help="skip the replication measurements (restores only)")
    ap.add_argument("--dir", default=None, help="parent of the node folders (default: a temporary directory)")
    ap.add_argument("--out", default=h.result_path("tier-peers"))
    args = ap.parse_args(argv)
    parent = args.dir or tempfile.mkdtemp(prefix="bench-tier-peers-")
    work = tempfile.mkdtemp(prefix="run-", dir=parent)
    cfg = {"mib": args.mib, "file_mib": args.file_mib, "piece_mib": args.piece_mib, "repeat": args.repeat,
           "dir": work, "restore": args.restore, "replicate": args.replicate, "endpoint": None,
           "memory": args.memory_mib * h.MiB if args.memory_mib else None}
    server = None
    try:
        if args.restore:
            import boto3
            from testkit.s3server import S3Server

            server = S3Server()
            server.start()
            cfg["endpoint"] = server.endpoint_url
            boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="testing",
                         aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket="bench")
        out = h.spawn_gloo(2, _rank, cfg, timeout=900)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(parent, ignore_errors=True)
    per_rank = out["ranks"]
    nbytes = args.mib * h.MiB
    fs = "tmpfs" if os.path.realpath(parent).startswith("/dev/shm") else "disk/tempdir"
    summary: dict[str, Any] = {"share_mib": args.mib, "piece_mib": args.piece_mib, "target": fs}
    if args.replicate:
        summary.update(_replicate_summary(per_rank, args, nbytes, parent))
    restore_summary = _restore_summary(out["restore"], nbytes) if args.restore else {}
    summary["restore"] = restore_summary
    if restore_summary:
        p, s3 = restore_summary["peer"], restore_summary["s3"]
        h.log(h.md_table(
            ["restore of a lost node's share", "bytes moved", "gloo send of them", "gloo from a file",
             "restore", "restore / gloo", "restore / gloo from a file", "restore from S3", "S3 / gloo"],
            [[f"{args.mib} MiB a rank", f"{p['bytes_moved_mib']:.0f} MiB", f"{h.fmt(p['gloo_gbps'])} GB/s",
              f"{h.fmt(p['gloo_file_gbps'])} GB/s ({h.fmt(p['file_floor_ratio'], '{:.2f}x')})",
              f"{h.fmt(p['restore_gbps'])} GB/s ({h.fmt(p['restore_s'])} s)", h.fmt(p["ratio"], "{:.2f}x"),
              h.fmt(p["ratio_to_gloo_file"], "{:.2f}x"),
              f"{h.fmt(s3['restore_gbps'])} GB/s ({h.fmt(s3['restore_s'])} s)", h.fmt(s3["ratio"], "{:.2f}x")]]))
    path = h.write_results(args.out, {"environment": h.environment(), "config": cfg | {"dir": fs},
                                      "summary": summary, "ranks": per_rank,
                                      "restore": out["restore"]})
    print(path)


def _replicate_summary(per_rank: list[list[dict[str, Any]]], args: Any, nbytes: int, parent: str) -> dict[str, Any]:
    base = h.median(max(r[i]["baseline_s"] for r in per_rank) for i in range(args.repeat))
    rep = h.median(max(r[i]["replicate_s"] for r in per_rank) for i in range(args.repeat))
    fs = "tmpfs" if os.path.realpath(parent).startswith("/dev/shm") else "disk/tempdir"
    summary = {
        "share_mib": args.mib, "piece_mib": args.piece_mib, "target": fs,
        "baseline_gbps": nbytes / base / 1e9 if base else None,
        "replicate_gbps": nbytes / rep / 1e9 if rep else None,
        "ratio": base / rep if base and rep else None,
        "baseline_cpu_s_per_gib": h.median(x["baseline_cpu_s"] for r in per_rank for x in r) * h.GiB / nbytes,
        "replicate_cpu_s_per_gib": h.median(x["replicate_cpu_s"] for r in per_rank for x in r) * h.GiB / nbytes,
        "rss_delta_mib": max((x["rss_delta"] or 0) for r in per_rank for x in r) / h.MiB,
        "buffer_mib": max(x["buffer_bytes"] for r in per_rank for x in r) / h.MiB,
        "cached_delta_mib": h.median(x["cached_delta"] for x in per_rank[0]) / h.MiB,
        "shmem_delta_mib": h.median(x["shmem_delta"] for x in per_rank[0]) / h.MiB,
        "verified": all(x["verified_sizes"] for r in per_rank for x in r),
    }
    h.log(h.md_table(
        ["share", "gloo isend/irecv", "replicate", "replicate / gloo", "CPU s/GiB gloo, replicate", "peak RSS Δ (rank max)", "piece buffers",
         "page cache Δ", "Shmem Δ"],
        [[f"{args.mib} MiB", f"{h.fmt(summary['baseline_gbps'])} GB/s", f"{h.fmt(summary['replicate_gbps'])} GB/s",
          h.fmt(summary["ratio"], "{:.2f}x"),
          f"{h.fmt(summary['baseline_cpu_s_per_gib'])}, {h.fmt(summary['replicate_cpu_s_per_gib'])}",
          f"{summary['rss_delta_mib']:.0f} MiB",
          f"{summary['buffer_mib']:.0f} MiB", f"{summary['cached_delta_mib']:.0f} MiB",
          f"{summary['shmem_delta_mib']:.0f} MiB"]]))
    return summary


def _restore_summary(per_rank: list[list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    """Medians over repeats of the slower rank's time (each rank's restore ends at a barrier)."""
    peer = [[x for x in r if x["what"] == "peer"] for r in per_rank]
    s3 = [[x for x in r if x["what"] == "s3"] for r in per_rank]
    restore = h.median(max(r[i]["restore_s"] for r in peer) for i in range(len(peer[0])))
    gloo = h.median(max(r[i]["gloo_s"] for r in peer) for i in range(len(peer[0])))
    gloo_file = h.median(max(r[i]["gloo_file_s"] for r in peer) for i in range(len(peer[0])))
    moved = peer[0][0]["bytes_moved"]
    s3_s = h.median(max(r[i]["restore_s"] for r in s3) for i in range(len(s3[0])))
    return {
        "peer": {"bytes_moved_mib": moved / h.MiB, "restore_s": restore, "gloo_s": gloo,
                 "restore_gbps": moved / restore / 1e9, "gloo_gbps": moved / gloo / 1e9, "ratio": gloo / restore,
                 "gloo_file_s": gloo_file, "gloo_file_gbps": moved / gloo_file / 1e9,
                 "ratio_to_gloo_file": gloo_file / restore, "file_floor_ratio": gloo / gloo_file,
                 "restore_cpu_s_rank1": h.median(x["restore_cpu_s"] for x in peer[1]),
                 "fetch_s_rank1": (h.median(x["fetch_s"] for x in peer[1])
                                   if all(x.get("fetch_s") is not None for x in peer[1]) else None)},
        # S3: every rank reads its own share (the whole step between them), against the same gloo rate
        "s3": {"restore_s": s3_s, "restore_gbps": 2 * nbytes / s3_s / 1e9,
               "ratio": (2 * nbytes / s3_s) / (moved / gloo)},
        "verified": all(x["verified"] for r in per_rank for x in r),
    }


if __name__ == "__main__":
    main()
