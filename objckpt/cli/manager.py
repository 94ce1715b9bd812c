"""``objckpt ls | rm | prune``: commands on a manager root and its steps.

* ``ls ROOT``: the steps of a manager root from its index (one or two GETs,
  no LIST), with size, date and metadata; a prefix without an index (plain
  ``objckpt.save`` checkpoints) or ``--objects`` prints the raw listing of
  committed checkpoints instead.  ``ls`` never writes, not even to repair.
  With ``--local-dir DIR`` (a tiered manager's ``local_dir``, ``{node}`` replaced
  by ``--node`` or this host's node name) a TIERS column says where each step
  is: ``object`` (indexed under ROOT), ``local`` (this node's folder holds it
  whole) or ``local-partial`` (its manifest and some files: the rest is on other
  nodes), and steps held only locally are listed too.
* ``rm URI``: :func:`objckpt.delete` (every object the checkpoint owns,
  :mod:`objckpt.ops.owned`: a Lightning marker first, the manifest, then its
  objects); when URI is a step of a manager root, the step leaves the index first.
* ``prune ROOT --keep-last M --keep-every K [--keep-best N --best-key KEY]
  [--keep-every-seconds T] [--dry-run]``: apply a retention policy once (same rules and order as the
  manager's background retention), over every committed step: steps missing
  from the index (saves killed before their index update, plain ``objckpt.save``
  into ``step-<10 digits>``) are adopted first (one LIST).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

from ..errors import NotFoundError
from ..format import keys
from ..manager.index import HEAD_NAME, INDEX_DIR, StepIndex
from ..manager.retention import RetentionPolicy, RetentionPolicyError
from ..manager.worker import apply_retention
from ..ops.delete import delete_checkpoint
from ..runtime import loop as _runtime
from ..storage import open_store, split_uri
from .options import add_command, storage_options


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def natural_key(name: str) -> tuple[list[Any], str]:
    """Sort key that orders the numbers in names as numbers: ``step-5`` before ``step-10``
    (text order puts ``step-10`` first), ``epoch=2-step=50`` before ``epoch=10-step=5``.
    The runs of digits compare as integers, the text between them as text (``re.split``
    alternates the two, so like compares with like); ties (``step-05``, ``step-5``) by text."""
    parts: list[Any] = [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))]
    return parts, name


def raw_listing(uri: str, options: Optional[dict[str, Any]]) -> list[str]:
    """URIs of the committed checkpoints under ``uri`` (one LIST): every ``.../manifest.json``,
    numbers in their names in numeric order (:func:`natural_key`)."""
    store, prefix = open_store(uri, options)
    scheme, root, _ = split_uri(uri)
    base = "/" if scheme == "file" else f"{scheme}://{root}/"
    objs = _runtime.run(store.list(prefix.rstrip("/") + "/" if prefix else ""))
    found = sorted((o.key[: -len(keys.MANIFEST_NAME) - 1] for o in objs if o.key.endswith("/" + keys.MANIFEST_NAME)),
                   key=natural_key)
    return [base + p for p in found]


def _print_listing(uri: str, options: Optional[dict[str, Any]]) -> int:
    found = raw_listing(uri, options)
    for u in found:
        print(u)
    if not found:  # on stderr: the listing on stdout stays one URI a line
        print(f"no committed checkpoint under {uri.rstrip('/')}/", file=sys.stderr)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """A manager root's steps from its index; else (or ``--objects``) the checkpoints under a prefix."""
    opts = storage_options(args)
    local_root = _local_root(args)
    if getattr(args, "objects", False):
        return _print_listing(args.uri, opts)
    store, prefix = open_store(args.uri, opts)
    doc = _runtime.run(StepIndex(store, prefix).read(repair=False))
    if doc.seq < 0 and not doc.steps and local_root is None:  # not a manager root: the plain listing
        return _print_listing(args.uri, opts)  # (with --local-dir: its steps, though none is drained yet)
    if getattr(args, "json", False):
        print(json.dumps([e.to_json() for e in doc.steps], indent=1))
        return 0
    local = None if local_root is None else _local_steps(local_root, StepIndex(store, prefix).naming.parse, args.uri)
    if local is None:
        print(f"{'STEP':>10}  {'SIZE':>9}  {'SAVED (UTC)':<19}  METADATA")
    else:
        print(f"{'STEP':>10}  {'SIZE':>9}  {'SAVED (UTC)':<19}  {'TIERS':<20}  METADATA")
    indexed = {e.step: e for e in doc.steps}
    for step in sorted(set(indexed) | set(local or {})):
        e = indexed.get(step)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.time)) if e and e.time else "?"
        size, meta = (_size(e.bytes), json.dumps(e.metadata, sort_keys=True)) if e else ("?", "")
        if local is None:
            print(f"{step:>10}  {size:>9}  {when:<19}  {meta}")
            continue
        tiers = ([local[step]] if step in local else []) + (["object"] if e else [])
        print(f"{step:>10}  {size:>9}  {when:<19}  {','.join(tiers):<20}  {meta}")
    print(f"{len(doc.steps)} step(s) under {args.uri.rstrip('/')}/" + ("" if doc.seq >= 0 else
          " (no index yet: read from the manifests)")
          + ("" if local is None else f"; {len(local)} in {args.local_dir}"))
    return 0


