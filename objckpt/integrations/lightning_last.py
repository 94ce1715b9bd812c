"""``fit(ckpt_path="last")`` with the objckpt plugin: the newest committed checkpoint of a directory.

Lightning resolves ``"last"`` to the ``last*.ckpt`` file with the newest modification
time.  ``ModelCheckpoint`` saves a step's top-k checkpoint first, then ``last.ckpt``; with
async saves (``ObjckptCheckpointIO(async_save=True)``, or Lightning's ``AsyncCheckpointIO``)
both are still uploading when training goes on, so a job killed after the top-k save
committed and before ``last.ckpt``'s did leaves ``last.ckpt`` one save interval (or more)
behind.  A resume from it is exact, but repeats the steps in between.

So, with the plugin, ``"last"`` means: of the checkpoints the plugin wrote in the
``ModelCheckpoint``'s directory, the one whose manifest committed last (the manifest's
commit time, ``created``; a ``last*.ckpt`` wins a tie).  A checkpoint counts when

* its manifest is committed (a save killed before its commit left none: skipped);
* its tree holds the plugin's type notes (a checkpoint some other code put there is not a
  Lightning checkpoint: skipped);
* on object stores, its marker object exists: Lightning checks the path with fsspec
  (``exists``, ``modified``), which sees only the marker.  A save killed between its
  commit and its marker leaves a checkpoint that loads by its path but is skipped here,
  with a warning naming it.

Cost: one listing of the directory and one GET per checkpoint in it (``save_top_k`` + 1,
typically), on every rank.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from ..api import inspect as _inspect
from ..errors import NotFoundError, ObjckptError
from ..format.subtree import NOTHING, select

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Committed:
    """A checkpoint of the directory that counts: its path, commit time, and whether it is a ``last*`` one."""

    path: str
    created: float
    is_last: bool


def _listing(ckpt_dir: str) -> tuple[Any, list[dict[str, Any]], bool]:
    """(fsspec filesystem, the directory's entries, on an object store)."""
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]

    fs, path = url_to_fs(ckpt_dir)
    remote = "://" in ckpt_dir and not ckpt_dir.startswith("file://")
    if remote:
        fs.invalidate_cache(path)  # objckpt writes behind fsspec's back; another job may have too
    if not fs.exists(path):
        return fs, [], remote
    return fs, fs.ls(path, detail=True), remote


def committed_checkpoints(ckpt_dir: str, *, extension: str, last_name: str, tree_key: str,
                          storage_options: Optional[dict[str, Any]] = None) -> list[Committed]:
    """The checkpoints in ``ckpt_dir`` that count (module docstring), oldest commit first."""
    fs, entries, remote = _listing(ckpt_dir)
    names: dict[str, set[str]] = {}  # name -> the entry types listed under it (a marker and its prefix)
    for e in entries:
        full = str(e["name"]).rstrip("/")
        name = full.rsplit("/", 1)[-1]
        if name.endswith(extension):
            names.setdefault(name, set()).add(str(e.get("type")))
    found: list[Committed] = []
    base = ckpt_dir.rstrip("/")
    for name in sorted(names):
        path = f"{base}/{name}"
        try:
            m = _inspect(path, storage_options=storage_options, chunks=False)
        except NotFoundError:
            log.debug("objckpt: %s has no committed manifest: not a candidate for ckpt_path='last'", path)
            continue
        except ObjckptError as e:
            log.warning("objckpt: %s is not a candidate for ckpt_path='last': %s", path, e)
            continue
        if select(m.tree, tree_key) is NOTHING:
            log.debug("objckpt: %s was not written by ObjckptCheckpointIO: not a candidate", path)
            continue
        if remote and "file" not in names[name]:
            log.warning("objckpt: %s is committed but has no marker object (the job stopped between its commit "
                        "and the marker), so Lightning cannot resolve ckpt_path='last' to it; resume from it with "
                        "ckpt_path=%r", path, path)
            continue
        stem = name[: -len(extension)]
        found.append(Committed(path, m.created, stem == last_name or stem.startswith(f"{last_name}-")))
    found.sort(key=lambda c: (c.created, c.is_last))
    return found


def newest_committed(ckpt_dir: str, *, extension: str, last_name: str, tree_key: str,
                     storage_options: Optional[dict[str, Any]] = None) -> Optional[str]:
    """The path ``ckpt_path="last"`` resumes from: the newest committed checkpoint in ``ckpt_dir``
    (module docstring), or None when there is none."""
    found = committed_checkpoints(ckpt_dir, extension=extension, last_name=last_name, tree_key=tree_key,
                                  storage_options=storage_options)
    if not found:
        return None
    newest = found[-1]
    lasts = [c for c in found if c.is_last]
    if lasts and not newest.is_last:
        log.warning("objckpt: ckpt_path='last' resumes from %s, committed after %s (the job stopped before the "
                    "asynchronous save of its last checkpoint committed)", newest.path, lasts[-1].path)
    else:
        log.info("objckpt: ckpt_path='last' resumes from %s, the newest of %d committed checkpoints",
                 newest.path, len(found))
    return newest.path
