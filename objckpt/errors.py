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


class ConditionalWriteIgnoredError(CheckpointExistsError):
    """The store reported a create-only write (S3 ``If-None-Match: *``) as successful,
    yet another writer's object is at the key: the store does not honour conditional
    writes, so two writers can both be told they committed (docs/reliability.md,
    "What objckpt requires of a store").  This attempt did not commit."""


class CorruptCheckpointError(ObjckptError, ValueError):
    """Stored bytes or metadata do not match what the manifest promises."""


class BlobMissingError(CorruptCheckpointError):
    """An object the manifest names (a blob or a rank index) is gone.  Right after an
    overwrite this is expected (the old attempt's blobs are deleted once the new
    manifest is in place): readers re-fetch the manifest and retry; with the
    manifest unchanged it is real damage."""


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


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage request ran out of time on every attempt its retry budget allowed:
    no answer within the first-byte or read timeout, or an answer slower than the
    minimum rate (the per-request deadline, see docs/reliability.md)."""


class NotS3EndpointError(ObjckptError, ConnectionError):
    """The endpoint answers HTTP, but not as S3 does (a web page, a console port, a
    proxy's own page): no S3 error XML, no S3 headers.  Raised at once, never
    retried, and never read as "no checkpoint", "checkpoint exists" or corrupt
    bytes.  ``endpoint`` holds the URL; the message names it and the answer."""

    def __init__(self, endpoint: str, message: str = "") -> None:
        super().__init__(message or f"{endpoint} is not an S3 endpoint")
        self.endpoint = endpoint


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


class TensorChangedError(ObjckptError, RuntimeError):
    """A tensor was modified in place (by another thread) while a synchronous save
    read it: the bytes uploaded may not be the bytes checksummed, so the save
    refuses to commit.  Save from a quiescent state, or use ``async_save``, which
    copies first."""


class CollectiveError(ObjckptError, RuntimeError):
    """A collective of the process group failed (another rank died, or the network
    between ranks failed) in the middle of an objckpt operation, which did not complete."""


class ForeignSaveError(ObjckptError, RuntimeError):
    """The outcome of an ``async_save`` was asked for in a process forked from the one
    that started it: the save runs (and commits) in its own process only."""


class MemoryBudgetError(ObjckptError, MemoryError):
    """One piece of an operation (a read temporary, a collective batch, a cast
    temporary, a staging buffer) needs more host or device memory than is left of
    the operation's memory budget (``load(..., memory_bytes=...)``): the message
    names the budget, the piece and the bytes; give a larger budget."""
