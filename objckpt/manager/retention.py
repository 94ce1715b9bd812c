"""Retention: which committed steps a policy keeps.  Pure (no I/O), so it is tested alone.

A step is kept when *any* rule keeps it (the rules add up, none removes):

* ``keep_last=M``: the M newest steps;
* ``keep_every=K``: every step divisible by K;
* ``keep_best=N``: the N best steps by ``metadata[best_key]``, higher is better
  with ``best_mode="max"`` (the default, e.g. accuracy) and lower with
  ``"min"`` (e.g. loss); steps without a numeric ``best_key`` are not candidates;
* the newest step is always kept, so a job can always resume.

With no rule at all every step is kept (the manager never deletes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ..errors import ObjckptError


class RetentionPolicyError(ObjckptError, ValueError):
    """A retention rule that cannot work (a non-positive count, keep_best without best_key)."""


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    keep_best: Optional[int] = None
    best_key: Optional[str] = None
    best_mode: str = "max"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise RetentionPolicyError(f"{name} must be a positive int or None, got {v!r}")
        if self.keep_best is not None and not self.best_key:
            raise RetentionPolicyError("keep_best needs best_key (the metadata key that ranks steps)")
        if self.best_mode not in ("max", "min"):
            raise RetentionPolicyError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")

    @property
    def deletes(self) -> bool:
        """Whether this policy ever deletes anything."""
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))


def _score(metadata: dict[str, Any], key: str) -> Optional[float]:
    v = metadata.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def steps_to_keep(policy: RetentionPolicy, entries: Iterable[tuple[int, dict[str, Any]]]) -> set[int]:
    """The steps ``policy`` keeps out of ``entries`` (step, metadata)."""
    items = sorted(entries, key=lambda e: e[0])
    steps = [s for s, _ in items]
    if not policy.deletes or not steps:
        return set(steps)
    keep = {steps[-1]}
    if policy.keep_last is not None:
        keep.update(steps[-policy.keep_last:])
    if policy.keep_every is not None:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    if policy.keep_best is not None and policy.best_key:
        scored = [(sc, s) for s, md in items if (sc := _score(md, policy.best_key)) is not None]
        # best first; ties go to the newer step
        scored.sort(key=lambda t: ((-t[0]) if policy.best_mode == "max" else t[0], -t[1]))
        keep.update(s for _, s in scored[: policy.keep_best])
    return keep


def steps_to_delete(policy: RetentionPolicy, entries: Iterable[tuple[int, dict[str, Any]]]) -> list[int]:
    """The complement of :func:`steps_to_keep`, ascending."""
    items = list(entries)
    keep = steps_to_keep(policy, items)
    return sorted(s for s, _ in items if s not in keep)
