"""The preemption save of a tiered manager: commit locally, replicate, drain while the deadline allows.

:class:`TierPreemption` is part of :class:`~objckpt.manager.tiers.TieredSaves` (a base
class of it; its attributes are TieredSaves'), kept apart so that the tier's ordinary
path reads without it.  A preemption save is an ordinary tiered save of the agreed step
(:mod:`objckpt.manager.preemption`) with two differences: its drain is due whatever
``persist_every`` says, and from then on every drain of the manager stops at the deadline
(between two files or two parts: :func:`objckpt.tier.drain.drain`'s ``stop``): the process
is about to exit, and the step is durable once it is committed in the local tier.  A drain
cut that way commits nothing in object storage; the step stays in the local tier, its record
in the node's folder (:mod:`objckpt.tier.backlog`; written right after the local commit, in
the caller's thread), and the next job's manager drains it.

:meth:`TierPreemption.preemption_wait` waits for the background work until the deadline at
most and says what reached which tier (INFO), and plainly (WARNING) when the deadline cut
the drain or the replication or the drain failed: it raises none of those (the step is
committed locally; the caller is exiting).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from ..tier import backlog as _backlog
from ..tier.backlog import Undrained

log = logging.getLogger("objckpt.manager")


@dataclass(frozen=True)
class PreemptionOutcome:
    """Where a preemption save's step got by the time :meth:`TierPreemption.preemption_wait` returned."""

    step: int
    local: bool = True
    #: copied to ``replicas`` peers (None: replicas=0, or not known by the deadline)
    replicated: Optional[bool] = None
    #: committed in object storage
    drained: bool = False
    #: the deadline passed before the drain committed
    cut: bool = False


class TierPreemption:
    """A preemption save's part of :class:`~objckpt.manager.tiers.TieredSaves` (see the module)."""

    #: the agreed preemption step (None: none yet); its drain is due whatever persist_every says
    preempt_step: Optional[int] = None
    #: ``time.monotonic()`` at which every drain of this manager stops (None: no preemption)
    deadline: Optional[float] = None
    #: the step whose drain committed last (drains run oldest first)
    last_drained: Optional[int] = None
    #: what the last preemption_wait found (a later one with nothing left to wait for says it again, quietly)
    reported: Optional[PreemptionOutcome] = None

    def note_drained(self, step: int, seconds: float) -> None:
        """A drain of ``step`` committed, in ``seconds`` (kept for :meth:`advice`)."""
        self.drains.append(seconds)  # type: ignore[attr-defined]
        self.last_drained = step

    def cut(self) -> bool:
        """Whether a drain must stop now (the preemption deadline passed)."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def preemption_save(self, step: int, state: Any, md: dict[str, Any], deadline: float) -> Any:
        """The agreed step saved as an ordinary tiered save whose drain is due (see the module)."""
        me: Any = self
        self.preempt_step, self.deadline = step, deadline
        out = me.save(step, state, md)
        if me.first_on_node:  # due for object storage, recorded before any background work: the process may
            # exit (or be killed) before its drain even starts, and the next job drains what is recorded
            _backlog.mark(me.root, me.host.naming.name(step), Undrained(step, md, me.host.clock()), me.host.root)
        return out

    def preemption_wait(self, step: int, deadline: float) -> PreemptionOutcome:
        """Until the background work of the saves so far is done, the deadline at most."""
        me: Any = self
        pending = list(me._pending)
        if not pending and self.reported is not None and self.reported.step == step:
            return self.reported  # close() after wait(): nothing new to say
        done, running = concurrent.futures.wait(pending, timeout=max(deadline - time.monotonic(), 0.0))
        me._pending = [f for f in pending if f in running]
        for f in done:
            if f.exception() is not None:
                log.warning("objckpt: preemption save of step %d: the background work after its local commit "
                            "failed: %s: %s", step, type(f.exception()).__name__, f.exception())
        drained = self.last_drained == step
        waiting = {u.step: u for u in me._undrained.waiting}
        replicas = me.s.replicas or 0
        replicated = None if not replicas or running else me._replicated == step
        out = self.reported = PreemptionOutcome(step, True, replicated, drained,
                                                 cut=not drained and (bool(running) or self.cut()))
        where = f"committed in the local tier ({me.step_dir(step)})"
        if replicas:
            where += {True: f", replicated to {replicas} peer(s)", False: ", NOT replicated to a peer",
                      None: ", replication not finished"}[replicated]
        where += (f", drained to {me.host.step_uri(step)}" if drained else ", not in object storage")
        log.info("objckpt: preemption save of step %d: %s", step, where)
        if drained:
            return out
        why = waiting[step].error if step in waiting else None
        where = f"the local tier{' and its replicas' if replicated else ''} only"
        if out.cut or running:
            log.warning("objckpt: the preemption deadline cut the drain of step %d to object storage%s; it is in %s: "
                        "a job restarted where these node folders are restores it, and drains it to %s", step,
                        " (still running: it stops at its next file or part)" if running else "", where,
                        me.host.root)
        else:
            log.warning("objckpt: the drain of step %d to object storage failed (%s); it is in %s, recorded for "
                        "the next job's drain", step, why, where)
        return out


__all__ = ["PreemptionOutcome", "TierPreemption"]
