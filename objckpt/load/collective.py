"""Collective loads: storage serves each byte once per replica group.

When several ranks need the same bytes (data-parallel replicas, replicated
DTensor dims, the DP groups of a DP x TP layout), reading them from storage
on every rank multiplies the load on storage by the group size.  Here each
replica group reads its bytes once and spreads them over the interconnect
with torch.distributed collectives (NCCL with device tensors on GPU, gloo on
CPU):

* ``broadcast``: one member reads a batch and broadcasts it (the reader
  rotates over the batches);
* ``allgather``: every member reads a disjoint, byte-balanced share of each
  batch, then the group exchanges the shares;
* ``direct``: every rank reads what it needs itself (today's behaviour);
* ``auto``: per group, the cheapest of the three under
  :class:`~objckpt.planning.collective_plan.CostModel` (group size, bytes,
  storage vs interconnect bandwidth); ``direct`` without a process group.

Replica groups come from the load targets' layout, never from configuration:
a DTensor's group is the set of mesh ranks whose coordinates agree on every
non-``Replicate`` mesh dim (``Replicate`` dims and dims of size 1 vary); a
plain tensor in a multi-rank load is held whole by every rank of the process
group; an ``objckpt.Shard`` carries no replica information and is read
directly.  Because a group's members derive it independently, one small
exchange over the process group checks it: every member must list the group
with the same digest of its items (stored key, box, dtype), or the whole
group falls back to ``direct`` - on every rank alike, since all see the same
exchange.  A group's collectives run on the load's process group when the
group is all of it, on the DeviceMesh's own group when the tensors are
replicated over one mesh dim, else on a group made once with ``new_group``
(by every rank of the job, in sorted order; when the load's process group is
not the whole job that is impossible, and such a group reads directly).

Memory is bounded: a group's items are cut into batches of at most
``collective_bytes`` (row ranges of large tensors), and a rank holds at most
one batch of buffers besides its own destinations.  The batch draws from the
load's one budget (:class:`~objckpt.runtime.memory.OperationBudget`) beside the
load's cast temporaries, its read temporaries and its device ring: with a budget
the caller gave (``memory_bytes``), every rank says in the first exchange how
much of its budget is left, and the batches are cut to 4/9 of the least of
those, the same on every rank (:func:`batch_cap`): a batch may come out a
quarter larger than its cap, and the reads that fill it need room for its
largest piece besides.  A budget too small for the smallest batch a group can
move (:data:`~objckpt.runtime.memory.MIN_SLOT_BYTES`, or one row of its widest
tensor: rows are never cut) is a :class:`~objckpt.errors.MemoryBudgetError` on
every rank alike, naming the tightest rank's budget, the piece and the budget
that would do, before a byte is read (:meth:`CollectiveReader.refuse_below_floor`).
Large pieces travel
straight from and into destination memory when it is contiguous on the
collective's device.

Failures: every exchange carries each owner's read status (one header byte of
the packed collective), so a failed read stops its group before the data is
used; a last exchange over the whole process group then makes every rank
raise :class:`CollectiveLoadError` naming the failed rank(s) and objects.  A
rank that fails before the first exchange (no manifest, template mismatch)
still joins it with its error, so no rank is left waiting in a collective; a
direct load of several ranks ends with that exchange (one all-reduce), so a rank
that failed (a Stateful value's ``state_dict()`` raised) makes every rank raise.

All ranks of the process group must call ``load`` with the same
``read_strategy`` (the collectives pair up across ranks).  Collectives are
issued from the caller's thread, in an order every rank derives from the same
data: groups sorted by their ranks, batches in plan order.
"""
from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..distributed.comm import Comm, RankError, TensorGroup, TorchComm, refusal_class, subgroup
from ..distributed.placements import Ranks, mesh_group, replica_group
from ..errors import CollectiveLoadError, MemoryBudgetError, ObjckptError
from ..format.manifest import Manifest
from ..runtime.memory import COLLECTIVE_BYTES, MIN_SLOT_BYTES, Budget, OperationBudget, load_budget
from ..options import ReadStrategy
from ..planning.boxes import Box, rows_of
from ..planning.collective_plan import Batch, CostModel, ItemSize, plan_group
from ..results import IOStats
from ..storage import ObjectStore
from ..storage.naming import NamingStore
from .fill import FillTarget, Planned, fill_boxes

#: the cost model ``read_strategy="auto"`` uses; replace it to describe your storage and network
COST_MODEL = CostModel()

