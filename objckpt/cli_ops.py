"""The command line's shared options and the data-moving commands: ``cp``, ``diff``, ``verify``.

Every command takes the same storage flags (one parent parser): ``--endpoint-url``,
``--region``, ``--profile`` and ``--storage-options JSON`` (any key of
``storage_options``; the flags win over the JSON), merged by :func:`storage_options`,
and ``--no-progress``.  Commands that move data draw a progress bar on stderr
when stdout and stderr are terminals (:mod:`objckpt.logs`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any, Optional

from .logs import Progress, wanted


def _json_object(text: str) -> dict[str, Any]:
    """argparse type of ``--storage-options``: a JSON object, else a usage error saying why."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"concurrency\": 16}}', got {text!r}")
    return obj


def common_options() -> argparse.ArgumentParser:
    """The parent parser of every command."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("storage (every command)")
    g.add_argument("--endpoint-url", help="S3 endpoint (default: AWS config / AWS_ENDPOINT_URL)")
    g.add_argument("--region", help="S3 region (storage option region_name)")
    g.add_argument("--profile", help="AWS profile of the shared config/credentials files")
    g.add_argument("--storage-options", type=_json_object, metavar="JSON",
                   help='more storage options as a JSON object, e.g. \'{"concurrency": 64, "checksums": false}\'')
    g.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stdout is no terminal)")
    return p


def storage_options(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """``--storage-options`` with ``--endpoint-url``, ``--region`` and ``--profile`` over it."""
    opts: dict[str, Any] = dict(getattr(args, "storage_options", None) or {})
    for flag, key in (("endpoint_url", "endpoint_url"), ("region", "region_name"), ("profile", "profile")):
        value = getattr(args, flag, None)
        if value:
            opts[key] = value
    return opts or None


def dst_storage_options(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """``cp``'s destination: the common options, then ``--dst-storage-options`` and ``--dst-endpoint-url``."""
    opts = dict(storage_options(args) or {})
    opts.update(args.dst_storage_options or {})
    if args.dst_endpoint_url:
        opts["endpoint_url"] = args.dst_endpoint_url
    return opts or None


def bar(args: argparse.Namespace, label: str, total: int = 0, unit: str = "B") -> Progress:
    return Progress(total, label, enabled=wanted(getattr(args, "no_progress", False)), unit=unit)


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy a checkpoint between stores, verified, committed last at DST."""
    from .ops.copy import copy

    with bar(args, "cp") as pb:
        r = copy(args.src, args.dst, storage_options=storage_options(args),
                 dst_storage_options=dst_storage_options(args), overwrite=args.overwrite, part_size=int(args.part_size_mb * (1 << 20)),
                 memory_bytes=int(args.memory_mb * (1 << 20)), progress=pb.update)
    print(f"copied {r.src} -> {r.dst}: {r.tensors} tensors, {r.bytes / 1e6:.2f} MB in {r.blobs} blob(s), "
          f"{r.chunks_verified} chunk crc(s) verified, {r.objects} object(s) written in {r.seconds:.2f} s")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """Exit 0 when the checkpoints hold the same keys and values, 1 when they differ."""
    from .ops.diff import diff

    b_opts = dict(storage_options(args) or {})
    b_opts.update(args.b_storage_options or {})
    with bar(args, "diff") as pb:
        r = diff(args.a, args.b, storage_options=storage_options(args), b_storage_options=b_opts or None,
                 progress=pb.update)
    for title, items in (("only in A", r.only_a), ("only in B", r.only_b), ("dtype/shape differ", r.mismatched),
                         ("values differ", r.values_differing)):
        for k in items:
            print(f"{title}: {k}")
    for k in r.differing:
        print(f"tensor differs: {k} (decided by {r.decided[k]})")
    by = {how: sum(1 for k, v in r.decided.items() if v == how and k not in r.differing) for how in ("crc", "bytes")}
    print(f"{'equal' if r.equal else 'different'}: {len(r.decided) - len(r.differing)} tensor(s) equal "
          f"({by['crc']} by crc without reading, {by['bytes']} by bytes), {len(r.differing)} differ, "
          f"{len(r.only_a)} only in A, {len(r.only_b)} only in B, {len(r.mismatched)} dtype/shape, "
          f"{len(r.values_differing)} value(s); {r.bytes_read / 1e6:.2f} MB read")
    return 0 if r.equal else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every stored byte and check every crc32c, block crcs included, a batch
    of tensors (``--memory-mb``) at a time."""
    from .api import inspect, read
    from .ops.verify import verify_block_crcs
    from .runtime.memory import Budget

    t = time.perf_counter()
    opts = storage_options(args)
    m = inspect(args.uri, storage_options=opts)
    stored = [k for k, e in m.tensors.items() if e.alias_of is None]
    sizes = [m.nbytes(k) for k in stored]
    blocks = 0
    with bar(args, "verify", sum(sizes)) as pb:
        for batch in Budget(max(int(args.memory_mb * (1 << 20)), 1)).batches(sizes):
            keys = [stored[i] for i in batch]
            got = read(args.uri, keys=keys, storage_options=opts)
            part = dataclasses.replace(m, tensors={k: m.tensors[k] for k in keys})
            blocks += verify_block_crcs(part, lambda k: got[k])  # a full read checks whole-chunk crcs only
            pb.update(sum(sizes[i] for i in batch))
    print(f"ok: {len(m.tensors)} tensors, {m.nbytes() / 1e6:.2f} MB, {blocks} block crc(s) verified in "
          f"{time.perf_counter() - t:.2f} s")
    return 0


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``cp``, ``diff`` and ``verify`` to the subcommands."""
    c = sub.add_parser("cp", parents=[common], help="copy a checkpoint between stores, verifying every chunk crc")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint committed at DST")
    c.add_argument("--dst-endpoint-url", help="S3 endpoint of DST when it differs from SRC's")
    c.add_argument("--dst-storage-options", type=_json_object, metavar="JSON",
                   help="storage options of DST over the common ones")
    c.add_argument("--part-size-mb", type=float, default=16.0, help="bytes per ranged GET / part (default 16)")
    c.add_argument("--memory-mb", type=float, default=256.0, help="parts held in memory at once (default 256)")
    c.set_defaults(fn=cmd_cp)

    d = sub.add_parser("diff", parents=[common],
                       help="compare two checkpoints (exit 0 equal, 1 different); by chunk crcs when it can")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--b-storage-options", type=_json_object, metavar="JSON",
                   help="storage options of B over the common ones")
    d.set_defaults(fn=cmd_diff)

    v = sub.add_parser("verify", parents=[common], help="read every byte of a checkpoint and check its crc32c")
    v.add_argument("uri")
    v.add_argument("--memory-mb", type=float, default=512.0, help="tensor bytes read at once (default 512)")
    v.set_defaults(fn=cmd_verify)
