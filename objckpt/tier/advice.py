"""The checkpoint interval that minimises expected lost work plus checkpoint overhead.

Young (1974) and Daly (2006): with a checkpoint costing ``C`` seconds of training
time and a mean time between failures ``M``, the interval ``sqrt(2 C M)``
minimises the expected waste (``C`` per interval, plus half an interval of
recomputation and the restart per failure).  ``C`` is what training waits for: a
tiered save's stall (the local commit); the drain to object storage runs beside
training and bounds the interval from below only through ``persist_every``
(a drain should finish before the next one starts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Advice:
    """The measured costs (means, seconds) and the advised interval."""

    failure_rate: float  # failures per hour (given)
    mtbf_s: float
    saves_measured: int
    stall_s: float  # training time a save took (local commit included)
    local_commit_s: float
    drain_s: Optional[float]  # a drain's wall time (None: none measured)
    interval_s: float  # Young/Daly: sqrt(2 * stall * MTBF)
    #: the expected lost work per failure at that interval: half an interval
    expected_lost_s: float
    #: the share of training time spent stalled on checkpoints at that interval
    overhead: float
    #: the shortest interval at which each drain (every ``persist_every`` saves) finishes before the next
    min_interval_s: float


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 * cost * MTBF)``."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def advise(failure_rate: float, stalls: Sequence[float], commits: Sequence[float], drains: Sequence[float],
           persist_every: int) -> Advice:
    if not failure_rate or failure_rate <= 0:
        raise ValueError(f"failure_rate must be a positive number of failures per hour, got {failure_rate!r}")
    mtbf = 3600.0 / failure_rate
    stall = mean(stalls)
    drain = mean(drains) if drains else None
    interval = young_daly(stall, mtbf)
    floor = (drain / persist_every) if drain else 0.0
    interval = max(interval, floor)
    return Advice(failure_rate, mtbf, len(stalls), stall, mean(commits), drain, interval, interval / 2.0,
                  stall / interval if interval else 0.0, floor)
