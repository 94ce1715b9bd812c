"""Filesystem errors of the local store, as objckpt errors that name the path and the cause.

A bare ``OSError`` from deep inside a save ("[Errno 28] No space left on device")
says neither which checkpoint nor which file; a user of ``objckpt rm`` got a
traceback.  Every ``OSError`` the local store meets is turned into a
:class:`~objckpt.errors.StorageError` (an ``OSError`` too, with the same
``errno``, so ``except OSError`` and ``e.errno == errno.ENOSPC`` keep working)
whose message says what was being done, to which object and file, and why, in
words: a full disk, a read-only filesystem, a file where a directory should be,
a directory where a file should be.  Reads of a path that is not a file mean
the object does not exist (:class:`~objckpt.errors.NotFoundError`), as on any
object store.
"""
from __future__ import annotations

import errno
import os
from typing import Optional

from ..errors import NotFoundError, StorageError

_CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EROFS: "the filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an I/O error of the device",
    errno.EISDIR: "a directory is where a file should be",
    errno.EMFILE: "this process has too many open files",
    errno.ENAMETOOLONG: "the file name is too long",
}


def blocking_file(path: str, root: str) -> Optional[str]:
    """The first existing component of ``path`` below ``root`` that is not a directory
    (the file that stands where a directory should be), else None."""
    rel = os.path.relpath(path, root)
    if rel.startswith(".."):
        return None
    cur = root
    for part in rel.split(os.sep)[:-1]:
        cur = os.path.join(cur, part)
        if os.path.lexists(cur) and not os.path.isdir(cur):
            return cur
        if not os.path.lexists(cur):
            return None
    return None


def cause(e: OSError, path: str, root: str) -> str:
    """``e`` in words, with the errno's name (``ENOSPC``) for searching."""
    name = errno.errorcode.get(e.errno or 0, "")
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = blocking_file(path, root)
        if blocker is not None:
            return f"{blocker} is a file where a directory should be ({name})"
    if e.errno == errno.EEXIST and os.path.isdir(path):
        return f"a directory is where a file should be ({name})"
    text = _CAUSES.get(e.errno or 0, e.strerror or str(e))
    return f"{text} ({name})" if name else text


def storage_error(doing: str, path: str, root: str, e: OSError) -> StorageError:
    """A :class:`StorageError` for ``e`` met while ``doing`` (e.g. "writing the manifest")
    the file ``path`` of the store rooted at ``root``; it keeps ``e.errno``."""
    err = StorageError(f"{doing} {path} failed: {cause(e, path, root)}")
    err.errno = e.errno
    return err


def missing(key: str, path: str, e: Optional[OSError] = None) -> NotFoundError:
    """:class:`NotFoundError` for a read of ``key`` whose ``path`` is absent or not a file."""
    why = ""
    if e is not None and e.errno == errno.EISDIR:
        why = f": {path} is a directory, not a file"
    elif e is not None and e.errno == errno.ENOTDIR:
        why = f": a component of {path} is a file, not a directory"
    err = NotFoundError(f"object {key!r} does not exist{why or f' (no file {path})'}")
    err.errno = e.errno if e is not None else errno.ENOENT
    return err


def is_absent(e: OSError) -> bool:
    """True when ``e`` says the file is not there (or the path cannot hold one)."""
    return e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
