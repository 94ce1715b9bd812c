"""The ``objckpt`` parser and its dispatch: build the sub-commands, run one, turn errors into exit status 2.

Each group of commands lives in its own module and adds its parsers here
(``add_<command>(sub, common)``); the order below is the order ``objckpt --help``
lists them in.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ..errors import ObjckptError
from . import bench, checkpoints, convert, demo, info, manager
from .options import common_options

#: every sub-command, in the order of ``objckpt --help``
ADDERS = (demo.add_demo, bench.add_bench, convert.add_convert, convert.add_export, info.add_info,
          manager.add_ls, checkpoints.add_gc, checkpoints.add_cp, checkpoints.add_diff, checkpoints.add_verify,
          manager.add_rm, manager.add_prune)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one sub-command per adder, each with the storage flags."""
    p = argparse.ArgumentParser(prog="objckpt", description="Fast, safe PyTorch checkpoints on object storage")
    sub = p.add_subparsers(dest="cmd", required=True)
    common = common_options()
    for add in ADDERS:
        add(sub, common)
    return p


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
    """Run one command; returns its exit status (2 for an objckpt error, with one line on stderr)."""
    args = build_parser().parse_args(argv)
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
