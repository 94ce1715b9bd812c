"""The flags every command takes and the few helpers the commands share.

Every command takes the same storage flags (one parent parser): ``--endpoint-url``,
``--region``, ``--profile`` and ``--storage-options JSON`` (any key of
``storage_options``; the flags win over the JSON), merged by :func:`storage_options`,
and ``--no-progress``.  Commands that move data draw a progress bar on stderr
when stdout and stderr are terminals (:mod:`objckpt.logs`).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Optional

from ..logs import Progress, wanted

#: what a command runs: the parsed flags in, the process exit status out
Command = Callable[[argparse.Namespace], int]


def json_object(text: str) -> dict[str, Any]:
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
    g.add_argument("--storage-options", type=json_object, metavar="JSON",
                   help='more storage options as a JSON object, e.g. \'{"concurrency": 64, "checksums": false}\'')
    g.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stdout is no terminal)")
    return p


def add_command(sub: Any, common: argparse.ArgumentParser, name: str, helptext: str,
                fn: Command) -> argparse.ArgumentParser:
    """One sub-command with the storage flags, run by ``fn``; the caller adds its own arguments."""
    p: argparse.ArgumentParser = sub.add_parser(name, parents=[common], help=helptext)
    p.set_defaults(fn=fn)
    return p


def storage_options(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """``--storage-options`` with ``--endpoint-url``, ``--region`` and ``--profile`` over it."""
    opts: dict[str, Any] = dict(getattr(args, "storage_options", None) or {})
    for flag, key in (("endpoint_url", "endpoint_url"), ("region", "region_name"), ("profile", "profile")):
        value = getattr(args, flag, None)
        if value:
            opts[key] = value
    return opts or None


def second_store_options(args: argparse.Namespace, extra: Optional[dict[str, Any]],
                         endpoint_url: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The options of a command's second store (``cp``'s DST, ``diff``'s B): the common
    ones, then that store's own JSON (``extra``), then its own endpoint."""
    opts = dict(storage_options(args) or {})
    opts.update(extra or {})
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    return opts or None


def bar(args: argparse.Namespace, label: str, total: int = 0, unit: str = "B") -> Progress:
    """The progress bar of a command (drawn only on terminals, never with ``--no-progress``)."""
    return Progress(total, label, enabled=wanted(getattr(args, "no_progress", False)), unit=unit)
