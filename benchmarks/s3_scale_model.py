"""Request-rate model of a large save and restore on S3, default vs spread key layout.

Pure arithmetic (no I/O): what docs/s3-scale.md tabulates.  Per-rank request
counts come from objckpt's own packer (:func:`objckpt.planning.pack.plan_save`)
and its S3 writer's rules (one PutObject for a one-part blob, else
CreateMultipartUpload + UploadPart per part + CompleteMultipartUpload; one
PutObject per rank index; reads merged and capped at 16 MiB per ranged GET).
Every assumption is a field of :class:`Assumptions`.

    python -m benchmarks.s3_scale_model            # the markdown table
    python -m benchmarks.s3_scale_model --ranks 4096 --digits 3
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Optional

from objckpt.planning.pack import TensorSpec, plan_save

MiB = 1 << 20
GiB = 1 << 30
#: S3's published rates per partitioned prefix
PUT_LIMIT = 3500  # PUT/COPY/POST/DELETE per second
GET_LIMIT = 5500  # GET/HEAD per second
MAX_READ_REQUEST = 16 * MiB  # objckpt.load.ranged_get.read_ranges: max_request
THROTTLE_WAIT_S = (26.0, 53.0)  # RetryPolicy defaults: expected / worst total backoff of 12 attempts
#: rank 0's requests for the manifest (objckpt.save.commit): a HEAD (is it committed already?),
#: the create-only PUT and a GET reading it back (a store that ignores If-None-Match is caught)
MANIFEST_REQUESTS = 3


@dataclass(frozen=True)
class Assumptions:
    """What the table assumes (defaults: a 70B model with Adam, fully sharded)."""

    ranks: int = 16384
    params: float = 70e9
    #: bf16 weights (2) + fp32 master weights (4) + Adam m and v (4 + 4)
    bytes_per_param: int = 14
    #: tensors (shards) each rank holds; only changes how packing rounds, not the totals
    tensors_per_rank: int = 64
    blob_size: int = 1 * GiB  # SaveOptions.blob_size
    part_size: int = 16 * MiB  # SaveOptions.part_size
    #: upload and download throughput of one rank (a GPU's share of its node's S3 bandwidth)
    rank_write_bps: float = 1.0 * GiB
    rank_read_bps: float = 1.0 * GiB
    rtt_s: float = 0.03  # one S3 request round trip (first byte)
    #: rank indexes one rank fetches on restore (same topology, fully sharded: its own)
    index_gets_per_rank: int = 1
    #: hex digits of the spread prefix (16 ** digits prefixes)
    digits: int = 2

    @property
    def total_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def rank_bytes(self) -> int:
        return int(self.total_bytes / self.ranks)


@dataclass(frozen=True)
class RankRequests:
    """One rank's requests in a save or restore, by kind."""

    blobs: int
    parts: int
    writes: int  # PUT + POST (create, upload-part, complete, put)
    index_puts: int
    reads: int  # ranged GETs of blob bytes
    index_gets: int


def rank_requests(a: Assumptions) -> RankRequests:
    """One rank's requests, from objckpt's packer on ``tensors_per_rank`` equal shards."""
    n = max(1, a.tensors_per_rank)
    row = 4096  # bytes per row: shards are cut into runs of rows of at most part_size
    rows = max(1, a.rank_bytes // n // row)
    specs = [TensorSpec(f"t{i}", (rows, row // 4), 4) for i in range(n)]
    plan = plan_save(specs, blob_bytes=a.blob_size, part_bytes=a.part_size, chunk_bytes=a.part_size)
    writes = sum(1 if len(b.parts) <= 1 else len(b.parts) + 2 for b in plan.blobs)
    reads = sum(math.ceil(b.size / MAX_READ_REQUEST) for b in plan.blobs)
    return RankRequests(len(plan.blobs), sum(len(b.parts) for b in plan.blobs), writes + 1, 1, reads,
                        a.index_gets_per_rank)


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    op: str  # "save" / "restore"
    layout: str
    requests: int  # of the kind the limit applies to, all ranks
    window_s: float  # how long the ranks take when S3 does not throttle
    busiest_prefix_rps: float  # requests per second on the busiest partitioned prefix
    limit: int
    #: the least time the busiest prefix needs at the limit (seconds)
    floor_s: float
    #: the manifest GET of every rank: one key, one partition, whatever the layout
    hot_key_floor_s: Optional[float] = None

    @property
    def over(self) -> float:
        return self.busiest_prefix_rps / self.limit


def table(a: Assumptions) -> list[Row]:
    """Save and restore rows for the default layout and the spread layout."""
    r = rank_requests(a)
    prefixes = min(16**a.digits, a.ranks)
    per_prefix = math.ceil(a.ranks / prefixes)  # ranks per spread prefix (buckets are filled evenly)
    save_window = a.rank_bytes / a.rank_write_bps + 3 * a.rtt_s  # create, parts, complete / index
    load_window = a.rank_bytes / a.rank_read_bps + 3 * a.rtt_s  # manifest, index, ranged GETs
    save_total = a.ranks * r.writes + MANIFEST_REQUESTS  # + rank 0's at the checkpoint folder
    load_total = a.ranks * (r.reads + r.index_gets)
    hot = a.ranks / GET_LIMIT
    rows = []
    for layout, ranks_in_prefix in (("default", a.ranks), (f"spread, {prefixes} prefixes", per_prefix)):
        save_busy = ranks_in_prefix * r.writes
        load_busy = ranks_in_prefix * (r.reads + r.index_gets)
        rows.append(Row("save", layout, save_total, save_window, save_busy / save_window, PUT_LIMIT,
                        save_busy / PUT_LIMIT))
        rows.append(Row("restore", layout, load_total, load_window, load_busy / load_window, GET_LIMIT,
                        load_busy / GET_LIMIT, hot))
    return rows


def markdown(a: Assumptions) -> str:
    r = rank_requests(a)
    head = (f"{a.ranks} ranks, {a.total_bytes / 1e12:.2f} TB ({a.rank_bytes / MiB:.1f} MiB per rank): per rank "
            f"{r.blobs} blob(s), {r.parts} part(s), {r.writes} write requests (incl. 1 rank-index PUT), "
            f"{r.reads} ranged GET(s) + {r.index_gets} index GET(s) + 1 manifest GET.\n\n")
    lines = ["| op | layout | requests | window (s) | busiest prefix (req/s) | limit | × limit | "
             "time at the limit (s) | manifest hot key (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in table(a):
        hot = f"{row.hot_key_floor_s:.1f}" if row.hot_key_floor_s is not None else "–"
        lines.append(f"| {row.op} | {row.layout} | {row.requests:,} | {row.window_s:.3f} | "
                     f"{row.busiest_prefix_rps:,.0f} | {row.limit:,} | {row.over:,.1f} | {row.floor_s:.2f} | {hot} |")
    return head + "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=Assumptions.ranks)
    p.add_argument("--params", type=float, default=Assumptions.params)
    p.add_argument("--digits", type=int, default=Assumptions.digits)
    p.add_argument("--rank-gibps", type=float, default=1.0, help="per-rank throughput, GiB/s (both ways)")
    args = p.parse_args(argv)
    a = replace(Assumptions(), ranks=args.ranks, params=args.params, digits=args.digits,
                rank_write_bps=args.rank_gibps * GiB, rank_read_bps=args.rank_gibps * GiB)
    print(markdown(a), end="")


if __name__ == "__main__":
    main()
