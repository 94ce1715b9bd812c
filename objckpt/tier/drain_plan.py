"""Who uploads which file of a step being drained: a pure function of what every node holds.

A drain moves every file the step's manifest names (its blobs and rank indexes), not
"the files this rank wrote": after a restart at another world size the rank that wrote a
file may not exist, or may sit on a node that never held it, and a copy that failed its
crc check must be replaced by another node's copy.  Every rank computes the same
:class:`DrainAssignment` from the same gathered :class:`NodeFiles` (one per rank, its
node's folder), so no further agreement is needed:

* a file goes to the rank that wrote it when that rank's node holds an unrejected copy
  (its own disk, the common case: no bytes cross a node for nothing);
* otherwise to the holding rank with the fewest bytes assigned so far (ties: lowest rank),
  spreading a lost node's files over the nodes that hold its replicas;
* a file no node holds (or every holder's copy was rejected) is ``unheld``: the drain
  cannot commit the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass(frozen=True)
class DrainFile:
    """One file a step's manifest names."""

    name: str
    size: int
    #: the rank (of the saving job) that wrote it; None: not known from the name
    writer: Optional[int] = None


@dataclass(frozen=True)
class NodeFiles:
    """What one rank's node folder holds of the step (picklable: it crosses ranks)."""

    node: str
    #: crc32c of the folder's manifest bytes; None: no readable manifest there
    manifest_crc: Optional[int]
    names: frozenset[str] = frozenset()


@dataclass
class DrainAssignment:
    """The files each rank uploads in one round, and those no node can supply."""

    by_rank: dict[int, list[str]] = field(default_factory=dict)
    unheld: list[str] = field(default_factory=list)

    def of(self, rank: int) -> list[str]:
        return self.by_rank.get(rank, [])


def assign(files: Sequence[DrainFile], holders: Sequence[NodeFiles],
           rejected: frozenset[tuple[str, str]] = frozenset()) -> DrainAssignment:
    """Each of ``files`` to one rank whose node holds it (``holders[r]``: rank ``r``'s), never
    a ``(name, node)`` in ``rejected`` (a copy that failed its check there); see the module."""
    out = DrainAssignment()
    load = [0] * len(holders)
    for f in files:
        able = [r for r, h in enumerate(holders) if f.name in h.names and (f.name, h.node) not in rejected]
        if not able:
            out.unheld.append(f.name)
            continue
        r = f.writer if f.writer is not None and f.writer in able else min(able, key=lambda r: (load[r], r))
        load[r] += f.size
        out.by_rank.setdefault(r, []).append(f.name)
    return out