def _local_root(args: argparse.Namespace) -> Optional[Path]:
    """This node's folder of ``--local-dir`` ({node} resolved as the manager does); None
    without it.  A folder that is not there is an error naming it, not an empty column."""
    if not getattr(args, "local_dir", None):
        return None
    from ..tier.local import resolve_dir
    from ..tier.topology import node_name

    root = resolve_dir(args.local_dir, node_name(args.node))
    if not root.is_dir():
        raise NotFoundError(f"--local-dir {args.local_dir!r}: {str(root)!r} is not a directory on this node")
    return root


def _local_steps(root: Path, parse: Any, uri: str) -> dict[int, str]:
    """Each step of ``uri``'s manager in this node's local tier -> ``local`` / ``local-partial``:
    the step folders whose owner record names that root, as the manager itself sees them
    (another root's steps in a shared folder are left out, with a warning)."""
    from ..tier.local import scan
    from ..tier.owner import Owned, Owner, canonical_root

    owned = Owned(root, parse, Owner(canonical_root(uri)))
    return {s: "local" if held.complete else "local-partial" for s, held in scan(root, owned).items()}


def cmd_rm(args: argparse.Namespace) -> int:
    """Delete one checkpoint; a step of a manager root leaves its index first."""
    store, prefix = open_store(args.uri, storage_options(args))
    parent, _, last = prefix.rpartition("/")
    if _runtime.run(store.head(keys.join(parent, INDEX_DIR, HEAD_NAME))) is not None:
        index = StepIndex(store, parent)  # the index says how its steps' folders are named
        doc = _runtime.run(index.read())
        step = index.naming.parse(last)
        if step is not None and step in doc.step_numbers():
            _runtime.run(index.remove({step}))
            print(f"removed step {step} from the index of {parent or '/'}")
    report = _runtime.run(delete_checkpoint(store, prefix, args.uri))
    print(f"deleted {args.uri}: " + ("Lightning marker, " if report.marker else "")
          + f"manifest and {len(report.deleted)} object(s)"
          + (" (manifest was unreadable: run gc for its objects)" if report.manifest_unreadable else ""))
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """Apply a retention policy to a manager root once; exit 1 when a step could not be deleted."""
    policy = RetentionPolicy(args.keep_last, args.keep_every, args.keep_best, args.best_key, args.best_mode,
                             getattr(args, "keep_every_seconds", None))
    if not policy.deletes:
        raise RetentionPolicyError("prune: give at least one of --keep-last, --keep-every, --keep-best, "
                                   "--keep-every-seconds")
    root = args.uri.rstrip("/")
    store, prefix = open_store(root, storage_options(args))
    index = StepIndex(store, prefix)
    before = _runtime.run(index.survey()).step_numbers()
    report = apply_retention(index, policy, root, dry_run=args.dry_run, adopt=True)
    verb = "would delete" if args.dry_run else "deleted"
    for s in report.deleted:
        print(f"  {verb} step {s} ({root}/{index.naming.name(s)})")
    for s, why in report.failed.items():
        print(f"  could not delete step {s}: {why}")
    kept = [s for s in before if s not in report.deleted and s not in report.failed]
    print(f"{verb} {len(report.deleted)} of {len(before)} step(s); kept {kept}")
    return 1 if report.failed else 0


def add_ls(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "ls", "list the steps of a manager root (or the checkpoints under a prefix)", cmd_ls)
    p.add_argument("uri")
    p.add_argument("--objects", action="store_true",
                   help="the raw listing of committed checkpoints instead of the manager's index")
    p.add_argument("--json", action="store_true", help="the index entries as JSON")
    p.add_argument("--local-dir", default=None,
                   help="a tiered manager's local_dir ({node}: this node's name): adds a TIERS column")
    p.add_argument("--node", default=None, help="the node name for {node} in --local-dir (default: "
                                                "$OBJCKPT_NODE, else the hostname)")


def add_rm(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "rm", "delete one checkpoint (manifest first, then its objects)", cmd_rm)
    p.add_argument("uri")


def add_prune(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "prune", "delete the steps of a manager root that a retention policy drops",
                    cmd_prune)
    p.add_argument("uri", metavar="ROOT")
    p.add_argument("--keep-last", type=int, help="keep the M newest steps")
    p.add_argument("--keep-every", type=int, help="also keep every step divisible by K")
    p.add_argument("--keep-best", type=int, help="also keep the N best steps by --best-key")
    p.add_argument("--best-key", help="metadata key ranking steps for --keep-best")
    p.add_argument("--best-mode", choices=("max", "min"), default="max", help="higher (max) or lower is better")
    p.add_argument("--keep-every-seconds", type=float,
                   help="also keep one step per this many seconds of save time (e.g. 3600: one an hour)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
