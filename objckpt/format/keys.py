"""Object key names: where a checkpoint's objects live under its prefix.

``<prefix>/manifest.json``            the commit: present <=> checkpoint exists
``<prefix>/blobs/<attempt>/r<rank>-<n>.bin``  tensor bytes of one save attempt
``<prefix>/blobs/<attempt>/r<rank>.index.json``  a rank's chunk records (format v2)

The attempt id is unique per save call, so a retry or an overwrite never
rewrites bytes that a committed manifest points to.
"""
from __future__ import annotations

import re
import secrets
import time

MANIFEST_NAME = "manifest.json"
BLOB_DIR = "blobs"


def join(prefix: str, *parts: str) -> str:
    prefix = prefix.strip("/")
    rest = "/".join(p.strip("/") for p in parts if p)
    return f"{prefix}/{rest}" if prefix else rest


def manifest_key(prefix: str) -> str:
    return join(prefix, MANIFEST_NAME)


def new_attempt_id() -> str:
    """Time-ordered and random: sortable in listings, never reused."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(6)}"


def blob_name(attempt: str, rank: int, index: int, directory: str = BLOB_DIR) -> str:
    """Blob path relative to the checkpoint prefix (what the manifest stores);
    ``directory`` is ``spread`` for the spread key layout (:mod:`objckpt.format.spread`)."""
    return f"{directory}/{attempt}/r{rank:05d}-{index:04d}.bin"


def index_name(attempt: str, rank: int, directory: str = BLOB_DIR) -> str:
    """A rank's index object (format v2), relative to the checkpoint prefix."""
    return f"{directory}/{attempt}/r{rank:05d}.index.json"


#: a multi-rank save's decision record under ``blobs/<attempt>/`` (objckpt.save.decision)
DECISION_FILE = "decision.json"


def decision_name(attempt: str) -> str:
    """The decision record of ``attempt``, relative to the checkpoint prefix."""
    return f"{BLOB_DIR}/{attempt}/{DECISION_FILE}"


def plain_segment(name: str) -> bool:
    """One ordinary path component: not empty, not ``.``/``..``, no separators or NUL
    (an attempt id read from a possibly damaged manifest must be one before it names keys)."""
    return name not in ("", ".", "..") and not any(ch in name for ch in "/\\\0")


def attempt_of(blob_rel: str) -> str:
    """The attempt id in a blob or index name (``blobs/<attempt>/...``, ``spread/<attempt>/...``)."""
    parts = blob_rel.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] in (BLOB_DIR, "spread") else ""


def is_safe_object_name(name: object) -> bool:
    """Whether ``name`` (a blob or rank-index name read from a manifest) is a plain path
    under ``blobs/``: a hostile manifest must not make a reader or gc touch
    ``../../etc/passwd`` or another checkpoint's objects, nor pass NUL to the OS."""
    if not isinstance(name, str) or not name.startswith(BLOB_DIR + "/") or len(name) > 1024:
        return False
    if _UNSAFE_CHAR.search(name) is not None:  # NUL, a control character or a backslash
        return False
    # no empty, "." or ".." component; found by substring in C, not by a Python step per
    # character (a manifest of 65,536 ranks names 131,072 objects: docs/s3-scale.md §6)
    framed = "/" + name + "/"
    return "//" not in framed and "/./" not in framed and "/../" not in framed


#: a character no object name read from a manifest may hold
_UNSAFE_CHAR = re.compile(r"[\x00-\x1f\\]")
