"""What filesystem a node folder is on, from ``/proc/self/mounts``: whether its files are
memory (no fsync, no page cache apart from themselves), and whether that memory comes in
4 KiB pages or huge ones.

The second matters for restores: the kernel copies a tmpfs file out to a reader page by
page, and with 4 KiB pages that copy ran at 0.70-0.72x of a memcpy of the same bytes on
the 2-core VM, against 0.90-0.99x from a tmpfs mounted ``huge=within_size`` or
``huge=always``; a restore from the local tier took 0.040-0.041 s there against
0.048-0.050 s on ``/dev/shm`` (benchmarks/bench_crc32c.py, docs/tiering.md).  objckpt cannot choose how the user's
``/dev/shm`` is mounted; it says so once, at the manager's start, where it would help.
"""
from __future__ import annotations

import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("objckpt.manager")

_VOLATILE_FS = frozenset({"tmpfs", "ramfs"})
#: tmpfs ``huge=`` values under which a file's memory is taken in huge pages where it can be
_HUGE = frozenset({"always", "within_size", "advise"})


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mounts``: mount point, filesystem type, options."""

    point: str
    fstype: str
    options: tuple[str, ...]

    def option(self, name: str) -> Optional[str]:
        for o in self.options:
            key, _, value = o.partition("=")
            if key == name:
                return value
        return None


def parse_mounts(text: str) -> list[Mount]:
    """The mounts of a ``/proc/self/mounts`` text, longest mount point first (the first
    that contains a path is the one it is on)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append(Mount(parts[1].replace("\\040", " "), parts[2], tuple(parts[3].split(","))))
    return sorted(out, key=lambda m: len(m.point), reverse=True)


def mount_of(path: "str | os.PathLike[str]", mounts: Optional[list[Mount]] = None) -> Optional[Mount]:
    """The mount ``path`` is on (None where ``/proc/self/mounts`` cannot be read)."""
    if mounts is None:
        try:
            with open("/proc/self/mounts") as f:
                mounts = parse_mounts(f.read())
        except OSError:
            return None
    real = os.path.realpath(path)
    for m in mounts:
        if real == m.point or real.startswith(m.point.rstrip("/") + "/"):
            return m
    return None


def volatile(path: pathlib.Path) -> bool:
    """Whether ``path`` (a folder) is on a filesystem that lives in memory (tmpfs, ramfs):
    its files need no fsync and do not sit in a page cache apart from themselves."""
    m = mount_of(path)
    return m is not None and m.fstype in _VOLATILE_FS


def small_pages_hint(path: "str | os.PathLike[str]", mounts: Optional[list[Mount]] = None) -> Optional[str]:
    """A sentence for the log when ``path`` is on a tmpfs that keeps files in 4 KiB pages
    (no ``huge=`` option, or ``huge=never``), else None."""
    m = mount_of(path, mounts)
    if m is None or m.fstype != "tmpfs" or (m.option("huge") or "never") in _HUGE:
        return None
    return (f"the local tier {str(path)!r} is on a tmpfs ({m.point}) that keeps files in 4 KiB pages; "
            "restores read it ~20% faster from a tmpfs mounted with huge=within_size "
            "(e.g. mount -t tmpfs -o size=...,huge=within_size tmpfs /mnt/ckpt; docs/tiering.md)")
