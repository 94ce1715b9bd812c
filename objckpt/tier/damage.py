"""Damaged copies a tiered restore passes over: what each node hides, what each rank may not use again.

Why: a node's folder is judged by its files' presence when the restore is planned
(:mod:`objckpt.tier.restore`); a flipped or truncated byte shows only when the load
checks what it reads (a crc32c mismatch, a short object, a manifest that does not
decode).  Failing the restore then would fail it again on every restart, although a
peer or object storage holds a good copy.  So the manager's load plans again: the
damaged file counts as absent in its node's folder (``hidden``: not read there, not
offered to the other ranks' fetches) and the rank's failed source is not offered to it
again (``forbid``), so it takes the next one (local, then peer, then object).  Each
pass-over is a :class:`~objckpt.tier.restore.Skip`, logged as a WARNING and reported.

Every rank learns every rank's outcome from one all-gather (:class:`Failed`), so the
next plan is the same everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..distributed.comm import RankError
from ..errors import CorruptCheckpointError
from ..format import keys
from .restore import LOCAL, PEER, Skip

#: loads of one restore at most: a rank can fail from its local copy, then a peer's
#: (each time planning again), before object storage; more ranks failing fail together
ATTEMPTS = 4


@dataclass(frozen=True)
class Failed:
    """One rank's failed load, as it crosses ranks."""

    error: RankError
    step: int
    #: the source this rank's load read from
    source: str
    #: its own damage (a crc32c mismatch, a short blob, a manifest that does not decode), not
    #: another rank's error raised here
    damaged: bool
    #: the damaged file, relative to the step ("" when the error named none of its files)
    file: str = ""
    #: the rank that sent ``file`` (a ``peer`` source), else -1
    sender: int = -1
    #: the files this rank read from its folder (hidden when ``file`` is unknown)
    reads: tuple[str, ...] = ()
    #: the damage, as this rank found it (the root of ``error``)
    why: str = ""


def failed(e: BaseException, step: int, source: str, names: Sequence[str], senders: dict[str, int],
           reads: Sequence[str]) -> Failed:
    """``e`` (this rank's load error) as :class:`Failed`; ``names``: the step's files, to find
    the one the error names; ``senders``: received file -> the rank that sent it."""
    own = _own_damage(e)
    text = str(own) if own is not None else ""
    file = max((n for n in names if n and n in text), key=len, default="")
    why = f"{type(own).__name__}: {own}" if own is not None else ""
    return Failed(RankError.of(e), step, source, own is not None, file, senders.get(file, -1), tuple(reads), why)


def _own_damage(e: BaseException) -> Optional[BaseException]:
    """The damage this rank found itself in ``e`` or its causes (a collective load raises
    every rank's errors as one, caused by this rank's own), else None.  A class made to raise
    another rank's error here (:func:`~objckpt.distributed.comm.refusal_class`) stands for
    that rank's damage, not this one's."""
    seen: set[int] = set()
    at: Optional[BaseException] = e
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, CorruptCheckpointError) and "_objckpt_stands_for" not in type(at).__dict__:
            return at
        at = at.__cause__ or at.__context__
    return None


@dataclass
class Avoid:
    """What the restore learned so far; the same on every rank."""

    #: (node, step) -> files of that node's folder found damaged
    hidden: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    #: rank -> the sources its load failed from
    forbid: dict[int, set[str]] = field(default_factory=dict)
    skipped: list[Skip] = field(default_factory=list)

    def hidden_on(self, node: str, step: int) -> frozenset[str]:
        return frozenset(self.hidden.get((node, step), ()))

    def forbidden(self) -> dict[int, frozenset[str]]:
        return {r: frozenset(s) for r, s in self.forbid.items()}

    def hide(self, node: str, step: int, files: Sequence[str]) -> None:
        self.hidden.setdefault((node, step), set()).update(files)

    def learn(self, outcomes: Sequence[Optional[Failed]], nodes: Sequence[str]) -> list[Skip]:
        """The new skips of one failed attempt (none: planning again would change nothing)."""
        new: list[Skip] = []
        for r, f in enumerate(outcomes):
            if f is None or not f.damaged or f.source in self.forbid.get(r, set()):
                continue
            self.forbid.setdefault(r, set()).add(f.source)
            if f.source == LOCAL:  # the damaged file, or (unnamed) every file it read there
                self.hide(nodes[r], f.step, [f.file] if f.file else list(f.reads) or [keys.MANIFEST_NAME])
            elif f.source == PEER and f.file and 0 <= f.sender < len(nodes):
                self.hide(nodes[f.sender], f.step, [f.file])
            new.append(Skip(r, f.step, f.source, f.file, (f.why or f.error.text)[:400]))
        self.skipped += new
        return new

    def skips_of(self, step: int) -> tuple[Skip, ...]:
        return tuple(s for s in self.skipped if s.step == step)
