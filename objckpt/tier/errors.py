"""The errors of the tiered checkpoints, and the problems ranks exchange before raising them.

A tier operation that several ranks run together (the checks before a save, the
metadata sent to every node after it) first lets each rank find its own problem,
then all-gathers them as :class:`Problem` records, so every rank raises the same
error at once, naming each rank and what it found.  The error class comes from the
problems' :class:`ProblemKind`, never from their text.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from ..distributed.comm import refusal
from ..errors import CheckpointExistsError, ObjckptError, StorageError


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


class ProblemKind(enum.Enum):
    """What kind of refusal a rank's :class:`Problem` is (it picks the error class)."""

    #: the step is already committed (in the local tier or in object storage): CheckpointExistsError
    EXISTS = "exists"
    #: the local tier cannot take the step (unwritable, full, a write failed): LocalTierError
    LOCAL = "local"
    #: the settings are impossible here (a blank node name, a bad value): TierSettingsError
    SETTINGS = "settings"
    #: the rank's state could not be read (a Stateful value's ``state_dict()`` raised): ObjckptError
    STATE = "state"


@dataclass(frozen=True)
class Problem:
    """One rank's reason why a tier operation cannot go on (picklable: it crosses ranks)."""

    kind: ProblemKind
    text: str
    #: the registered name (``objckpt.errors.error_name``) of the exception behind a
    #: :attr:`ProblemKind.STATE` problem: every rank raises that ObjckptError class, when it is one
    error: str = ""


def raise_problems(lead: str, problems: Sequence[Optional[Problem]], shown: int = 4,
                   cause: Optional[BaseException] = None) -> None:
    """Raise on this rank when any rank had a problem (``problems[r]``: rank ``r``'s, None:
    none): :class:`~objckpt.errors.CheckpointExistsError` when every problem is
    :attr:`ProblemKind.EXISTS`, else :class:`LocalTierError` when one is
    :attr:`ProblemKind.LOCAL`, else the objckpt error class of the first
    :attr:`ProblemKind.STATE` problem's exception (:class:`~objckpt.errors.ObjckptError`
    when it is none), else :class:`TierSettingsError`; the message is ``lead``
    and the first ``shown`` ranks' problems, chained from ``cause`` (this rank's own
    exception behind its problem, if any)."""
    bad = {r: p for r, p in enumerate(problems) if p is not None}
    if not bad:
        return
    text = "; ".join(f"rank {r}: {p.text}" for r, p in sorted(bad.items())[:shown])
    if len(bad) > shown:
        text += f"; and {len(bad) - shown} more rank(s)"
    kinds = {p.kind for p in bad.values()}
    state = next((p.error for _, p in sorted(bad.items()) if p.kind is ProblemKind.STATE), None)
    message = f"{lead} ({text})"
    if kinds == {ProblemKind.EXISTS}:
        raise CheckpointExistsError(message) from cause
    if ProblemKind.LOCAL in kinds:
        raise LocalTierError(message) from cause
    raise (refusal(state, message) if state is not None else TierSettingsError(message)) from cause
