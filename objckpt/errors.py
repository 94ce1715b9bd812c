"""Errors raised by objckpt.

Every error derives from :class:`ObjckptError` and also from the built-in
exception it means, so callers that already catch ``FileNotFoundError`` or
``ValueError`` keep working without knowing about objckpt.
"""
from __future__ import annotations


class ObjckptError(Exception):
    """Base class of every error objckpt raises on purpose."""


class NotFoundError(ObjckptError, FileNotFoundError):
    """A checkpoint or an object it needs does not exist."""


class BucketNotFoundError(NotFoundError):
    """The bucket named in the URI does not exist (or this account cannot see it).

    ``bucket`` holds its name; the message names it too."""

    def __init__(self, bucket: str, message: str = "") -> None:
        super().__init__(message or f"bucket {bucket!r} does not exist")
        self.bucket = bucket


class CheckpointExistsError(ObjckptError, FileExistsError):
    """A committed checkpoint is already at the target path (pass ``overwrite=True``)."""


class PreconditionFailed(ObjckptError, FileExistsError):
    """A conditional write lost: the object appeared (or changed) meanwhile."""


class CorruptCheckpointError(ObjckptError, ValueError):
    """Stored bytes or metadata do not match what the manifest promises."""


class UnsupportedFormatError(ObjckptError, ValueError):
    """The manifest is of a format version this release cannot read."""


class StateDictMismatchError(ObjckptError, ValueError):
    """The caller's state dict does not fit the checkpoint (keys, dtypes, shapes)."""


class MissingKeyError(ObjckptError, KeyError):
    """A requested key is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedValueError(ObjckptError, TypeError):
    """A value in the state dict cannot be stored without pickle."""


class StorageError(ObjckptError, OSError):
    """The storage backend failed after its retries."""


class CollectiveLoadError(ObjckptError):
    """A collective load failed on some rank; raised on every rank.

    ``failures`` maps each failed rank (of the process group) to what failed there."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class RanksDidNotJoinError(ObjckptError, TimeoutError):
    """Some ranks of the process group did not enter the same objckpt operation
    within the collective timeout (e.g. a save called on rank 0 only: pass
    ``no_dist=True`` for a one-rank save or load)."""
