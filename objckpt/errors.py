"""Errors raised by objckpt, and the registry that lets them cross ranks as themselves.

Every error derives from :class:`ObjckptError` and also from the built-in
exception it means, so callers that already catch ``FileNotFoundError`` or
``ValueError`` keep working without knowing about objckpt.

**The registry.**  Ranks tell each other what failed as (class name, text), never
as a pickled exception.  Every subclass of :class:`ObjckptError`, wherever it is
defined, is registered when its class statement runs, under :func:`error_name`:
the class name for objckpt's own classes (unique: a second class of the same name
is a ``TypeError`` at import), ``module.qualname`` for anyone else's.
:func:`error_class` looks a name up, and :meth:`ObjckptError.from_message` rebuilds
an error of the class from its text alone, so the rank that receives the name raises
that very class (:func:`objckpt.distributed.comm.refusal_class`) and ``except
TierSettingsError`` works on every rank alike.
"""
from __future__ import annotations

from typing import Any, Optional, Union

#: every ObjckptError class by its :func:`error_name` (ObjckptError itself included)
_REGISTRY: dict[str, type["ObjckptError"]] = {}


class ObjckptError(Exception):
    """Base class of every error objckpt raises on purpose."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

    @classmethod
    def from_message(cls, message: str) -> "ObjckptError":
        """An error of exactly this class whose text is ``message``: how another rank's
        error of this class is raised here.  A class whose ``__init__`` takes more than a
        message overrides this (the values beyond the text are not sent: they take their
        defaults); one that does not is built without running its ``__init__``."""
        try:
            return cls(message)
        except TypeError:  # an __init__ that needs more than a message, and no override
            made = cls.__new__(cls)
            Exception.__init__(made, message)
            return made


def _ours(module: str) -> bool:
    return module == "objckpt" or module.startswith("objckpt.")


def error_name(of: Union[BaseException, type]) -> str:
    """The name an exception (or exception class) crosses ranks under: the class name
    for builtins and for objckpt's own errors, else ``module.qualname``.  A class made
    to raise another rank's error (``refusal_class``) has the name of the class it
    stands for."""
    cls = of if isinstance(of, type) else type(of)
    cls = cls.__dict__.get("_objckpt_stands_for", cls)
    if cls.__module__ == "builtins" or (issubclass(cls, ObjckptError) and _ours(cls.__module__)):
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def error_class(name: str) -> Optional[type[ObjckptError]]:
    """The ObjckptError class registered as ``name`` (see :func:`error_name`), or None."""
    return _REGISTRY.get(name)


def error_classes() -> dict[str, type[ObjckptError]]:
    """Every registered ObjckptError class by name (a copy)."""
    return dict(_REGISTRY)


def _register(cls: type[ObjckptError]) -> None:
    """Record ``cls`` under its name; a class made by ``refusal_class`` stands for another
    and is not recorded.  A name taken by another class is a ``TypeError``: errors cross
    ranks by name, and the receiving rank would raise the wrong one (a module loaded
    again defines the same class anew: that replaces it)."""
    if "_objckpt_stands_for" in cls.__dict__:
        return
    name = error_name(cls)
    old = _REGISTRY.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"two objckpt error classes are named {name!r} ({old.__module__}.{old.__qualname__} and "
                        f"{cls.__module__}.{cls.__qualname__}): errors cross ranks by this name, so it must be "
                        "unique; rename one")
    _REGISTRY[name] = cls


_REGISTRY["ObjckptError"] = ObjckptError


class NotFoundError(ObjckptError, FileNotFoundError):
    """A checkpoint or an object it needs does not exist."""


class BucketNotFoundError(NotFoundError):
    """The bucket named in the URI does not exist (or this account cannot see it).

    ``bucket`` holds its name; the message names it too."""

    def __init__(self, bucket: str, message: str = "") -> None:
        super().__init__(message or f"bucket {bucket!r} does not exist")
        self.bucket = bucket

    @classmethod
    def from_message(cls, message: str) -> "BucketNotFoundError":
        """(The bucket's name is in the text only: ``bucket`` is empty.)"""
        return cls("", message or "a bucket does not exist")


class CheckpointExistsError(ObjckptError, FileExistsError):
    """A committed checkpoint is already at the target path (pass ``overwrite=True``)."""


class PreconditionFailed(ObjckptError, FileExistsError):
    """A conditional write lost: the object appeared (or changed) meanwhile."""


class CorruptCheckpointError(ObjckptError, ValueError):
    """Stored bytes or metadata do not match what the manifest promises."""


class BlobMissingError(CorruptCheckpointError):
    """An object the manifest names (a blob or a rank index) is gone.  Right after an
    overwrite this is expected (the old attempt's blobs are deleted once the new
    manifest is in place): readers re-fetch the manifest and retry; with the
    manifest unchanged it is real damage."""


class InvalidURIError(ObjckptError, ValueError):
    """A checkpoint URI or path objckpt cannot map to one place: a control character in
    it (a tab, CR, LF, NUL, any other C0 control or DEL), a malformed scheme, an S3 URI
    without a bucket.  The message names the URI and what is wrong with it."""


class UnsupportedFormatError(ObjckptError, ValueError):
    """The manifest is of a format version this release cannot read."""


class DcpDirectoryError(UnsupportedFormatError):
    """A :class:`~objckpt.CheckpointManager`'s root is a torch.distributed.checkpoint (DCP)
    directory (a ``.metadata``, at the root or in a folder right under it) and holds no
    objckpt step.  Raised where the manager would otherwise answer "no step yet"
    (``latest_step()`` None), so that a job does not start from scratch beside the run
    it means to resume; the message names the DCP folders and ``objckpt convert``.  Not
    a ``FileNotFoundError``: code that starts afresh on one must not swallow it."""


class StateDictMismatchError(ObjckptError, ValueError):
    """The caller's state dict does not fit the checkpoint (keys, dtypes, shapes)."""


class OptimizerMismatchError(StateDictMismatchError):
    """The checkpoint holds another kind of optimizer's state than the template's optimizer
    (an AdamW checkpoint loaded into SGD): each side has hyperparameter names (or
    per-parameter state names) the other lacks.  Raised before anything is loaded; the
    message names the optimizer's key, the param group or parameter, and both sides'
    names.  ``load(..., allow_optimizer_change=True)`` loads it anyway, as torch's
    ``load_state_dict`` would (see :mod:`objckpt.load.optimizer_match`)."""


class MissingKeyError(ObjckptError, KeyError):
    """A requested key is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnsupportedValueError(ObjckptError, TypeError):
    """A value in the state dict cannot be stored without pickle."""


class StorageError(ObjckptError, OSError):
    """The storage backend failed after its retries."""


class ConditionalWriteIgnoredError(StorageError):
    """The store accepts a create-only write (S3 ``If-None-Match: *``) and ignores the
    condition, so two writers of one checkpoint could both be told they committed
    (docs/reliability.md, "What objckpt requires of a store").  A save on such a store
    raises it before writing anything unless ``single_writer=True`` (the caller
    guarantees one writer per root); the step index raises it when a read-back finds
    another writer's version; a commit that finds another writer's manifest raises
    :class:`CommitReplacedError`."""


class CommitReplacedError(ConditionalWriteIgnoredError, CheckpointExistsError):
    """The store reported this save's create-only write of its manifest as successful,
    yet another writer's manifest is at the key: the store ignored ``If-None-Match``
    and the stored checkpoint is the other writer's.  This attempt did not commit."""


class CredentialsRefusedError(StorageError, PermissionError):
    """The store refused the request's credentials, not the request: this machine's
    clock is off (``RequestTimeTooSkewed``), a session token has expired or is not
    valid (``ExpiredToken``, ``InvalidToken``), the secret key is wrong
    (``SignatureDoesNotMatch``) or the access key id unknown (``InvalidAccessKeyId``).
    Raised at once, never retried: the message names the request, S3's code and what
    to fix.  ``code`` holds S3's code; ``skew_s`` the server's clock minus this
    machine's, in seconds, when the answer's ``Date`` showed it (else None)."""

    code: str = ""
    skew_s: "float | None" = None


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage request ran out of time on every attempt its retry budget allowed:
    no answer within the first-byte or read timeout, or an answer slower than the
    minimum rate (the per-request deadline, see docs/reliability.md)."""


class PlainHttpEndpointError(StorageError, ConnectionError):
    """An ``https://`` endpoint answered the TLS handshake with bytes that are not TLS
    (OpenSSL: "wrong version number", "record layer failure", "packet length too
    long"): it serves plain HTTP on that port.  Raised at once, never retried, on
    either S3 transport; the message names the endpoint, where its URL came from and
    the ``http://`` URL to use instead."""


class NotS3EndpointError(ObjckptError, ConnectionError):
    """The endpoint answers HTTP, but not as S3 does (a web page, a console port, a
    proxy's own page): no S3 error XML, no S3 headers.  Raised at once, never
    retried, and never read as "no checkpoint", "checkpoint exists" or corrupt
    bytes.  ``endpoint`` holds the URL; the message names it and the answer."""

    def __init__(self, endpoint: str, message: str = "") -> None:
        super().__init__(message or f"{endpoint} is not an S3 endpoint")
        self.endpoint = endpoint

    @classmethod
    def from_message(cls, message: str) -> "NotS3EndpointError":
        """(The URL is in the text only: ``endpoint`` is empty.)"""
        return cls("", message or "not an S3 endpoint")


class CollectiveLoadError(ObjckptError):
    """A collective load failed on some rank; raised on every rank.

    ``failures`` maps each failed rank (of the process group) to what failed there."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures

    @classmethod
    def from_message(cls, message: str) -> "CollectiveLoadError":
        """(Each rank's failure is in the text only: ``failures`` is empty.)"""
        return cls(message, {})


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


class RankLostError(CollectiveError):
    """A rank died (or became unreachable) while a multi-rank save committed, so the
    ranks could not share the outcome.  Each survivor learned it from storage
    (objckpt.save.decision) and says which it is: ``committed`` is True (the new
    checkpoint is whole; this rank kept its objects), False (nothing was committed;
    the previous checkpoint is unchanged and this rank deleted its objects) or None
    (unknown: this rank's objects are left for ``objckpt gc``, which removes them only
    if no manifest names them).  ``lost_ranks`` lists the ranks that did not answer
    afterwards (empty when that could not be told)."""

    def __init__(self, message: str, committed: "bool | None" = None, lost_ranks: "tuple[int, ...]" = ()) -> None:
        super().__init__(message)
        self.committed = committed
        self.lost_ranks = tuple(lost_ranks)


class ForeignSaveError(ObjckptError, RuntimeError):
    """The outcome of an ``async_save`` was asked for in a process forked from the one
    that started it: the save runs (and commits) in its own process only."""


class MemoryBudgetError(ObjckptError, MemoryError):
    """One piece of an operation (a read temporary, a collective batch, a cast
    temporary, a staging buffer) needs more host or device memory than is left of
    the operation's memory budget (``load(..., memory_bytes=...)``): the message
    names the budget, the piece and the bytes; give a larger budget."""
