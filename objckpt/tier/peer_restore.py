"""A rank's restore from its node's folder and its peers: what it reads, what it receives.

Two steps of the tiered restore (the manager's ``load``, :mod:`objckpt.tier.restore`
for the plan):

* :func:`step_reads`, before the plan's one exchange: for the newest step its node's
  folder holds but not whole, the files this rank's load of the caller's template reads
  there, from that step's load prepared once (:class:`Prepared`,
  :mod:`objckpt.load.prepared`; kept for the load itself, :func:`load_of`).  A rank
  whose folder holds those is ``local`` even though other ranks' files are elsewhere.
* :func:`receive`, after it, on every rank when some rank is ``peer``: rounds of
  :func:`objckpt.tier.peers.fetch` until every ``peer`` rank holds, in memory, each
  file its load reads that its folder lacks.  A rank whose folder holds the step's
  manifest asks for its blobs in the first round; one whose folder lacks it (a
  replaced node) asks for the manifest, then for the rank indexes its template
  needs, then for its blobs: at most three rounds, the same number on every rank; its
  load is prepared once, when the manifest has arrived.
  Each chunk the load will read whole into host memory (its read plan's direct
  reads) is received straight into the destination tensor; a blob read otherwise
  (partly, into device memory, through a cast) comes whole into new memory.  The
  load then reads through an :class:`~objckpt.tier.overlay.OverlayStore` (memory
  over the folder), which finds the in-place bytes where they are and only checks
  their crc32c: nothing is written to the folder, before or after.
"""
from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional

from ..distributed.comm import Comm, RankError, refusal_class
from ..format import keys as objkeys
from ..errors import NotFoundError
from ..load.needs import LoadReads
from ..load.prepared import PreparedLoad, ReadOptions, prepare
from ..load.session import ReadSession
from ..state import find_stateful
from ..storage.base import ObjectStore
from ..storage.local import LocalStore
from .errors import TierRestoreError
from .local import LocalStep
from .overlay import OverlayStore, Segment
from .peers import Range, fetch
from .restore import PEER, RestorePlan
from .topology import Topology

log = logging.getLogger("objckpt.manager")

#: rounds of :func:`receive`: the manifest, the rank indexes, the blobs (one more is an error)
MAX_ROUNDS = 3

@dataclass
class Prepared:
    """The loads this rank prepared from its node's folder while planning (each step's at most
    once per restore: a retry prepares again only a step whose manifest bytes changed)."""

    #: the caller's template, and each of its Stateful values' ``state_dict()``, taken once
    state: Any
    stateful: dict[str, Any]
    options: ReadOptions
    #: step -> its load, prepared from this node's folder (or from a peer's manifest)
    loads: dict[int, PreparedLoad] = field(default_factory=dict)
    #: how many ranks restore (a shape mismatch says whether the template looks like one rank's part)
    world_size: Optional[int] = None

    @classmethod
    def of(cls, state: Any, load_kwargs: dict[str, Any], world_size: Optional[int] = None) -> "Prepared":
        return cls(state, find_stateful(state), ReadOptions.of(load_kwargs), world_size=world_size)

    def prepare(self, session: ReadSession, rank: int) -> PreparedLoad:
        """The load of ``session``'s checkpoint, prepared (its manifest decoded, matched)."""
        return prepare(self.state, session, rank, self.options, self.stateful, world_size=self.world_size)


def prepared_everywhere(comm: Comm, state: Any, load_kwargs: dict[str, Any]) -> Prepared:
    """:meth:`Prepared.of` on every rank, agreed (one all-gather where there are several
    ranks): a state that cannot be read on one rank (a Stateful's ``state_dict()`` raising)
    fails the restore on every rank with that rank's error class, naming it, before any rank
    waits in the plan's collectives for a rank that already gave up."""
    failed: Optional[BaseException] = None
    prepared: Optional[Prepared] = None
    try:
        prepared = Prepared.of(state, load_kwargs, comm.world_size)
    except Exception as e:  # noqa: BLE001 - said to every rank below
        if comm.world_size == 1:
            raise
        failed = e
    if comm.world_size > 1:
        mine = RankError.of(failed) if failed is not None else None
        bad = {r: o for r, o in enumerate(comm.all_gather_object(mine)) if o is not None}
        if bad:
            raise refusal_class(bad[min(bad)].kind, TierRestoreError)(
                f"restoring: the state to load into could not be read on rank(s) {sorted(bad)}: "
                + "; ".join(f"rank {r}: {o.text}" for r, o in sorted(bad.items())[:4])) from failed
    if prepared is None:  # not reached: a rank that failed is in ``bad``
        raise TierRestoreError("restoring: the state to load into could not be read") from failed
    return prepared


