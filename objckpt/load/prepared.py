"""One prepared load: the manifest decoded, the template matched, the reads planned, once.

Why: a load's preparation is the costly part of a restart before any tensor byte
moves (a many-tensor manifest takes ~0.1 s to decode, a Stateful value's
``state_dict()`` may gather, the match walks every key), and a tiered restore asks
it twice: which files a rank reads (to choose a source for them,
:mod:`objckpt.tier.restore`), then the load itself.  So both ask one
:class:`PreparedLoad`, built by :func:`prepare` from a read session
(:mod:`.session`) over some store:

* the manifest, decoded once, with its stored bytes (``raw``): the same committed
  checkpoint elsewhere (a node's folder, object storage) has the same bytes, so a
  load from another store reuses the preparation when its manifest's bytes equal
  these (:meth:`ReadSession.first`'s ``expect``), and prepares anew otherwise;
* the template expanded once (each Stateful value's ``state_dict()``,
  :func:`~objckpt.state.find_stateful`, handed in by a caller that took it already)
  and matched once (:func:`~objckpt.load.match.match_template`);
* the reads: :meth:`PreparedLoad.reads`, the files the rank reads
  (:mod:`.needs`), and :meth:`PreparedLoad.plan_for`, the read plan the fill
  executes (:func:`~objckpt.load.fill.plan_fill`), planned once per budget.

:func:`objckpt.load` goes through here too (:func:`~objckpt.load.pipeline.load_into`):
there is no second way to prepare a load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..format import keys as objkeys
from ..format.manifest import Manifest
from ..format.tree import iter_leaves
from ..layout import Resolver, resolver_for
from ..planning.read_plan import ReadPlan
from ..planning.symbolic import overlapping_pieces
from ..results import IOStats
from ..runtime import loop as _runtime
from ..runtime.memory import Budget
from ..state import Slot, StatefulValue, create_optimizer_state, find_stateful
from ..storage import ObjectStore
from .fill import TEMP_BUDGET, FillTarget, plan_fill
from .match import Match, match_template
from .needs import LoadReads, in_place
from .optimizer_match import check_optimizers
from .session import ReadSession


@dataclass(frozen=True)
class ReadOptions:
    """The options of a load that change what it reads (a preparation holds for these only)."""

    strict: bool = True
    cast: bool = False
    allow_pickle: bool = False
    #: load another kind of optimizer's state (:mod:`.optimizer_match`) instead of refusing it
    allow_optimizer_change: bool = False

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> "ReadOptions":
        """From ``objckpt.load``'s keyword arguments (the others are ignored)."""
        return cls(bool(kwargs.get("strict", True)), bool(kwargs.get("cast", False)),
                   bool(kwargs.get("allow_pickle", False)), bool(kwargs.get("allow_optimizer_change", False)))


