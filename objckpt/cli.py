"""Command line: ``objckpt demo | ls | info | verify | cp | diff | gc | rm | prune | convert | export | bench``.

The storage flags every command takes and the data-moving commands live in
:mod:`objckpt.cli_ops`; this module registers the commands and runs one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Sequence

from .cli_ops import cmd_cp, cmd_diff, cmd_verify, common_options, register, storage_options

__all__ = ["main", "cmd_demo", "cmd_info", "cmd_ls", "cmd_verify", "cmd_gc", "cmd_bench", "cmd_cp", "cmd_diff"]


def _opts(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """storage_options from the flags every command takes (see :func:`objckpt.cli_ops.storage_options`)."""
    return storage_options(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.uri, _opts(args), d_model=args.d_model, layers=args.layers)


def cmd_info(args: argparse.Namespace) -> int:
    from .api import inspect

    m = inspect(args.uri, storage_options=_opts(args))
    if args.json:
        from .format.manifest import to_json_obj

        print(json.dumps(to_json_obj(m), indent=1))
        return 0
    created = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m.created))
    print(f"{args.uri}\n  format v{m.format_version}, written by {m.writer or '?'} at {created}")
    print(f"  {len(m.tensors)} tensors, {m.nbytes() / 1e6:.2f} MB in {len(m.blobs)} blob(s); metadata {json.dumps(m.metadata)}")
    width = max((len(k) for k in m.tensors), default=10)
    for k, t in m.tensors.items():
        extra = f" -> {t.alias_of}" if t.alias_of else f" {len(t.chunks)} chunk(s)"
        print(f"  {k:<{width}} {t.dtype:<14} {str(list(t.shape)):<20}{extra}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """A manager root's steps from its index; else (or ``--objects``) the checkpoints under a prefix."""
    from .manager.cli_commands import cmd_ls as run

    return run(args, _opts)


def cmd_gc(args: argparse.Namespace) -> int:
    """Delete unreferenced blobs and index objects, abort stale multipart uploads."""
    from .runtime import loop as _runtime
    from .ops.gc import collect_garbage
    from .storage import open_store

    store, prefix = open_store(args.uri, _opts(args))
    r = _runtime.run(collect_garbage(store, prefix, grace=args.grace_hours * 3600, dry_run=args.dry_run))
    verb = "would delete" if args.dry_run else "deleted"
    for k in r.deleted:
        print(f"  {verb} {k}")
    for k in r.aborted_uploads:
        print(f"  {'would abort' if args.dry_run else 'aborted'} upload {k}")
    for k in r.unreadable:
        print(f"  left alone (manifest unreadable): {k}")
    print(f"{r.checkpoints} checkpoint(s); {verb} {len(r.deleted)} object(s), {r.deleted_bytes / 1e6:.2f} MB; "
          f"{len(r.aborted_uploads)} upload(s); {r.kept_young} younger than {args.grace_hours:g} h kept")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .integrations.commands import convert_command

    return convert_command(args.src, args.dst, args.src_format, args.dst_format, _opts(args), args.overwrite)


def cmd_export(args: argparse.Namespace) -> int:
    from .integrations.commands import export_command

    return export_command(args.uri, args.dir, args.format, args.prefix, args.dtype, args.max_shard_size, _opts(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    from .logs import wanted

    return bench_main(args.uri, _opts(args), args.size_mb, args.repeat, progress=wanted(args.no_progress))


def _stdout_gone() -> int:
    """The reader of stdout went away (``objckpt info ... | head``): stop quietly, as Unix tools
    do.  What is still buffered goes to /dev/null, so the flush at exit raises nothing either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to redirect
        pass
    return 141  # 128 + SIGPIPE: what a shell reports for a tool that the closed pipe stopped


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="objckpt", description="Fast, safe PyTorch checkpoints on object storage")
    sub = p.add_subparsers(dest="cmd", required=True)
    common = common_options()

    d = sub.add_parser("demo", parents=[common], help="save, restore and verify a small transformer's state")
    d.add_argument("--uri", help="s3://bucket/path, file:///dir or a path (default: embedded moto S3)")
    d.add_argument("--d-model", type=int, default=384)
    d.add_argument("--layers", type=int, default=4)
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", parents=[common], help="measure save/load speed against a target (default: embedded moto S3)")
    b.add_argument("uri", nargs="?", help="a prefix to write a scratch checkpoint under (deleted afterwards)")
    b.add_argument("--size-mb", type=int, default=256)
    b.add_argument("--repeat", type=int, default=3)
    b.set_defaults(fn=cmd_bench)

    cv = sub.add_parser("convert", parents=[common],
                        help="convert DCP / torch.save / safetensors <-> objckpt, streaming")
    cv.add_argument("src", help="DCP directory (path or fsspec URL), torch.save file, safetensors file or "
                               "directory, or an objckpt checkpoint")
    cv.add_argument("dst", help="objckpt URI, or (from objckpt) a DCP directory / safetensors directory")
    cv.add_argument("--from", dest="src_format", default="auto", help="auto|objckpt|dcp|torch|safetensors")
    cv.add_argument("--to", dest="dst_format", default="auto", help="auto|objckpt|dcp|safetensors")
    cv.add_argument("--overwrite", action="store_true", help="replace an existing destination checkpoint")
    cv.set_defaults(fn=cmd_convert)

    ex = sub.add_parser("export", parents=[common],
                        help="export a checkpoint's tensors as Hugging Face sharded safetensors")
    ex.add_argument("uri")
    ex.add_argument("dir", help="local directory to write model*.safetensors (+ index) into")
    ex.add_argument("--format", default="safetensors", choices=["safetensors"])
    ex.add_argument("--prefix", default="", help="export keys under this prefix only, stripped (e.g. model.)")
    ex.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    ex.add_argument("--max-shard-size", default="5GB", help="per shard file, e.g. 5GB, 500MB (default 5GB)")
    ex.set_defaults(fn=cmd_export)

    for name, fn, helptext in [
        ("info", cmd_info, "show a checkpoint's manifest"),
        ("ls", cmd_ls, "list the steps of a manager root (or the checkpoints under a prefix)"),
        ("gc", cmd_gc, "delete what failed or replaced saves left under a prefix"),
    ]:
        sp = sub.add_parser(name, parents=[common], help=helptext)
        sp.add_argument("uri")
        if name == "info":
            sp.add_argument("--json", action="store_true", help="print the raw manifest")
        if name == "ls":
            from .manager.cli_commands import add_ls_flags

            add_ls_flags(sp)
        if name == "gc":
            sp.add_argument("--grace-hours", type=float, default=6.0,
                            help="leave garbage younger than this (saves in progress); default 6")
            sp.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
        sp.set_defaults(fn=fn)
    register(sub, common)
    from .manager.cli_commands import register as register_manager_commands

    register_manager_commands(sub, _opts, common)

    args = p.parse_args(argv)
    from .errors import ObjckptError

    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # a reader gone (``| head``) shows here, not as a traceback at exit
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except (ObjckptError, ValueError) as e:  # ValueError: a bad storage option, an S3 URI without a bucket
        print(f"objckpt: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a local file a command reads or writes itself (export's directory): no traceback
        print(f"objckpt: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