def step_reads(steps: dict[int, LocalStep], step_dir: Any, rank: int, prepared: Prepared,
               held: dict[int, tuple[bytes, Any]], only: Optional[int] = None) -> dict[int, tuple[str, ...]]:
    """Step -> the files this rank's load of ``state`` reads from its node's folder
    (``step_dir(step)``) of ``prepared``'s template, newest step first, until one whose files its folder holds (or
    held whole: a whole folder serves any load): that is the step a healthy restart
    restores, its load prepared once here (kept in ``prepared``; ``held``: each step's
    manifest as the folder scan read it).  An older step, and one whose reads cannot be
    told (a template that does not match it, a rank index missing), is left out: the plan
    then counts the rank as needing all of it, and the load itself raises what is wrong."""
    out: dict[int, tuple[str, ...]] = {}
    store = LocalStore("/")
    for s in sorted(steps, reverse=True):
        held_step = steps[s]
        if only is not None and s != only:
            continue
        if held_step.complete:
            break
        try:
            p = _prepared_of(prepared, s, step_dir(s), store, rank, held.get(s))
            got = p.reads(store, _prefix(step_dir(s)))
        except Exception as e:  # noqa: BLE001 - every rank must reach the plan's exchange; the load reports it
            log.debug("objckpt: cannot tell what rank %d reads of local step %d (%s: %s)", rank, s,
                      type(e).__name__, e)
            continue
        if got.known:
            out[s] = got.files
            if set(got.files) <= set(held_step.present):
                break
    return out


def _prefix(step_dir: Any) -> str:
    """The folder's key prefix under ``LocalStore("/")``."""
    return pathlib.Path(step_dir).absolute().as_posix().strip("/")


def _prepared_of(prepared: Prepared, step: int, step_dir: Any, store: ObjectStore, rank: int,
                 held: Optional[tuple[bytes, Any]]) -> PreparedLoad:
    """Step ``step``'s prepared load: the one prepared before when its manifest's bytes are
    still ``held``'s, else prepared now from ``held`` (or the folder's manifest)."""
    p = prepared.loads.get(step)
    if p is not None and (held is None or held[0] == p.raw):
        return p
    p = prepared.prepare(ReadSession(str(step_dir), store=store, held=held), rank)
    prepared.loads[step] = p
    return p


def load_of(prepared: Prepared, step: int, uri: str, store: Optional[ObjectStore],
            held: Optional[tuple[bytes, Any]], rank: int) -> Optional[PreparedLoad]:
    """Step ``step``'s prepared load, for the load from ``uri`` (``store``) to take: the one
    prepared while planning or receiving, else prepared now from ``held`` (the folder scan's
    manifest bytes: no request) and kept, so that a retry of the restore finds it.  The load
    takes it where its manifest has the same bytes (object storage's is fetched and
    compared, not decoded: :func:`objckpt.load.pipeline.load_into`), else prepares anew;
    None: nothing at hand (the load prepares its own)."""
    p = prepared.loads.get(step)
    if p is None and held is not None:
        p = prepared.loads[step] = prepared.prepare(ReadSession(uri, store=store, held=held), rank)
    return p


@dataclass
class Received:
    """What :func:`receive` brought this rank, and what every rank received."""

    #: store key -> the pieces received of that file, (offset, uint8 tensor), this rank's
    segments: dict[str, list[Segment]] = field(default_factory=dict)
    #: name -> (the rank that sent it, bytes), this rank's
    sources: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: bytes each rank received (the same on every rank)
    bytes_by_rank: dict[int, int] = field(default_factory=dict)
    #: bytes this rank received straight into its load's destination tensors
    in_place_bytes: int = 0
    rounds: int = 0
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(int(t.numel()) for segs in self.segments.values() for _o, t in segs)


