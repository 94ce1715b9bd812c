"""``objckpt gc | cp | diff | verify``: commands on checkpoints as a whole (``info``: :mod:`.info`).

The work itself is :mod:`objckpt.ops` (copy, diff, gc, block-crc verify); these functions
turn flags into calls and results into lines on stdout, every tensor count as
:class:`objckpt.format.manifest.TensorCount` prints it.  ``diff`` exits 1 when the
checkpoints differ.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from .options import add_command, bar, json_object, second_store_options, storage_options

MB = 1 << 20


def cmd_gc(args: argparse.Namespace) -> int:
    """Delete unreferenced blobs and index objects, abort stale multipart uploads."""
    from ..ops.gc import collect_garbage
    from ..runtime import loop as _runtime
    from ..storage import open_store

    store, prefix = open_store(args.uri, storage_options(args))
    r = _runtime.run(collect_garbage(store, prefix, grace=args.grace_hours * 3600, dry_run=args.dry_run))
    verb = "would delete" if args.dry_run else "deleted"
    markers = set(r.markers)
    for k in r.deleted:
        print(f"  {verb} {k}" + (" (Lightning marker of a deleted checkpoint)" if k in markers else ""))
    for k in r.aborted_uploads:
        print(f"  {'would abort' if args.dry_run else 'aborted'} upload {k}")
    for k in r.unreadable:
        print(f"  left alone (manifest unreadable): {k}")
    print(f"{r.checkpoints} checkpoint(s); {verb} {len(r.deleted)} object(s), {r.deleted_bytes / 1e6:.2f} MB; "
          f"{len(r.aborted_uploads)} upload(s); {r.kept_young} younger than {args.grace_hours:g} h kept")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy a checkpoint between stores, verified, committed last at DST."""
    from ..ops.copy import copy

    with bar(args, "cp") as pb:
        r = copy(args.src, args.dst, storage_options=storage_options(args),
                 dst_storage_options=second_store_options(args, args.dst_storage_options, args.dst_endpoint_url),
                 overwrite=args.overwrite, part_size=int(args.part_size_mb * MB),
                 memory_bytes=int(args.memory_mb * MB), progress=pb.update)
    print(f"copied {r.src} -> {r.dst}: {r.count}, {r.bytes / 1e6:.2f} MB in {r.blobs} blob(s), "
          f"{r.chunks_verified} chunk crc(s) verified, {r.objects} object(s) written in {r.seconds:.2f} s")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """Exit 0 when the checkpoints hold the same keys and values, 1 when they differ."""
    from ..ops.diff import diff

    with bar(args, "diff") as pb:
        r = diff(args.a, args.b, storage_options=storage_options(args),
                 b_storage_options=second_store_options(args, args.b_storage_options), progress=pb.update)
    for title, items in (("only in A", r.only_a), ("only in B", r.only_b), ("dtype/shape differ", r.mismatched),
                         ("values differ", r.values_differing)):
        for k in items:
            print(f"{title}: {k}")
    for k in r.differing:
        print(f"tensor differs: {k} (decided by {r.decided[k]})")
    by = {how: sum(1 for k, v in r.decided.items() if v == how and k not in r.differing) for how in ("crc", "bytes")}
    counts = f"{r.a_tensors}" if r.a_tensors == r.b_tensors else f"A {r.a_tensors}, B {r.b_tensors}"
    print(f"{'equal' if r.equal else 'different'}: {counts}; {len(r.decided) - len(r.differing)} tensor(s) equal "
          f"({by['crc']} by crc without reading, {by['bytes']} by bytes), {len(r.differing)} differ, "
          f"{len(r.only_a)} only in A, {len(r.only_b)} only in B, {len(r.mismatched)} dtype/shape, "
          f"{len(r.values_differing)} value(s); {r.bytes_read / 1e6:.2f} MB read")
    return 0 if r.equal else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every stored byte and check every crc32c, block crcs included, a batch
    of tensors (``--memory-mb``) at a time."""
    from ..load.session import ReadSession
    from ..ops.verify import verify_checkpoint

    t = time.perf_counter()
    session = ReadSession(args.uri, storage_options(args))
    m = session.inspect(True)  # chunks listed: the bytes to verify
    with bar(args, "verify", sum(m.nbytes(k) for k in m.tensors if session.stored_key(k) == k)) as pb:
        rep = verify_checkpoint(session, int(args.memory_mb * MB), pb.update)
    print(f"ok: {rep.count}, {rep.nbytes / 1e6:.2f} MB, {rep.block_crcs} block crc(s) verified in "
          f"{time.perf_counter() - t:.2f} s")
    return 0


def add_gc(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "gc", "delete what failed or replaced saves left under a prefix", cmd_gc)
    p.add_argument("uri")
    p.add_argument("--grace-hours", type=float, default=6.0,
                   help="leave garbage younger than this (saves in progress); default 6")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")


def add_cp(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "cp", "copy a checkpoint between stores, verifying every chunk crc", cmd_cp)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint committed at DST")
    p.add_argument("--dst-endpoint-url", help="S3 endpoint of DST when it differs from SRC's")
    p.add_argument("--dst-storage-options", type=json_object, metavar="JSON",
                   help="storage options of DST over the common ones")
    p.add_argument("--part-size-mb", type=float, default=16.0, help="bytes per ranged GET / part (default 16)")
    p.add_argument("--memory-mb", type=float, default=256.0, help="parts held in memory at once (default 256)")


def add_diff(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "diff",
                    "compare two checkpoints (exit 0 equal, 1 different); by chunk crcs when it can", cmd_diff)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--b-storage-options", type=json_object, metavar="JSON",
                   help="storage options of B over the common ones")


def add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "verify", "read every byte of a checkpoint and check its crc32c", cmd_verify)
    p.add_argument("uri")
    p.add_argument("--memory-mb", type=float, default=512.0, help="tensor bytes read at once (default 512)")
