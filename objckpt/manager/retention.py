"""Retention: which committed steps a policy keeps.  Pure (no I/O), so it is tested alone.

A step is kept when *any* rule keeps it (the rules add up, none removes):

* ``keep_last=M``: the M newest steps;
* ``keep_every=K``: every step divisible by K;
* ``keep_best=N``: the N best steps by ``metadata[best_key]``, higher is better
  with ``best_mode="max"`` (the default, e.g. accuracy) and lower with
  ``"min"`` (e.g. loss); steps without a numeric ``best_key`` are not candidates;
* ``keep_every_seconds=T``: one step per T seconds of save time, for ever (orbax's
  ``keep_time_interval``): walking the steps in order, the first is kept, then each
  step saved at least T seconds after the last one this rule kept.  The decision
  depends only on older steps' save times, so a step it keeps stays kept as the run
  goes on, and the times are the index's (no clock is read here: tests give times);
* the newest step is always kept, so a job can always resume.

With no rule at all every step is kept (the manager never deletes).
:func:`retention_verdicts` says, for each step dropped, which rules passed it over
(the manager logs it at INFO for every step retention deletes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

from ..errors import ObjckptError


class RetentionPolicyError(ObjckptError, ValueError):
    """A retention rule that cannot work (a non-positive count, keep_best without best_key)."""


class StepOrderError(ObjckptError, ValueError):
    """A save of a step older than the newest one that the retention policy would delete as
    soon as it is indexed: refused before anything is uploaded."""


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    keep_best: Optional[int] = None
    best_key: Optional[str] = None
    best_mode: str = "max"
    keep_every_seconds: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise RetentionPolicyError(f"{name} must be a positive int or None, got {v!r}")
        t = self.keep_every_seconds
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0
                              or math.isinf(t)):
            raise RetentionPolicyError(f"keep_every_seconds must be a positive number of seconds or None, got {t!r}")
        if self.keep_best is not None and not self.best_key:
            raise RetentionPolicyError("keep_best needs best_key (the metadata key that ranks steps)")
        if self.best_mode not in ("max", "min"):
            raise RetentionPolicyError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")

    @property
    def deletes(self) -> bool:
        """Whether this policy ever deletes anything."""
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best,
                                           self.keep_every_seconds))


def _score(metadata: dict[str, Any], key: str) -> Optional[float]:
    v = metadata.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


#: what retention sees of a step: (step, metadata) or (step, metadata, save time in seconds since the epoch)
Candidate = Union[tuple[int, dict[str, Any]], tuple[int, dict[str, Any], float]]


def _items(entries: Iterable[Candidate]) -> list[tuple[int, dict[str, Any], float]]:
    out = [(c[0], c[1], float(c[2]) if len(c) > 2 else 0.0) for c in entries]  # type: ignore[misc]
    return sorted(out, key=lambda e: e[0])


def _ranked(items: Sequence[tuple[int, dict[str, Any], float]], key: str, mode: str) -> list[int]:
    """Steps with a number under ``key``, best first (ties go to the newer step)."""
    scored = [(sc, s) for s, md, _ in items if (sc := _score(md, key)) is not None]
    scored.sort(key=lambda t: ((-t[0]) if mode == "max" else t[0], -t[1]))
    return [s for _, s in scored]


def best_step(entries: Iterable[Candidate], key: str, mode: str = "max") -> Optional[int]:
    """The best step by ``metadata[key]`` (``mode="max"``: highest), None when no step has
    a number there; ties go to the newer step."""
    if mode not in ("max", "min"):
        raise RetentionPolicyError(f"best_mode must be 'max' or 'min', got {mode!r}")
    ranked = _ranked(_items(entries), key, mode)
    return ranked[0] if ranked else None


def _time_kept(items: Sequence[tuple[int, dict[str, Any], float]], every: float) -> set[int]:
    kept: set[int] = set()
    last: Optional[float] = None
    for s, _, t in items:
        if last is None or t >= last + every:
            kept.add(s)
            last = t
    return kept


def steps_to_keep(policy: RetentionPolicy, entries: Iterable[Candidate]) -> set[int]:
    """The steps ``policy`` keeps out of ``entries`` ((step, metadata[, time]) each)."""
    items = _items(entries)
    steps = [s for s, _, _ in items]
    if not policy.deletes or not steps:
        return set(steps)
    keep = {steps[-1]}
    if policy.keep_last is not None:
        keep.update(steps[-policy.keep_last:])
    if policy.keep_every is not None:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    if policy.keep_best is not None and policy.best_key:
        keep.update(_ranked(items, policy.best_key, policy.best_mode)[: policy.keep_best])
    if policy.keep_every_seconds is not None:
        keep.update(_time_kept(items, float(policy.keep_every_seconds)))
    return keep


def steps_to_delete(policy: RetentionPolicy, entries: Iterable[Candidate]) -> list[int]:
    """The complement of :func:`steps_to_keep`, ascending."""
    items = list(entries)
    keep = steps_to_keep(policy, items)
    return sorted(c[0] for c in items if c[0] not in keep)


def retention_verdicts(policy: RetentionPolicy, entries: Iterable[Candidate]) -> dict[int, str]:
    """The steps ``policy`` drops, each with why: the rules that passed it over
    (for the INFO line the manager logs per retention delete)."""
    items = _items(entries)
    doomed = steps_to_delete(policy, items)
    if not doomed:
        return {}
    steps = [s for s, _, _ in items]
    why: list[str] = []
    if policy.keep_last is not None:
        newest = steps[-policy.keep_last:]
        why.append(f"not among the {policy.keep_last} newest (keep_last={policy.keep_last}: "
                   f"{', '.join(map(str, newest))})")
    if policy.keep_every is not None:
        why.append(f"not a multiple of keep_every={policy.keep_every}")
    if policy.keep_best is not None and policy.best_key:
        best = _ranked(items, policy.best_key, policy.best_mode)[: policy.keep_best]
        why.append(f"not among the {policy.keep_best} best by {policy.best_key!r} ({policy.best_mode}; "
                   f"keep_best={policy.keep_best}: {', '.join(map(str, best)) or 'none scored'})")
    if policy.keep_every_seconds is not None:
        why.append(f"saved less than keep_every_seconds={policy.keep_every_seconds:g} after the last step "
                   "that rule kept")
    common = "; ".join(why)
    md = {s: m for s, m, _ in items}
    out = {}
    for s in doomed:
        score = ""
        if policy.keep_best is not None and policy.best_key:
            v = md[s].get(policy.best_key)
            score = f" ({policy.best_key}={v!r})" if v is not None else f" (no number under {policy.best_key!r})"
        out[s] = f"{common}{score}; the newest step is {steps[-1]}"
    return out