def _wants(reads: LoadReads, have: Any) -> tuple[list[str], list[Range]]:
    """The files and ranges to ask for: every file the load reads that ``have(name)`` says is
    not here, the blobs it reads only in place as their ranges (once each), the rest whole."""
    lacking = [n for n in reads.files if not have(n)]
    ranged = {p.file for p in reads.in_place} & set(lacking)
    seen: set[tuple[str, int]] = set()
    ranges = []
    for p in reads.in_place:
        if p.file in ranged and (p.file, p.offset) not in seen:
            seen.add((p.file, p.offset))
            ranges.append(Range(p.file, p.offset, p.length, p.dest))
    return [n for n in lacking if n not in ranged], ranges


def _peer_reads(prepared: Prepared, step: int, step_dir: pathlib.Path, overlay: OverlayStore, rank: int) -> LoadReads:
    """What a ``peer`` rank's load reads, with where its whole chunks land, from the load
    prepared once its manifest is here (its folder's, else a peer's): lacking the manifest
    until then."""
    load = prepared.loads.get(step)
    if load is None:
        try:
            load = prepared.loads[step] = prepared.prepare(ReadSession(str(step_dir), store=overlay), rank)
        except NotFoundError:
            return LoadReads((), (objkeys.MANIFEST_NAME,))
    return load.reads(overlay, _prefix(step_dir), with_in_place=True)


def receive(comm: Comm, topology: Topology, plan: RestorePlan, step_dir: pathlib.Path, prepared: Prepared,
            piece_bytes: Optional[int] = None,
            memory_bytes: Optional[int] = None, hidden: frozenset[str] = frozenset()) -> Received:
    """Collective (every rank, when some rank's source is ``peer``): see the module docstring.
    ``prepared``: this rank's load of the plan's step, prepared while planning, or prepared
    here once the manifest is received (kept there for the load).  ``hidden``: files of the
    folder found damaged: absent for this rank's reads (received instead) and never offered
    to the others."""
    me = comm.rank
    step = plan.step if plan.step is not None else -1
    finished = plan.sources[me] != PEER
    prefix = _prefix(step_dir)  # the folder's keys under LocalStore("/")
    base = LocalStore("/")
    out = Received()
    got: dict[str, list[Segment]] = {}  # by name
    kw: dict[str, Any] = {} if piece_bytes is None else {"piece_bytes": piece_bytes}
    while True:
        wants: list[str] = []
        ranges: list[Range] = []
        more, problem = False, ""
        if not finished:
            try:
                overlay = OverlayStore(base, {objkeys.join(prefix, n): v for n, v in got.items()},
                                       frozenset(objkeys.join(prefix, n) for n in hidden))
                reads = _peer_reads(prepared, step, step_dir, overlay, me)
                if reads.lacking:
                    wants, more = [n for n in reads.lacking if n not in got], True
                else:
                    wants, ranges = _wants(reads, lambda n: n in got or (n not in hidden
                                                                         and (step_dir / n).is_file()))
                    finished = True
            except Exception as e:  # noqa: BLE001 - carried by the round's exchange: every rank raises
                problem, finished = f"rank {me}: cannot tell what its load reads: {type(e).__name__}: {e}", True
        if out.rounds >= MAX_ROUNDS and (wants or ranges or more):
            problem = problem or (f"rank {me}: still lacks {wants[:4]} after {MAX_ROUNDS} rounds of fetching "
                                  "from peers")
        f = fetch(comm, topology, step_dir, [] if problem else wants, ranges=[] if problem else ranges, more=more,
                  problem=problem, memory_bytes=memory_bytes, hidden=hidden, **kw)
        out.rounds += 1
        out.seconds += f.report.seconds
        if not f.report.complete:
            raise TierRestoreError(f"restoring {str(step_dir)!r} from peers: files no rank holds after all: "
                                   f"{dict(list(f.report.missing.items())[:4])}")
        for r in f.report.restored:
            out.bytes_by_rank[r.rank] = out.bytes_by_rank.get(r.rank, 0) + r.size
            if r.rank == me:
                out.sources[r.file] = (r.source, r.size)
        out.in_place_bytes += sum(r.length for r in ranges)
        for name, segs in f.segments.items():
            got.setdefault(name, []).extend(segs)
        if not f.more:
            break
    out.segments = {objkeys.join(prefix, n): v for n, v in got.items()}
    return out