#: pieces at least this large are broadcast on their own, in place when the destination allows
SOLO_BYTES = 4 << 20


# --------------------------------------------------------------------------- items


@dataclass
class _Item:
    """One (stored key, box) a group needs; ``dests`` are this rank's destinations for it (tied: several)."""

    key: str
    box: Box
    dests: list[torch.Tensor]
    source: Any = None  # the state-dict value (its mesh may already have the group's process group)

    @property
    def dest(self) -> torch.Tensor:
        return self.dests[0]

    def size(self) -> ItemSize:
        shape = self.box[1]
        isz = self.dest.element_size()
        if not shape:
            return ItemSize(1, isz)
        return ItemSize(int(shape[0]), int(math.prod(shape[1:])) * isz)

    def rows(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return t if t.dim() == 0 else t[lo:hi]


def _digest(items: Sequence[_Item]) -> str:
    h = hashlib.sha1()
    for it in items:
        h.update(repr((it.key, it.box, str(it.dest.dtype))).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- the load


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (collectives move bytes, whatever the dtype)."""
    return t.detach().reshape(-1).view(torch.uint8)


def _usable_in_place(t: torch.Tensor, device: torch.device) -> bool:
    return t.is_contiguous() and t.device == device and type(t) in (torch.Tensor, torch.nn.Parameter) \
        and not t.is_conj() and not t.is_neg()



@dataclass(frozen=True)
class GroupSummary:
    """What a rank says of one replica group in the first exchange."""

    digest: str  # of the group's items (stored key, box, dtype): every member must agree
    nbytes: int
    wants_cuda: bool  # some destination is on a GPU
    mesh_has_group: bool  # the DeviceMesh already has a process group of exactly these ranks
    n_items: int = 1
    #: the widest row of the group's items (the smallest piece a batch can hold) and its key
    row_bytes: int = 0
    widest: str = ""


@dataclass(frozen=True)
class Hello:
    """A rank's first message in a collective load: its error, or its groups."""

    error: Optional[RankError]
    groups: dict[Ranks, GroupSummary]
    #: bytes left of this rank's load budget (a budget the caller gave; None: the defaults)
    room: Optional[int] = None
    #: that budget's name and size (named when it is the tightest and too small)
    budget: str = ""
    budget_bytes: int = 0


@dataclass(frozen=True)
class _Choice:
    """How one replica group reads, as every rank derives it from the first exchange."""

    how: str  # the group's collectives: "pg" (the load's), "mesh", "new", "none"; "" when not agreed
    strategy: ReadStrategy  # DIRECT when the group cannot (or should not) read collectively
    cuda: bool  # its collectives run on the GPU (NCCL)
    info: GroupSummary


def _summary(g: Ranks, its: Sequence[_Item]) -> GroupSummary:
    """What this rank says of group ``g`` (its items ``its``) in the first exchange."""
    sizes = [it.size() for it in its]
    widest = max(range(len(its)), key=lambda i: sizes[i].row_bytes)
    return GroupSummary(_digest(its), sum(sz.nbytes for sz in sizes), any(it.dest.is_cuda for it in its),
                        mesh_group(its[0].source, g) is not None, len(its), sizes[widest].row_bytes,
                        its[widest].key)


def room_cap(room: int) -> int:
    """The batch a budget with ``room`` bytes left allows: 4/9 of it, after
    :data:`MIN_SLOT_BYTES` for headers and alignment (a batch of cap C holds up to 1.25 C,
    its reads up to C more in temporaries)."""
    return (room - MIN_SLOT_BYTES) * 4 // 9


def room_needed(cap: int) -> int:
    """The least room whose :func:`room_cap` is ``cap`` (the inverse, rounded up)."""
    return MIN_SLOT_BYTES + -(-cap * 9 // 4)


def batch_cap(collective_bytes: int, rooms: Sequence[int]) -> int:
    """The bytes per collective batch: ``collective_bytes``, or less when the ranks' budgets
    have less ``rooms`` left (:func:`room_cap` of the least).  Never below one byte here:
    :meth:`CollectiveReader.refuse_below_floor` refuses budgets under the floor first."""
    return max(1, min([collective_bytes] + [room_cap(r) for r in rooms]))


@dataclass
class GroupPlan:
    """How one replica group reads: its members' tensor collectives, items, strategy, device."""

    group: TensorGroup
    items: list[_Item]
    strategy: ReadStrategy
    device: torch.device


class CollectiveReader:
    """One ``load``'s read path: direct, or collective over replica groups.

    Inactive (plain :func:`fill_boxes`) without a process group of more than one
    rank or with ``ReadStrategy.DIRECT``; the latter still ends with one outcome
    exchange (:meth:`failing_together`)."""

    def __init__(self, comm: Comm, read_strategy: ReadStrategy = ReadStrategy.AUTO,
                 budget: Budget = Budget(COLLECTIVE_BYTES), cost_model: Optional[CostModel] = None,
                 memory: Optional[OperationBudget] = None) -> None:
        self.comm = comm
        self.read_strategy = read_strategy
        self.budget = budget
        #: the load's one budget: cast temporaries, collective batches, read temporaries, device ring
        self.memory = memory if memory is not None else load_budget(None, budget.nbytes)
        #: bytes per collective batch, the same on every rank (set by the first exchange)
        self.batch_bytes = budget.nbytes
        self.model = cost_model or COST_MODEL
        self.active = isinstance(comm, TorchComm) and comm.world_size > 1 and read_strategy != ReadStrategy.DIRECT
        #: a direct load of several ranks: its ranks still learn each other's outcome (see failing_together)
        self.settles = isinstance(comm, TorchComm) and comm.world_size > 1 and not self.active
        self.exchanged = False
        #: bytes this rank received from other ranks over the interconnect
        self.received_bytes = 0
        #: how this rank's replicated bytes were read: "direct", "broadcast", "allgather" or "+"-joined
        self.strategy = "direct"
        self._error: Optional[RankError] = None
        self._cause: Optional[BaseException] = None

    # ----------------------------------------------------------------- failure handling

    @contextmanager
    def failing_together(self, uri: str = "") -> Iterator[None]:
        """Run a load of ``uri``; a failure on this rank before the first exchange still joins it.

        The other ranks are (or will be) waiting in that exchange; joining it
        with the error makes them raise too instead of waiting for the process
        group's timeout; every rank then raises the same error, of the first failed
        rank's class, naming each failed rank: this one too (chained from its own
        error) when its error is an ObjckptError, else it re-raises its own (a
        ``ValueError`` stays one where it happened).  A direct load of several
        ranks has no exchange of its own: it ends with that one exchange (one
        all-reduce when every rank loaded), so no rank returns while another
        raises, e.g. when a Stateful value's ``state_dict()`` failed on one rank."""
        try:
            yield
        except Exception as e:
            if (self.active or self.settles) and not self.exchanged:
                self.exchanged = True
                try:
                    everyone: Optional[list[Hello]] = self._first_exchange(Hello(RankError.of(e), {}))
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    everyone = None
                if everyone is not None and isinstance(e, ObjckptError):
                    self._cause = e
                    self._raise_for({r: h.error for r, h in enumerate(everyone) if h.error}, uri,
                                    "before reading" if self.active else "")
            raise
        if self.settles and not self.exchanged:
            self.exchanged = True
            errors = {r: h.error for r, h in enumerate(self._first_exchange(Hello(None, {}))) if h.error}
            if errors:
                self._raise_for(errors, uri, "")

    def _first_exchange(self, hello: Hello) -> list[Hello]:
        """Every rank's :class:`Hello`; just one all-reduce when nobody has an error or a group."""
        if not self.comm.any(bool(hello.error) or bool(hello.groups)):
            return [Hello(None, {})] * self.comm.world_size
        return self.comm.all_gather_object(hello)

    def _raise_for(self, errors: dict[int, RankError], uri: str, when: str) -> None:
        detail = "; ".join(f"rank {r}: {e.text}" for r, e in sorted(errors.items()))
        msg = f"collective load of {uri!r} failed {when + ' ' if when else ''}on rank(s) {sorted(errors)}: {detail}"
        # the class of the first rank's error too (e.g. StateDictMismatchError), so every rank raises alike
        failures = {r: e.text for r, e in errors.items()}
        exc = refusal_class(errors[min(errors)].kind, CollectiveLoadError)(msg, failures)
        if when == "before reading":
            exc.template_modified = False  # type: ignore[attr-defined]  # no byte was read (see load.pipeline)
        raise exc from self._cause

    # ----------------------------------------------------------------- the read path

    def fill(self, st: ObjectStore, prefix: str, m: Manifest, targets: Sequence[FillTarget],
             sources: Sequence[Any], stats: IOStats, uri: str = "", prepared: Optional[Planned] = None) -> None:
        """Fill ``targets`` (as :func:`fill_boxes` would); ``sources[i]`` is the state-dict value
        target ``i`` came from (its placements give the replica group); ``prepared``: the load's
        prepared reads (their plan serves where this rank reads every target directly)."""
        if not self.active:
            fill_boxes(st, prefix, m, targets, stats, memory=self.memory, prepared=prepared)
            return
        comm = self.comm
        pg_ranks: Ranks = comm.global_ranks()
        me = comm.global_rank()
        direct: list[FillTarget] = []
        by_group: dict[Ranks, dict[tuple[str, Box], _Item]] = {}
        for t, src in zip(targets, sources):
            ranks = replica_group(src, pg_ranks) if t.dest.numel() else None
            if ranks is None or len(ranks) < 2 or me not in ranks:
                direct.append(t)
                continue
            items = by_group.setdefault(ranks, {})
            ident = (t.key, tuple(map(tuple, t.box)))
            if ident in items:
                items[ident].dests.append(t.dest)
            else:
                items[ident] = _Item(t.key, t.box, [t.dest], src)
        mine = {g: [d[k] for k in sorted(d)] for g, d in by_group.items()}
        summary = {g: _summary(g, its) for g, its in mine.items()}
        self.exchanged = True
        strict = self.memory.strict
        everyone = self._first_exchange(Hello(None, summary, self.memory.room() if strict else None,
                                              self.memory.name if strict else "", self.memory.nbytes))
        errors = {r: h.error for r, h in enumerate(everyone) if h.error}
        if errors:
            self._raise_for(errors, uri, "before reading")
        self.batch_bytes = batch_cap(self.budget.nbytes, [h.room for h in everyone if h.room is not None])
        choices = self._choices(everyone, pg_ranks)
        self.refuse_below_floor(choices, everyone, uri)
        plans = self._plan_groups(mine, choices, direct)
        store = NamingStore(st)
        if direct:
            try:
                fill_boxes(store, prefix, m, direct, stats, memory=self.memory,  # type: ignore[arg-type]
                           prepared=prepared)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                self._fail(e, sorted({t.key for t in direct}), store)
        for plan in plans:
            self._run_group(plan, store, prefix, m, stats)
        if any(p.device.type == "cuda" for p in plans):
            torch.cuda.synchronize()
        if comm.any(self._error is not None):
            gathered = comm.all_gather_object(self._error)
            self._raise_for({r: e for r, e in enumerate(gathered) if e}, uri, "while reading")

    def _choices(self, everyone: list[Hello], pg_ranks: Ranks) -> dict[Ranks, _Choice]:
        """How every group any rank listed reads: the same answer on every rank (all see the
        same exchange), for groups this rank is not in too.

        A group reads collectively when every member lists it with the same items and a
        process group of exactly its members can be had: the load's own, the DeviceMesh's,
        or a new one (only when the load's process group is the whole job)."""
        index = {g: i for i, g in enumerate(pg_ranks)}
        listed: dict[Ranks, list[GroupSummary]] = {}
        for h in everyone:
            for g, info in h.groups.items():
                listed.setdefault(g, []).append(info)
        whole_job = set(pg_ranks) == set(range(self.comm.job_size()))
        backend = self.comm.backend()
        out: dict[Ranks, _Choice] = {}
        for g, infos in sorted(listed.items()):
            valid = (len(infos) == len(g) and len({i.digest for i in infos}) == 1
                     and all(g in everyone[index[r]].groups for r in g))
            how = ""
            if valid:
                if g == pg_ranks:
                    how = "pg"
                elif all(i.mesh_has_group for i in infos):
                    how = "mesh"
                elif whole_job:
                    how = "new"
                else:
                    how = "none"  # no way to make a group of a sub-set of a sub-group: direct
            cuda = "nccl" in backend and (any(i.wants_cuda for i in infos) or "gloo" not in backend)
            strategy = self.read_strategy if how in ("pg", "mesh", "new") else ReadStrategy.DIRECT
            if strategy == ReadStrategy.AUTO:
                info = infos[0]  # every member lists the same items (one digest)
                strategy = self.model.choose(len(g), info.nbytes, max(1, -(-info.nbytes // self.batch_bytes)),
                                             "nccl" if cuda else "gloo", info.n_items)
            out[g] = _Choice(how, strategy, cuda, infos[0])
        return out

    def refuse_below_floor(self, choices: dict[Ranks, _Choice], everyone: list[Hello], uri: str) -> None:
        """Under a budget the caller gave, refuse (on every rank alike, before a byte moves) a
        load whose budget cannot hold the smallest batch a group can move.

        A group read collectively moves at least :data:`MIN_SLOT_BYTES` a batch, or one row
        of its widest item when that is larger (a row is never cut); its batch needs
        :func:`room_needed` of that, and an all-gather one more slot of a row per further
        member (the member that reads a one-row batch sets every member's slot).  Below
        that the load used to run batches of a few bytes or one row each (thousands of
        collectives) with buffers past the budget.  Every rank sees every rank's room and
        every group, so every rank decides alike."""
        rooms = [(h.room, r) for r, h in enumerate(everyone) if h.room is not None]
        if not rooms:
            return
        room, rank = min(rooms)
        floors = []
        for g, c in choices.items():
            if c.strategy == ReadStrategy.DIRECT:
                continue
            row = c.info.row_bytes
            extra = (len(g) - 1) * row if c.strategy == ReadStrategy.ALLGATHER else 0
            floors.append((room_needed(max(MIN_SLOT_BYTES, row)) + extra, g, c))
        if not floors:
            return
        need, group, choice = max(floors, key=lambda x: (x[0], x[1]))
        if room >= need:
            return
        h = everyone[rank]
        held = h.budget_bytes - room
        row = choice.info.row_bytes
        piece = (f"one row of {choice.info.widest!r} ({row} bytes)" if row > MIN_SLOT_BYTES
                 else f"the smallest batch ({MIN_SLOT_BYTES} bytes)")
        if choice.strategy == ReadStrategy.ALLGATHER:
            piece += f", held in each of its {len(group)} members' slots"
        err = MemoryBudgetError(
            f"collective load of {uri!r}: replica group {list(group)} ({choice.strategy.value}) moves at least "
            f"{piece} at a time and needs {need} bytes of budget for it (its buffers, the reads that fill them "
            f"and {MIN_SLOT_BYTES} bytes of headroom), but the {h.budget} of rank {rank} ({h.budget_bytes} bytes) "
            f"has {room} left ({held} held by its other buffers), which would cut batches of "
            f"{max(batch_cap(self.budget.nbytes, [room]), 0)} bytes; give memory_bytes of at least {held + need} "
            "bytes on every rank, or read_strategy='direct'")
        err.template_modified = False  # type: ignore[attr-defined]  # refused before a byte was read
        raise err

    def _plan_groups(self, mine: dict[Ranks, list[_Item]], choices: dict[Ranks, _Choice],
                     direct: list[FillTarget]) -> list[GroupPlan]:
        """This rank's groups as :class:`GroupPlan` (the ones read directly join ``direct``),
        with the process groups :meth:`_choices` said to use."""
        handles: dict[Ranks, Any] = {}
        for g, c in sorted(choices.items()):  # the same calls, in the same order, on every rank
            if c.how == "pg":
                handles[g] = self.comm.group
            elif c.how == "mesh":
                handles[g] = mesh_group(mine[g][0].source, g) if g in mine else None
            elif c.how == "new":
                handles[g] = subgroup(g)
        plans: list[GroupPlan] = []
        used: set[str] = set()
        for g in sorted(mine):
            its, c = mine[g], choices[g]
            if c.strategy == ReadStrategy.DIRECT:
                direct.extend(FillTarget(it.key, it.box, d) for it in its for d in it.dests)
            else:
                device = torch.device("cuda", torch.cuda.current_device()) if c.cuda else torch.device("cpu")
                plans.append(GroupPlan(TensorGroup(g, handles[g]), its, c.strategy, device))
            used.add(c.strategy.value)
        # replica groups read directly (by choice or fallback) show up as "direct" next to the others
        self.strategy = "+".join(sorted(used, key=["allgather", "broadcast", "direct"].index)) or "direct"
        return plans

    def _fail(self, e: BaseException, keys: Sequence[str], store: NamingStore) -> None:
        if self._error is not None:
            return
        obj = f" (object {store.failed!r})" if store.failed else ""
        shown = ", ".join(map(repr, keys[:5])) + (" ..." if len(keys) > 5 else "")
        self._error = RankError.of(e, f"reading tensor(s) {shown}{obj}: ")
        self._cause = e

    def _run_group(self, plan: GroupPlan, store: NamingStore, prefix: str, m: Manifest, stats: IOStats) -> None:
        """The batches of one replica group; every member runs the same sequence of collectives."""
        k = len(plan.group.ranks)
        sizes = [it.size() for it in plan.items]
        cap = self.batch_bytes
        with torch.no_grad():  # destinations may be parameters that require grad
            # a share may end up to this far from 1/k to avoid splitting a tensor (see split_shares)
            snap = min(1 << 20, cap // (4 * k))
            for batch in plan_group(sizes, k, plan.strategy, cap, SOLO_BYTES, snap):
                # sized from what every rank had left: recorded, never refused on one rank alone
                with self.memory.hold(self._buffer_bytes(plan, batch), "a collective batch", sized=True):
                    if not self._batch(plan, batch, store, prefix, m, stats):
                        return  # a member failed: the group stops here (each member saw the same statuses)

    @staticmethod
    def _buffer_bytes(plan: GroupPlan, batch: Batch) -> int:
        """The buffers :meth:`_batch` makes: the packed slots, and a temporary for each solo
        piece whose destination cannot take it in place."""
        k = len(plan.group.ranks)
        n = k * batch.slot if batch.reader is None else batch.slot
        for p in batch.pieces:
            if p.solo:
                it = plan.items[p.item]
                if not _usable_in_place(it.rows(it.dest, p.lo, p.hi), plan.device):
                    n += p.nbytes
        return n

    def _batch(self, plan: GroupPlan, batch: Batch, store: NamingStore, prefix: str, m: Manifest,
               stats: IOStats) -> bool:
        """One batch: read my pieces, exchange the packed slots (status first), broadcast solo pieces,
        copy out.  False when some owner's read failed (every member sees it and stops)."""
        grp, items, device = plan.group, plan.items, plan.device
        k, me = len(grp.ranks), grp.me
        slot = batch.slot
        gather = batch.reader is None
        # allgather: one slot per member, mine read in place; broadcast: the reader's slot only
        buf = torch.empty(k * slot if gather else slot, dtype=torch.uint8, device=device)
        mine = buf[me * slot : (me + 1) * slot] if gather else buf
        solo: dict[int, torch.Tensor] = {}  # piece index -> the tensor it travels in
        reads: list[FillTarget] = []
        for n, p in enumerate(batch.pieces):
            it = items[p.item]
            shape = tuple(it.box[1])
            pshape = (p.hi - p.lo,) + shape[1:] if shape else ()
            if p.solo:
                d = it.rows(it.dest, p.lo, p.hi)
                t = d if _usable_in_place(d, device) else torch.empty(pshape, dtype=it.dest.dtype, device=device)
                solo[n] = t
                if p.owner == me:
                    reads.append(FillTarget(it.key, rows_of(it.box, p.lo, p.hi), t))
            elif p.owner == me:
                view = mine[p.offset : p.offset + p.nbytes].view(it.dest.dtype).view(pshape)
                reads.append(FillTarget(it.key, rows_of(it.box, p.lo, p.hi), view))
        if reads and self._error is None:
            try:
                fill_boxes(store, prefix, m, reads, stats, memory=self.memory)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - travels in the status byte, reported at the end
                self._fail(e, sorted({t.key for t in reads}), store)
        mine[0] = 0 if self._error is None else 1
        # the packed exchange: every owner's status byte, plus the small pieces
        if not gather:
            grp.broadcast(buf, batch.reader)  # type: ignore[arg-type]
            if batch.reader != me:
                self.received_bytes += slot
            failed = bool(buf[0].item())
        else:
            grp.all_gather(buf, slot)
            self.received_bytes += (k - 1) * slot
            failed = bool(buf.view(k, slot)[:, 0].any().item())
        if failed:
            return False
        for n, p in enumerate(batch.pieces):
            it = items[p.item]
            if p.solo:
                t = solo[n]
                grp.broadcast(_as_bytes(t), p.owner)
                if p.owner != me:
                    self.received_bytes += p.nbytes
                src = t
            else:
                shape = tuple(it.box[1])
                pshape = (p.hi - p.lo,) + shape[1:] if shape else ()
                base = p.owner * slot if gather else 0
                src = buf[base + p.offset : base + p.offset + p.nbytes].view(it.dest.dtype).view(pshape)
            for d in it.dests:
                dv = it.rows(d, p.lo, p.hi)
                if dv.data_ptr() != src.data_ptr() or dv.device != src.device:
                    dv.copy_(src)
        return True
