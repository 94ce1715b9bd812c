"""Which step to restore, and where each rank's share comes from, agreed before any byte moves.

Every rank states what its node's folder holds (:func:`objckpt.tier.local.scan`:
the committed steps, the files each needs and those present); rank 0 adds the
steps committed in object storage.  From that one exchange every rank computes
the same :class:`RestorePlan`: the newest step for which every rank has a
source, and per rank

* ``"local"``: its node's folder holds every file its own load reads
  (:class:`objckpt.load.prepared.PreparedLoad`'s reads: the manifest, the rank indexes and the
  blobs its targets overlap; the whole step when the rank could not tell);
* ``"peer"``: it does not, but the union of all folders does (replicas): the
  files it lacks are received from the peers holding them, into memory
  (:func:`objckpt.tier.peers.fetch`), and the load reads through them;
* ``"object"``: the step is committed in object storage and no tier above has it.

A rank that cannot tell what it reads (its folder lacks the step's manifest: a
replaced node; no template: :meth:`latest_step`) counts as needing the whole step:
``local`` only where its folder holds all of it, ``peer`` only where all folders
together do.

A step is committed when some node's folder holds its manifest (or object storage
holds it); a folder of that step without the manifest (a node the metadata never
reached: its rank died before the spread) still counts with the blobs it holds
(``Holding.loose``).  A folder with blobs and no manifest on any node is an
uncommitted save, never a candidate.

A copy found damaged (a manifest that does not decode, a blob that fails its
crc32c check or is short) counts as absent where it is, and the source a rank's
load failed from is not offered to it again (``forbid``): the manager plans again
and the rank takes the next source, each skip named in :class:`Skip`.

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
    #: step -> the files this rank's load reads from its node's folder (absent: unknown)
    reads: dict[int, tuple[str, ...]] = field(default_factory=dict)
    #: step -> the files of a folder of that step without a manifest (they count for a step
    #: another node's folder commits)
    loose: dict[int, tuple[str, ...]] = field(default_factory=dict)
    #: step -> why the folder's manifest of that step does not decode (its files are in ``loose``)
    damaged: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Skip:
    """A source a restore did not take for a rank, and why (a damaged copy)."""

    rank: int
    step: int
    #: the source passed over: LOCAL (its node's folder), PEER or OBJECT
    source: str
    #: the damaged file, relative to the step ("" when the error did not name one)
    file: str
    why: str

    def __str__(self) -> str:
        what = f"{self.file} of step {self.step}" if self.file else f"step {self.step}"
        return f"rank {self.rank}: {self.source} copy of {what} skipped: {self.why}"


@dataclass
class RestorePlan:
    """The agreed step (None: nothing to restore) and each rank's source."""

    step: Optional[int]
    sources: list[str] = field(default_factory=list)
    #: files of the step (manifest, blobs, rank indexes) when a local tier holds its manifest
    needed: list[str] = field(default_factory=list)
    why: str = ""
    #: per rank, the files it must receive from peers (its reads its folder lacks); None for a
    #: ``peer`` rank that does not know its reads yet (it learns them from the metadata it fetches)
    wants: list[Optional[tuple[str, ...]]] = field(default_factory=list)

    def source(self, rank: int) -> str:
        return self.sources[rank]


@dataclass(frozen=True)
class RestoreReport:
    """What a tiered load did (``CheckpointManager``'s, on this rank; the per-rank parts are
    the same on every rank)."""

    step: int
    #: every rank's source, by rank
    sources: tuple[str, ...]
    #: the files this rank received from peers: name -> (the rank that sent it, bytes)
    received: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: bytes each rank received from peers (ranks that received nothing are absent)
    bytes_by_rank: dict[int, int] = field(default_factory=dict)
    #: rounds of fetching from peers (0: every rank local or from object storage)
    rounds: int = 0
    #: received files are held in memory for the load, never written to the node's folder
    written: bool = False
    #: seconds this rank spent fetching from peers (every round: exchanges and data)
    fetch_seconds: float = 0.0
    #: of this rank's received bytes, those received straight into its destination tensors
    in_place_bytes: int = 0
    #: the damaged copies passed over on the way (every rank's, the same on every rank)
    skipped: tuple[Skip, ...] = ()

    @property
    def bytes_moved(self) -> int:
        """Bytes every rank together received from peers."""
        return sum(self.bytes_by_rank.values())


def plan_restore(holdings: list[Holding], object_steps: list[int], peers: bool,
                 step: Optional[int] = None, forbid: Optional[dict[int, frozenset[str]]] = None) -> RestorePlan:
    """The newest step (or ``step`` when given) every rank can get; see the module docstring.
    ``peers``: whether missing files may be repaired from other nodes; ``forbid``: rank ->
    the sources its load already failed from (a damaged copy), not offered again."""
    forbid = forbid or {}
    local_steps = {s for h in holdings for s in h.steps}
    candidates = sorted(local_steps | set(object_steps), reverse=True)
    if step is not None:
        candidates = [s for s in candidates if s == step]
    skipped: list[str] = []
    for s in candidates:
        needed = next((h.steps[s].needed for h in holdings if s in h.steps), [])
        on_node = {h.node: set(h.steps[s].present) for h in holdings if s in h.steps}
        union = {f for h in holdings if s in h.steps for f in h.steps[s].present}
        union |= {f for h in holdings for f in h.loose.get(s, ())}
        whole = bool(needed) and set(needed) <= union
        sources: list[str] = []
        wants: list[Optional[tuple[str, ...]]] = []
        for r, h in enumerate(holdings):
            no = forbid.get(r, frozenset())
            here = on_node.get(h.node, set())
            reads = h.reads.get(s) if s in h.steps else None
            if reads is None:  # unknown: the whole step
                lacks: Optional[tuple[str, ...]] = tuple(f for f in needed if f not in here) if s in h.steps else None
                local, peer = s in h.steps and not lacks, whole
            else:
                lacks = tuple(f for f in reads if f not in here)
                local, peer = not lacks, set(lacks) <= union
            if local and LOCAL not in no:
                sources.append(LOCAL)
                wants.append(())
            elif peers and peer and PEER not in no:
                sources.append(PEER)
                wants.append(lacks if reads is not None else None)
            elif s in object_steps and OBJECT not in no:
                sources.append(OBJECT)
                wants.append(())
            else:
                break
        if len(sources) == len(holdings):
            why = f"step {s}: " + ", ".join(f"{src} on {sources.count(src)} rank(s)"
                                             for src in (LOCAL, PEER, OBJECT) if src in sources)
            if skipped:
                why += f" (newer step(s) not complete in any tier: {skipped})"
            return RestorePlan(s, sources, list(needed), why, wants)
        skipped.append(str(s))
    return RestorePlan(None, [], [], f"no step is complete in any tier (looked at: {skipped or 'none'})")
