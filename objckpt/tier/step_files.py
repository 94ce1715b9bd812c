"""A committed local step's file list, kept next to its manifest so that nobody decodes the
manifest just to learn which files the step has.

Why: the tiered restore's plan (:func:`objckpt.tier.local.scan`), ``latest_step()``,
``objckpt ls`` and every drain need each local step's files (the manifest, the blobs,
the rank indexes, and which rank wrote which).  Those names are in the manifest, but a
model of many tensors has a manifest of megabytes (3,200 tensors: 1.2 MB, ~0.1 s to
decode and check, more in a process with a large heap), and the scan decoded every
step the folder keeps.

So after a step is committed in a node's folder, that node's first rank writes
``files.json`` beside the manifest (:func:`write`): the file names, and the size and
crc32c of the manifest's bytes they were taken from.  A reader (:func:`read`) trusts the
list only when the manifest it just read has that size and crc32c, and the list's own
seal (:mod:`objckpt.format.sealed_json`) checks; otherwise, or when the file is absent
(a step committed by an older release, a rank killed between the commit and the list),
it decodes the manifest as before.  The list is a hint, never the commit: the manifest
still decides whether a step exists, and a load still reads and checks the manifest
itself.  It is written to a temporary name and renamed, so a reader never sees half of it.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from typing_extensions import TypeGuard

from ..checksum import crc32c
from ..errors import ObjckptError
from ..format import keys
from ..format import manifest as _manifest
from ..format.sealed_json import load_json, seal, verify
from ..runtime import loop as _runtime
from ..storage.local import LocalStore

log = logging.getLogger("objckpt.manager")

#: the list's name in a step folder (beside ``manifest.json``; no checkpoint object has it)
FILES_NAME = "files.json"
_FORMAT = "objckpt-local-files"
_VERSION = 1
_INDEX = re.compile(r"r(\d{5,})\.index\.json$")


@dataclass(frozen=True)
class StepFiles:
    """The files of one committed step, as its manifest names them."""

    #: every file a folder must hold for the step to be whole: the manifest, blobs, rank indexes
    needed: tuple[str, ...]
    #: rank -> the files that rank wrote (its blobs not spread, its rank index)
    by_rank: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def of_rank(self, rank: int) -> list[str]:
        return list(self.by_rank.get(rank, ()))


def of_manifest(m: _manifest.Manifest) -> StepFiles:
    """The file list of the step ``m`` commits."""
    return StepFiles(tuple(needed_files(m)), {r: tuple(files_of(m, r)) for r in range(m.world_size)})


def files_of(m: _manifest.Manifest, rank: int) -> list[str]:
    """The files (relative to the step folder) ``rank`` wrote: its blobs and rank index."""
    out = [b.name for b in m.blobs if b.rank == rank and not b.spread]
    for r in m.rank_indexes:
        hit = _INDEX.search(r.name)
        if hit and int(hit.group(1)) == rank and not r.spread:
            out.append(r.name)
    return out


def needed_files(m: _manifest.Manifest) -> list[str]:
    """Every file a step folder must hold to be complete: the manifest, blobs, rank indexes."""
    return [keys.MANIFEST_NAME, *(b.name for b in m.blobs), *(r.name for r in m.rank_indexes)]


class _Bad(ValueError):
    pass


def write(step_dir: Path, manifest_bytes: bytes, files: StepFiles) -> bool:
    """Write ``step_dir``'s list (taken from the manifest whose stored bytes are
    ``manifest_bytes``) through the local store's one writer (a temporary, then a rename);
    False, logged, when it cannot be written (the readers then decode the manifest:
    nothing is lost but time)."""
    body = {"format": _FORMAT, "version": _VERSION, "manifest_size": len(manifest_bytes),
            "manifest_crc32c": crc32c(manifest_bytes), "needed": list(files.needed),
            "by_rank": {str(r): list(names) for r, names in sorted(files.by_rank.items())}}
    try:
        _runtime.run(LocalStore(str(step_dir)).put(FILES_NAME, seal(body)))
        return True
    except (OSError, ObjckptError) as e:
        log.warning("objckpt: cannot write the file list of %s (%s); restores will decode its manifest instead",
                    step_dir, e)
        return False


def read(step_dir: Path, manifest_bytes: bytes) -> Optional[StepFiles]:
    """``step_dir``'s list when it is there, intact and taken from exactly ``manifest_bytes``
    (the manifest's stored bytes, as just read); None otherwise (decode the manifest)."""
    try:
        raw = (step_dir / FILES_NAME).read_bytes()
    except OSError:
        return None
    try:
        obj = load_json(raw, _Bad)
        if not isinstance(obj, dict):
            raise _Bad("not an object")
        verify(obj, _Bad, required=True)
        if obj.get("format") != _FORMAT or obj.get("version") != _VERSION:
            return None  # another release's list: decode the manifest
        if obj.get("manifest_size") != len(manifest_bytes) or obj.get("manifest_crc32c") != crc32c(manifest_bytes):
            return None  # taken from another manifest (the step folder was reused): decode this one
        needed, by_rank = obj.get("needed"), obj.get("by_rank")
        if not _names(needed) or not isinstance(by_rank, dict):
            raise _Bad("malformed")
        ranks: dict[int, tuple[str, ...]] = {}
        for r, names in by_rank.items():
            if not (isinstance(r, str) and r.isdigit() and _names(names)):
                raise _Bad("malformed")
            ranks[int(r)] = tuple(names)
        return StepFiles(tuple(needed), ranks)
    except _Bad as e:
        log.warning("objckpt: the file list of %s is unusable (%s); decoding its manifest instead", step_dir, e)
        return None


def _names(v: object) -> "TypeGuard[list[str]]":
    """A list of relative file names inside a step folder (no absolute path, no ``..``)."""
    return isinstance(v, list) and all(
        isinstance(n, str) and n and not n.startswith("/") and ".." not in n.split("/") for n in v)
