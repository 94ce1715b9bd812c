"""A rank's restore from its node's folder and its peers: what it reads, what it receives.

Two steps of the tiered restore (the manager's ``load``, :mod:`objckpt.tier.restore`
for the plan):

* :func:`step_reads`, before the plan's one exchange: for each step its node's folder
  holds but not whole, the files this rank's load of the caller's template reads
  there (:func:`objckpt.load.needs.load_reads`).  A rank whose folder holds those is
  ``local`` even though other ranks' files are elsewhere.
* :func:`receive`, after it, on every rank when some rank is ``peer``: rounds of
  :func:`objckpt.tier.peers.fetch` until every ``peer`` rank holds, in memory, each
  file its load reads that its folder lacks.  A rank that knew its reads at planning
  time asks for them in the first round; a rank whose folder lacks the step's manifest
  (a replaced node) asks for the manifest, then for the rank indexes its template
  needs, then for its blobs: at most three rounds, the same number on every rank.
  The load then reads through an :class:`~objckpt.tier.overlay.OverlayStore` (memory
  over the folder): nothing is written to the folder, before or after.
"""
from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..distributed.comm import Comm
from ..format import keys as objkeys
from ..load.needs import LoadReads, load_reads
from ..load.session import ReadSession
from ..storage import split_uri
from ..storage.base import ObjectStore
from ..storage.local import LocalStore
from .errors import TierRestoreError
from .local import LocalStep
from .overlay import OverlayStore
from .peers import fetch
from .restore import PEER, RestorePlan
from .topology import Topology

log = logging.getLogger("objckpt.manager")

#: rounds of :func:`receive`: the manifest, the rank indexes, the blobs (one more is an error)
MAX_ROUNDS = 3

#: the options of ``objckpt.load`` that change what it reads
_READ_OPTIONS = ("strict", "cast", "allow_pickle")


def _reads_of(state: Any, step_dir: pathlib.Path, store: ObjectStore, rank: int,
              load_kwargs: dict[str, Any]) -> LoadReads:
    kw = {k: load_kwargs[k] for k in _READ_OPTIONS if k in load_kwargs}
    return load_reads(state, ReadSession(str(step_dir), store=store), rank, **kw)


def step_reads(steps: dict[int, LocalStep], step_dir: Any, state: Any, rank: int, load_kwargs: dict[str, Any],
               only: Optional[int] = None) -> dict[int, tuple[str, ...]]:
    """Step -> the files this rank's load of ``state`` reads from its node's folder
    (``step_dir(step)``), for each held step that is not whole there (a whole one serves
    any load).  A step whose reads cannot be told (a template that does not match it, a
    rank index missing) is left out: the plan then counts the rank as needing all of it,
    and the load itself raises what is wrong."""
    out: dict[int, tuple[str, ...]] = {}
    store = LocalStore("/")
    for s, held in steps.items():
        if held.complete or (only is not None and s != only):
            continue
        try:
            got = _reads_of(state, step_dir(s), store, rank, load_kwargs)
        except Exception as e:  # noqa: BLE001 - every rank must reach the plan's exchange; the load reports it
            log.debug("objckpt: cannot tell what rank %d reads of local step %d (%s: %s)", rank, s,
                      type(e).__name__, e)
            continue
        if got.known:
            out[s] = got.files
    return out


@dataclass
class Received:
    """What :func:`receive` brought this rank, and what every rank received."""

    #: store key -> the file's bytes (uint8), this rank's
    files: dict[str, torch.Tensor] = field(default_factory=dict)
    #: name -> (the rank that sent it, bytes), this rank's
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: bytes each rank received (the same on every rank)
    bytes_by_rank: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(int(t.numel()) for t in self.files.values())


def receive(comm: Comm, topology: Topology, plan: RestorePlan, step_dir: pathlib.Path, state: Any,
            load_kwargs: dict[str, Any], piece_bytes: Optional[int] = None,
            memory_bytes: Optional[int] = None) -> Received:
    """Collective (every rank, when some rank's source is ``peer``): see the module docstring."""
    me = comm.rank
    peer = plan.sources[me] == PEER
    prefix = split_uri(str(step_dir))[2].strip("/")
    base = LocalStore("/")
    out = Received()
    got: dict[str, torch.Tensor] = {}  # by name
    planned: Optional[tuple[str, ...]] = plan.wants[me] if peer and me < len(plan.wants) else ()
    finished = not peer
    kw: dict[str, Any] = {} if piece_bytes is None else {"piece_bytes": piece_bytes}
    while True:
        want: tuple[str, ...] = ()
        more, problem = False, ""
        if not finished:
            if planned is not None:
                want, finished = planned, True
            else:
                try:
                    overlay = OverlayStore(base, {objkeys.join(prefix, n): t for n, t in got.items()})
                    reads = _reads_of(state, step_dir, overlay, me, load_kwargs)
                    if reads.lacking:
                        want, more = tuple(n for n in reads.lacking if n not in got), True
                    else:
                        held = set(got) | {n for n in reads.files if (step_dir / n).is_file()}
                        want, finished = tuple(n for n in reads.files if n not in held), True
                except Exception as e:  # noqa: BLE001 - carried by the round's exchange: every rank raises
                    problem, finished = f"rank {me}: cannot tell what its load reads: {type(e).__name__}: {e}", True
            planned = None
        if out.rounds >= MAX_ROUNDS and (want or more):
            problem = problem or (f"rank {me}: still lacks {list(want)[:4]} after {MAX_ROUNDS} rounds of "
                                  "fetching from peers")
        f = fetch(comm, topology, step_dir, list(want) if not problem else [], more=more, problem=problem,
                  memory_bytes=memory_bytes, **kw)
        out.rounds += 1
        out.seconds += f.report.seconds
        if not f.report.complete:
            raise TierRestoreError(f"restoring {str(step_dir)!r} from peers: files no rank holds after all: "
                                   f"{dict(list(f.report.missing.items())[:4])}")
        for r in f.report.restored:
            out.bytes_by_rank[r.rank] = out.bytes_by_rank.get(r.rank, 0) + r.size
            if r.rank == me:
                out.sources[r.file] = (r.source, r.size)
        got.update(f.files)
        if not f.more:
            break
    out.files = {objkeys.join(prefix, n): t for n, t in got.items()}
    return out
