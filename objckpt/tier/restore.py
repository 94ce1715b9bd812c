"""Which step to restore, and where each rank's share comes from, agreed before any byte moves.

Every rank states what its node's folder holds (:func:`objckpt.tier.local.scan`:
the committed steps, the files each needs and those present); rank 0 adds the
steps committed in object storage.  From that one exchange every rank computes
the same :class:`RestorePlan`: the newest step for which every rank has a
source, and per rank

* ``"local"``: its node's folder holds the whole step;
* ``"peer"``: it does not, but the union of all folders does (replicas): the
  missing files are repaired from the peers holding them (:func:`objckpt.tier.peers.repair`);
* ``"object"``: the step is committed in object storage and no tier above has it.

A step the local tiers cannot complete and object storage does not hold is
skipped: an older one is restored instead, never a mix of steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .local import LocalStep

LOCAL = "local"
PEER = "peer"
OBJECT = "object"


@dataclass(frozen=True)
class Holding:
    """What one rank told the others: its node and its node folder's steps."""

    node: str
    steps: dict[int, LocalStep]


@dataclass
class RestorePlan:
    """The agreed step (None: nothing to restore) and each rank's source."""

    step: Optional[int]
    sources: list[str] = field(default_factory=list)
    #: files of the step (manifest, blobs, rank indexes) when a local tier holds its manifest
    needed: list[str] = field(default_factory=list)
    why: str = ""

    def source(self, rank: int) -> str:
        return self.sources[rank]


def plan_restore(holdings: list[Holding], object_steps: list[int], peers: bool,
                 step: Optional[int] = None) -> RestorePlan:
    """The newest step (or ``step`` when given) every rank can get; see the module docstring.
    ``peers``: whether missing files may be repaired from other nodes."""
    local_steps = {s for h in holdings for s in h.steps}
    candidates = sorted(local_steps | set(object_steps), reverse=True)
    if step is not None:
        candidates = [s for s in candidates if s == step]
    skipped: list[str] = []
    for s in candidates:
        needed = next((h.steps[s].needed for h in holdings if s in h.steps), [])
        node_complete = {h.node for h in holdings if s in h.steps and h.steps[s].complete}
        union = {f for h in holdings if s in h.steps for f in h.steps[s].present}
        whole = bool(needed) and set(needed) <= union
        sources: list[str] = []
        for h in holdings:
            if h.node in node_complete:
                sources.append(LOCAL)
            elif peers and whole:
                sources.append(PEER)
            elif s in object_steps:
                sources.append(OBJECT)
            else:
                break
        if len(sources) == len(holdings):
            why = f"step {s}: " + ", ".join(f"{src} on {sources.count(src)} rank(s)"
                                             for src in (LOCAL, PEER, OBJECT) if src in sources)
            if skipped:
                why += f" (newer step(s) not complete in any tier: {skipped})"
            return RestorePlan(s, sources, list(needed), why)
        skipped.append(str(s))
    return RestorePlan(None, [], [], f"no step is complete in any tier (looked at: {skipped or 'none'})")
