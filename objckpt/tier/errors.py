"""The errors of the tiered checkpoints, and how ranks agree on one before raising it.

A tier operation that several ranks run together (the checks before a save, the
metadata sent to every node after it) first lets each rank find its own problem,
then all-gathers them as :class:`~objckpt.distributed.comm.RankError` records (the
one shape an error crosses ranks in), so every rank raises the same error at once,
naming each rank and what it found.  The error class comes from the records'
``kind`` (the registered name of the class the rank refuses with), never from
their text.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..distributed.comm import RankError, refusal
from ..errors import CheckpointExistsError, ObjckptError, StorageError, error_name


class TierSettingsError(ObjckptError, ValueError):
    """The tier settings are impossible (replicas >= world size) or differ between ranks."""


class LocalTierError(StorageError):
    """The local directory cannot hold this checkpoint (not writable, not enough space,
    a write of the step's metadata to a node's folder failed)."""


class TierRestoreError(ObjckptError, FileNotFoundError):
    """No step is complete in any tier for every rank."""


class DrainError(ObjckptError, OSError):
    """A drain did not commit (a rank's upload failed, or the commit did): nothing is in object
    storage.  ``step``: the step (None: several); ``retryable``: whether a later attempt may
    succeed (object storage down), False when the local files are gone or another checkpoint
    is committed at the destination; ``gone``: the local step itself is no checkpoint any
    more (deleted, or dropped by a restore): there is nothing left to drain."""

    def __init__(self, message: str, *, step: Optional[int] = None, retryable: bool = True,
                 gone: bool = False) -> None:
        super().__init__(message)
        self.step = step
        self.retryable = retryable
        self.gone = gone


class DrainCutError(ObjckptError):
    """A drain stopped by its caller (a preemption's deadline passed) before it committed."""


def settings_problem(text: str) -> RankError:
    """A rank's refusal because the settings are impossible here (a blank node name, a bad
    value, a folder of another root in the way): :class:`TierSettingsError`."""
    return RankError(error_name(TierSettingsError), text)


def local_problem(text: str) -> RankError:
    """A rank's refusal because the local tier cannot take the step (unwritable, full, a
    write failed): :class:`LocalTierError`."""
    return RankError(error_name(LocalTierError), text)


def exists_problem(text: str) -> RankError:
    """A rank's refusal because the step is already committed (in the local tier or in
    object storage): :class:`~objckpt.errors.CheckpointExistsError`."""
    return RankError(error_name(CheckpointExistsError), text)


def state_problem(e: BaseException, text: str) -> RankError:
    """A rank's refusal because its state could not be read (a Stateful value's
    ``state_dict()`` raised ``e``): ``e``'s own objckpt class on every rank
    (:class:`~objckpt.errors.ObjckptError` when it is none)."""
    return RankError(error_name(e), text)


#: the kinds the tier's own refusals carry; any other kind is a state's error
_SETTINGS, _LOCAL, _EXISTS = (error_name(c) for c in (TierSettingsError, LocalTierError, CheckpointExistsError))


def raise_problems(lead: str, problems: Sequence[Optional[RankError]], shown: int = 4,
                   cause: Optional[BaseException] = None) -> None:
    """Raise on this rank when any rank had a problem (``problems[r]``: rank ``r``'s, None:
    none): :class:`~objckpt.errors.CheckpointExistsError` when every problem is an
    :func:`exists_problem`, else :class:`LocalTierError` when one is a
    :func:`local_problem`, else the objckpt error class of the first other problem
    that is no :func:`settings_problem` nor :func:`exists_problem` (a
    :func:`state_problem`: :class:`~objckpt.errors.ObjckptError` when its kind names
    no objckpt class), else :class:`TierSettingsError`; the message is ``lead``
    and the first ``shown`` ranks' problems, chained from ``cause`` (this rank's own
    exception behind its problem, if any)."""
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    if not bad:
        return
    text = "; ".join(f"rank {r}: {p.text}" for r, p in sorted(bad.items())[:shown])
    if len(bad) > shown:
        text += f"; and {len(bad) - shown} more rank(s)"
    kinds = {p.kind for p in bad.values()}
    state = next((p.kind for _, p in sorted(bad.items()) if p.kind not in (_SETTINGS, _EXISTS)), None)
    message = f"{lead} ({text})"
    if kinds == {_EXISTS}:
        raise CheckpointExistsError(message) from cause
    if _LOCAL in kinds:
        raise LocalTierError(message) from cause
    raise (refusal(state, message) if state is not None else TierSettingsError(message)) from cause