@dataclass
class PreparedLoad:
    """One rank's load of one template from one committed manifest, prepared (see the module)."""

    uri: str
    manifest: Manifest
    #: the manifest's stored bytes: a load elsewhere reuses this preparation when its are these
    raw: bytes
    rank: int
    options: ReadOptions
    stateful: dict[str, StatefulValue]
    match: Match
    #: the chunk resolver, made when the reads are first known whole (v2: the rank indexes fetched)
    resolver: Optional[Resolver] = None
    _reads: Optional[LoadReads] = None
    _placed: bool = False  # whether _reads says where its whole chunks land
    _plans: dict[tuple[int, bool], ReadPlan] = field(default_factory=dict)

    def wanted(self) -> list[tuple[str, Any]]:
        """Every (stored key, box) the load reads: its targets' and its cast targets' pieces."""
        out = [(t.key, t.box) for t in self.match.targets]
        return out + [(c.key, box) for c in self.match.casts for box, _offs in c.pieces]

    def reads(self, store: ObjectStore, prefix: str, with_in_place: bool = False) -> LoadReads:
        """The files this rank reads, planned once (``store``: where the rank indexes are looked
        for; a rank index it lacks is returned as ``lacking``, and asked again next time)."""
        if self._reads is not None and (self._placed or not with_in_place):
            return self._reads
        m, wanted = self.manifest, self.wanted()
        files = [objkeys.MANIFEST_NAME]
        writers: set[int] = set()
        for key, box in wanted:
            lay = m.tensors[key].layout
            if lay is not None:
                writers.update(r for r, _p, _i in overlapping_pieces(m.tensors[key].shape, m.meshes[lay.mesh], lay,
                                                                     box))
        lacking = []
        for r in sorted(writers):
            ref = m.rank_indexes[r]
            if ref.spread:
                continue
            files.append(ref.name)
            if _runtime.run(store.head(m.index_key(prefix, r))) is None:
                lacking.append(ref.name)
        if lacking:
            return LoadReads(tuple(files), tuple(lacking))
        if self.resolver is None:
            self.resolver = resolver_for(m, store, prefix)
        _runtime.run(self.resolver.prefetch(wanted))
        blobs = {ov.chunk.blob for key, box in wanted for ov in self.resolver.overlapping(key, box)}
        files += sorted({m.blobs[b].name for b in blobs if not m.blobs[b].spread})
        plan = self.plan_for(self.match.targets) if with_in_place else None
        places = in_place(m, self.resolver, self.match.targets, self.match.casts, plan) if plan is not None else ()
        self._reads, self._placed = LoadReads(tuple(files), (), places), with_in_place
        return self._reads

    def plan_for(self, targets: Sequence[FillTarget], budget: Budget = TEMP_BUDGET,
                 verify: bool = True) -> Optional[ReadPlan]:
        """The read plan of this load's targets within ``budget``, planned once per budget; None
        when ``targets`` are not this load's (a cast batch's temporaries, a collective's share)."""
        mine = self.match.targets
        if self.resolver is None or len(targets) != len(mine) or any(a is not b for a, b in zip(targets, mine)):
            return None
        key = (budget.nbytes, verify)
        if key not in self._plans:
            self._plans[key] = plan_fill(self.manifest, self.resolver, mine, budget, verify)
        return self._plans[key]

    def serves(self, manifest: Manifest, rank: int, options: ReadOptions) -> bool:
        """Whether a load of ``manifest`` (the one a session handed out) on ``rank`` with
        ``options`` can take this preparation."""
        return manifest is self.manifest and rank == self.rank and options == self.options


def prepare(state: Any, session: ReadSession, rank: int, options: ReadOptions,
            stateful: Optional[dict[str, StatefulValue]] = None, manifest: Optional[Manifest] = None,
            stats: Optional[IOStats] = None, world_size: Optional[int] = None,
            slots: Optional[list[Slot]] = None) -> PreparedLoad:
    """``state``'s load on ``rank`` from ``session``'s checkpoint, prepared: ``manifest`` (else the
    session's first one: held, or fetched and decoded now) and ``stateful`` (else each Stateful
    value's ``state_dict()`` taken now) as given.  Raises what the load would raise before
    reading (no manifest: :class:`~objckpt.errors.NotFoundError`; a template that does not
    match: :class:`~objckpt.errors.StateDictMismatchError`; another kind of optimizer:
    :class:`~objckpt.errors.OptimizerMismatchError`).  ``world_size``: how many ranks load, when
    known (a shape mismatch then says whether the template looks like one rank's part).
    ``slots``: the template's leaves (:func:`~objckpt.state.template_slots` over ``stateful``),
    walked already by the caller: taken unless the load creates optimizer entries, which
    change them."""
    m = manifest if manifest is not None else session.first(stats)
    stateful = find_stateful(state) if stateful is None else stateful
    tree = m.rank_trees[rank] if m.rank_trees and rank < len(m.rank_trees) else m.tree
    # before anything is created in the template: another kind of optimizer is refused untouched
    check_optimizers(state, stateful, tree, session.uri, options.allow_optimizer_change)
    if create_optimizer_state(stateful, tree, m, options.allow_pickle, repr(session.uri)):
        slots = None  # the template grew: walked again
    match = match_template(state, m, dict(iter_leaves(tree)), session.uri, options.strict, options.cast, stateful,
                           world_size, slots)
    return PreparedLoad(session.uri, m, session.manifest_raw, rank, options, stateful, match)
