"""Copy each rank's local share to peer ranks on other nodes, and fill what a rank lacks.

:func:`replicate` sends every rank's listed files to its ``k`` peers
(:meth:`Topology.peers_for`); :func:`repair` gives every rank's folder the files it
needs from whichever rank still holds them; :func:`fetch` gives every rank, in its
own memory, the files and byte ranges its restore reads (nothing written: see its
docstring).  All are collectives of every rank of the group, and all move bytes the
same way (:mod:`objckpt.tier.transfer`): one
all-gather of what each rank has, a plan every rank computes alike from it,
point-to-point sends in bounded pieces over objckpt's own group (gloo from host
buffers, or NCCL through device buffers: :mod:`objckpt.tier.wire`), one
all-gather of the outcome, and only then the renames.  So:

* memory stays bounded: two buffers per partner and direction (``piece_bytes``, 16 MiB by
  default, smaller where ``memory_bytes`` requires), from the process-wide host pool and
  drawn from the copy's budget, whatever the files' sizes;
* a received file appears under its final name only when every rank finished
  (temp file + fsync + rename); a rank that dies mid-way leaves temp files only,
  and every other rank raises :class:`~objckpt.errors.CollectiveError` (a closed
  connection at once; at worst after the collective timeout), never a hang;
* a local failure (a file that vanished, a full disk) does not stop the exchange
  half-way: the rank keeps the protocol going, the outcome all-gather carries the
  failure, and every rank raises :class:`PeerCopyError` alike.

The tier's groups are separate from the training's groups and from an async
save's (:func:`~objckpt.tier.topology.tier_comm`), so both calls may run in a
background thread.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..distributed.comm import Comm, RankError
from ..format.keys import MANIFEST_NAME
from ..format.manifest import Manifest, decode
from .topology import Topology, TopologyError, tier_comm
from .transfer import (PIECE_BYTES, PeerCopyError, RankTraffic, Transfer, copy_budget, copy_failures, copy_problem,
                       is_temp_name, run_transfers)

__all__ = ["PIECE_BYTES", "Fetched", "Range", "PeerCopyError", "RankTraffic", "ReplicaReport", "RepairReport", "Restored",
           "fetch", "files_of_rank", "replicate", "repair"]


@dataclass(frozen=True)
class ReplicaReport:
    """What :func:`replicate` did, the same on every rank."""

    k: int
    #: rank -> the ranks that now hold a copy of its files
    peers: dict[int, tuple[int, ...]]
    #: every rank's traffic, by rank
    ranks: tuple[RankTraffic, ...]
    #: wall time of the whole call on this rank
    seconds: float

    @property
    def bytes_sent(self) -> int:
        return sum(t.bytes_sent for t in self.ranks)

    def throughput(self, rank: int) -> float:
        """Bytes per second that ``rank`` sent (its data phase)."""
        t = self.ranks[rank]
        return t.bytes_sent / t.seconds if t.seconds > 0 else 0.0


@dataclass(frozen=True)
class Restored:
    """One file a rank lacked and got from another rank."""

    rank: int
    file: str
    source: int
    size: int


@dataclass(frozen=True)
class RepairReport:
    """What :func:`repair` did, the same on every rank."""

    #: each file a rank lacked and received, with the rank that sent it
    restored: tuple[Restored, ...]
    #: rank -> files of its ``needed`` that no rank had (read them from object storage)
    missing: dict[int, tuple[str, ...]]
    ranks: tuple[RankTraffic, ...]
    seconds: float

    def source_of(self, rank: int, file: str) -> Optional[int]:
        """The rank that sent ``file`` to ``rank`` (None: it was not sent to it)."""
        return next((r.source for r in self.restored if r.rank == rank and r.file == file), None)

    def missing_for(self, rank: int) -> tuple[str, ...]:
        return self.missing.get(rank, ())

    @property
    def complete(self) -> bool:
        """Whether every rank now holds everything it needed."""
        return not any(self.missing.values())


# --------------------------------------------------------------------------- which files are whose


def files_of_rank(step_dir: pathlib.Path, rank: int, *, manifest: Optional[Manifest] = None,
                  with_manifest: bool = False) -> list[str]:
    """The files of the committed checkpoint in ``step_dir`` that rank ``rank`` wrote
    as its share, relative to ``step_dir``: its blobs (``Blob.rank``) and its rank
    index (format v2+); with ``with_manifest``, also ``manifest.json`` on rank 0 (the
    commit record it wrote; a local tier that gives every node the metadata
    anyway leaves it out).  ``manifest`` saves the read when the caller holds it.
    Spread objects (which live outside the step) are left out."""
    if manifest is None:
        path = pathlib.Path(step_dir) / MANIFEST_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            from ..errors import NotFoundError

            raise NotFoundError(f"no committed checkpoint at {str(step_dir)!r}: {MANIFEST_NAME} is missing") from None
        manifest = decode(data, str(path))
    out = [b.name for b in manifest.blobs if b.rank == rank and not b.spread]
    if rank < len(manifest.rank_indexes) and not manifest.rank_indexes[rank].spread:
        out.append(manifest.rank_indexes[rank].name)
    if rank == 0 and with_manifest:
        out.append(MANIFEST_NAME)
    return out


def _held(step_dir: pathlib.Path, names: Sequence[str]) -> dict[str, int]:
    """Which of ``names`` are regular files under ``step_dir``, with their sizes."""
    out: dict[str, int] = {}
    for name in names:
        try:
            st = os.stat(_under(step_dir, name))
        except (FileNotFoundError, NotADirectoryError):
            continue
        if os.path.isfile(_under(step_dir, name)):
            out[name] = st.st_size
    return out


def _under(root: pathlib.Path, rel: str) -> pathlib.Path:
    """``root / rel`` for a plain relative path; :class:`PeerCopyError` (a ValueError)
    for an absolute path, ``..``, a temp name or anything else that would leave ``root``."""
    parts = rel.split("/")
    if (not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel
            or any(p in ("", ".", "..") for p in parts) or is_temp_name(parts[-1])):
        raise PeerCopyError(f"{rel!r} is not a plain relative path under {str(root)!r}", {})
    return pathlib.Path(root) / rel


def _dir_id(topology: Topology, rank: int, step_dir: pathlib.Path) -> tuple[str, str]:
    """Ranks that share a node and a step directory hold the same files."""
    return topology.node_of(rank), str(pathlib.Path(step_dir).resolve())


# --------------------------------------------------------------------------- replicate


@dataclass(frozen=True)
class _Offer:
    """What one rank states before a replication: its setting and its files."""

    k: int
    files: dict[str, int]  # rel -> size
    problem: Optional[RankError] = None


def replicate(comm: Comm, topology: Topology, local_step_dir: pathlib.Path, files: list[str], k: int, *,
              peer_dir: Optional[Callable[[int], pathlib.Path]] = None,
              piece_bytes: int = PIECE_BYTES, memory_bytes: Optional[int] = None) -> ReplicaReport:
    """Collective: copy this rank's ``files`` (relative to ``local_step_dir``) to its
    ``k`` peers (:meth:`Topology.peers_for`), which write them under their own
    ``local_step_dir``, or under ``peer_dir(src_rank)`` when given.

    Every rank checks the others' settings before a byte moves: a ``k`` that differs
    across ranks or does not fit the topology (``k >=`` nodes or world size) is a
    :class:`~objckpt.tier.topology.TopologyError`, a listed file this rank does not
    have a :class:`PeerCopyError`, on every rank alike.  Received files appear
    atomically, once every rank has finished; see the module docstring for failures.
    ``piece_bytes`` bounds each message; ``memory_bytes`` (default
    :data:`~objckpt.runtime.memory.TIER_COPY_BYTES`) bounds the piece buffers together
    (two per partner and direction): pieces shrink to fit it, and a budget below two
    minimal pieces per partner and direction is a
    :class:`~objckpt.errors.MemoryBudgetError` on every rank before a byte moves."""
    t0 = time.perf_counter()
    budget = copy_budget(memory_bytes)
    step = pathlib.Path(local_step_dir)
    problem = ""
    try:
        held = _held(step, files)
        lacking = [f for f in files if f not in held]
        if lacking:
            problem = f"rank {comm.rank}: {len(lacking)} listed file(s) not under {str(step)!r}: {lacking[:5]}"
    except PeerCopyError as e:
        held, problem = {}, f"rank {comm.rank}: {e}"
    offer = _Offer(k, held, copy_problem(problem))
    tc = tier_comm(comm) if comm.world_size > 1 else comm
    offers: list[_Offer] = tc.all_gather_object(offer) if comm.world_size > 1 else [offer]
    ks = sorted({o.k for o in offers})
    if len(ks) > 1:
        raise TopologyError(f"replicate: ranks disagree on replicas: "
                            f"{ {r: o.k for r, o in enumerate(offers)} }; every rank must pass the same k")
    topology.check_replicas(k)
    if topology.world_size != comm.world_size:
        raise TopologyError(f"the topology has {topology.world_size} ranks but the group has {comm.world_size}")
    problems = copy_failures([o.problem for o in offers])
    if problems:
        raise PeerCopyError("replicate: nothing was sent: " + "; ".join(problems.values()), problems)
    peers = {r: tuple(topology.peers_for(r, k)) for r in range(comm.world_size)}
    plan = [Transfer(src, dst, rel, size)
            for src in range(comm.world_size) for dst in peers[src]
            for rel, size in sorted(offers[src].files.items())]

    def dest(t: Transfer) -> pathlib.Path:
        return _under(pathlib.Path(peer_dir(t.src)) if peer_dir is not None else step, t.rel)

    traffic = run_transfers(comm, tc, plan, lambda t: _under(step, t.rel), dest, piece_bytes, "replicate", budget)
    return ReplicaReport(k, peers, traffic, time.perf_counter() - t0)


# --------------------------------------------------------------------------- repair


@dataclass(frozen=True)
class _Holding:
    """What one rank states before a repair: where it is, what it needs, what it holds."""

    dir_id: tuple[str, str]
    needed: tuple[str, ...]
    listing: dict[str, int]  # rel -> size, every regular file under the step dir
    problem: Optional[RankError] = None
    #: (fetch) this rank will ask for more in another round
    more: bool = False
    #: (fetch) byte ranges it wants: (file, offset, length)
    ranges: tuple[tuple[str, int, int], ...] = ()


def _listing(step: pathlib.Path) -> dict[str, int]:
    out: dict[str, int] = {}
    if not step.is_dir():
        return out
    for dirpath, _dirs, names in os.walk(step):
        for name in names:
            if is_temp_name(name):
                continue
            full = pathlib.Path(dirpath) / name
            try:
                st = full.stat()
            except FileNotFoundError:
                continue
            out[full.relative_to(step).as_posix()] = st.st_size
    return out


def plan_repair(holdings: Sequence[tuple[tuple[str, str], Sequence[str], dict[str, int]]], *,
                per_rank: bool = False) -> tuple[list[Transfer], dict[int, tuple[str, ...]]]:
    """Pure: who sends which file to whom.  ``holdings[r]`` is rank ``r``'s (directory
    id, needed files, listing).  A file is delivered once per directory (to the lowest
    rank there that needs it); its sender is the holder with the fewest bytes assigned
    so far (ties: the lowest rank), so the load spreads over holders.  Holders of a
    file must agree on its size; one whose size differs from the most common is not
    used.  ``per_rank``: delivered to every rank that needs it, not once per directory (a
    :func:`fetch` into each rank's memory).  Returns the transfers and, per rank, the files
    no rank had."""
    dir_of = {r: h[0] for r, h in enumerate(holdings)}
    have_by_dir: dict[tuple[str, str], dict[str, int]] = {}
    for r, (d, _need, listing) in enumerate(holdings):
        have_by_dir.setdefault(d, {}).update(listing)
    load = [0] * len(holdings)
    plan: list[Transfer] = []
    missing: dict[int, tuple[str, ...]] = {}
    delivered: set[tuple[object, str]] = set()
    for dst, (d, needed, _listing_) in enumerate(holdings):
        lost = []
        for rel in sorted(set(needed)):
            to = dst if per_rank else d
            if rel in have_by_dir[d] or (to, rel) in delivered:
                continue
            sizes = [(r, h[2][rel]) for r, h in enumerate(holdings) if rel in h[2] and dir_of[r] != d]
            if not sizes:
                lost.append(rel)
                continue
            counts: dict[int, int] = {}
            for _r, s in sizes:
                counts[s] = counts.get(s, 0) + 1
            size = max(counts, key=lambda s: (counts[s], s))
            src = min((r for r, s in sizes if s == size), key=lambda r: (load[r], r))
            load[src] += size
            delivered.add((to, rel))
            plan.append(Transfer(src, dst, rel, size))
        if lost:
            missing[dst] = tuple(lost)
    return plan, missing


def repair(comm: Comm, topology: Topology, local_step_dir: pathlib.Path, needed: list[str], *,
           piece_bytes: int = PIECE_BYTES, memory_bytes: Optional[int] = None) -> RepairReport:
    """Collective: every rank states which of ``needed`` (relative to
    ``local_step_dir``) it lacks, and what files its step directory holds; each
    missing file is sent by exactly one holder (:func:`plan_repair`: deterministic,
    spread over holders) and written under the receiver's ``local_step_dir``
    atomically.  Files nobody holds are reported per rank in
    :attr:`RepairReport.missing` (read those from object storage).  Every rank
    returns the same report; failures and ``memory_bytes`` as in :func:`replicate`."""
    t0 = time.perf_counter()
    budget = copy_budget(memory_bytes)
    step = pathlib.Path(local_step_dir)
    problem = ""
    try:
        for rel in needed:
            _under(step, rel)
        listing = _listing(step)
    except (PeerCopyError, OSError) as e:
        listing, problem = {}, f"rank {comm.rank}: {e}"
    mine = _Holding(_dir_id(topology, comm.rank, step), tuple(needed), listing, copy_problem(problem))
    tc = tier_comm(comm) if comm.world_size > 1 else comm
    everyone: list[_Holding] = tc.all_gather_object(mine) if comm.world_size > 1 else [mine]
    problems = copy_failures([h.problem for h in everyone])
    if problems:
        raise PeerCopyError("repair: nothing was sent: " + "; ".join(problems.values()), problems)
    plan, missing = plan_repair([(h.dir_id, h.needed, h.listing) for h in everyone])
    traffic = run_transfers(comm, tc, plan, lambda t: _under(step, t.rel), lambda t: _under(step, t.rel),
                            piece_bytes, "repair", budget, keep_cached=True)
    restored = []
    for t in plan:  # a file delivered to a shared directory serves every rank there that needed it
        for r, h in enumerate(everyone):
            if h.dir_id == everyone[t.dst].dir_id and t.rel in h.needed and t.rel not in h.listing:
                restored.append(Restored(r, t.rel, t.src, t.size))
    return RepairReport(tuple(sorted(restored, key=lambda x: (x.rank, x.file))), missing, traffic,
                        time.perf_counter() - t0)


# --------------------------------------------------------------------------- fetch into memory


@dataclass(frozen=True)
class Range:
    """``length`` bytes of file ``rel`` from ``offset``, received into ``dest`` (a uint8 tensor
    of that length: the memory the load will read them into, so they land in place)."""

    rel: str
    offset: int
    length: int
    dest: torch.Tensor = dataclasses.field(compare=False, repr=False)


@dataclass
class Fetched:
    """What :func:`fetch` did: the report (the same on every rank) and this rank's bytes."""

    report: RepairReport
    #: name -> the pieces of it received by this rank, (offset, uint8 tensor): a whole file is
    #: one piece at 0 (new memory), a :class:`Range` its own destination
    segments: dict[str, list[tuple[int, torch.Tensor]]]
    #: some rank said it will ask for more in another round
    more: bool

    @property
    def bytes(self) -> int:
        return sum(int(t.numel()) for segs in self.segments.values() for _o, t in segs)


def _plan_ranges(holdings: Sequence[_Holding], load: list[int]) -> tuple[list[Transfer], dict[int, tuple[str, ...]]]:
    """Each rank's wanted ranges, each from one holder of the file on another node (the least
    loaded one whose size agrees with the most common size and holds the range)."""
    plan: list[Transfer] = []
    missing: dict[int, list[str]] = {}
    for dst, h in enumerate(holdings):
        for rel, offset, length in h.ranges:
            sizes = [(r, o.listing[rel]) for r, o in enumerate(holdings) if rel in o.listing and o.dir_id != h.dir_id]
            counts: dict[int, int] = {}
            for _r, size in sizes:
                counts[size] = counts.get(size, 0) + 1
            usable = [r for r, size in sizes if counts and size == max(counts, key=lambda x: (counts[x], x))
                      and size >= offset + length]
            if not usable:
                missing.setdefault(dst, []).append(rel)
                continue
            src = min(usable, key=lambda r: (load[r], r))
            load[src] += length
            plan.append(Transfer(src, dst, rel, length, offset))
    return plan, {r: tuple(sorted(set(v))) for r, v in missing.items()}


def fetch(comm: Comm, topology: Topology, local_step_dir: pathlib.Path, wants: list[str], *,
          ranges: Sequence[Range] = (), more: bool = False, problem: str = "", piece_bytes: int = PIECE_BYTES,
          memory_bytes: Optional[int] = None, hidden: frozenset[str] = frozenset()) -> Fetched:
    """Collective: as :func:`repair`, but into each rank's memory, nothing written: the
    files of ``wants`` whole, into new memory, and each of ``ranges`` straight into its
    ``dest`` (delivered to every rank that wants them, not once per folder).  One
    all-gather of each rank's folder listing and wants; every rank computes the same plan
    (:func:`plan_repair` with ``per_rank`` for the files, the least loaded holder for each
    range); the bytes move as in :func:`replicate`, except that each piece lands straight
    in its place.  ``more``: this rank will call again (a restore that learns which blobs
    it needs from the metadata this call brings); every rank learns whether any rank will
    (:attr:`Fetched.more`), so they all call again alike.  A call in which no rank wants
    anything moves nothing and costs the one all-gather.  ``problem``: this rank cannot go
    on (said in the exchange, so that every rank raises :class:`PeerCopyError` alike
    rather than wait for it).  ``hidden``: files of this rank's folder found damaged: never
    offered to the others."""
    t0 = time.perf_counter()
    budget = copy_budget(memory_bytes)
    step = pathlib.Path(local_step_dir)
    try:
        for rel in list(wants) + [r.rel for r in ranges]:
            _under(step, rel)
        bad = [r for r in ranges if r.offset < 0 or r.length != r.dest.numel() or r.dest.dtype != torch.uint8]
        if bad:
            raise PeerCopyError(f"a range's destination is not {bad[0].length} bytes (uint8): {bad[0]}", {})
        listing = {n: size for n, size in _listing(step).items() if n not in hidden}
    except (PeerCopyError, OSError) as e:
        listing, problem = {}, problem or f"rank {comm.rank}: {e}"
    mine = _Holding(_dir_id(topology, comm.rank, step), tuple(wants), listing, copy_problem(problem), more,
                    tuple((r.rel, r.offset, r.length) for r in ranges))
    tc = tier_comm(comm) if comm.world_size > 1 else comm
    everyone: list[_Holding] = tc.all_gather_object(mine) if comm.world_size > 1 else [mine]
    problems = copy_failures([h.problem for h in everyone])
    if problems:
        raise PeerCopyError("fetch: nothing was sent: " + "; ".join(problems.values()), problems)
    again = any(h.more for h in everyone)
    if not any(h.needed or h.ranges for h in everyone):
        return Fetched(RepairReport((), {}, tuple(RankTraffic(r) for r in range(comm.world_size)),
                                    time.perf_counter() - t0), {}, again)
    plan, missing = plan_repair([(h.dir_id, h.needed, h.listing) for h in everyone], per_rank=True)
    load = [0] * len(everyone)
    for t in plan:
        load[t.src] += t.size
    in_place, lost = _plan_ranges(everyone, load)
    plan += in_place
    for r, names in lost.items():
        missing[r] = tuple(sorted(set(missing.get(r, ())) | set(names)))
    into: dict[tuple[int, str, int], torch.Tensor] = {}
    by_range = {(r.rel, r.offset): r.dest for r in ranges}
    for t in in_place:
        if t.dst == comm.rank:
            into[(t.src, t.rel, t.offset)] = by_range[(t.rel, t.offset)]
    traffic = run_transfers(comm, tc, plan, lambda t: _under(step, t.rel), lambda t: _under(step, t.rel),
                            piece_bytes, "fetch", budget, into=into)
    restored: dict[tuple[int, str], Restored] = {}
    for t in plan:  # per rank and file: its source and the bytes it received of it
        got = restored.get((t.dst, t.rel))
        restored[(t.dst, t.rel)] = Restored(t.dst, t.rel, t.src, t.size + (got.size if got else 0))
    segments: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for (_src, rel, offset), data in into.items():
        segments.setdefault(rel, []).append((offset, data))
    return Fetched(RepairReport(tuple(sorted(restored.values(), key=lambda x: (x.rank, x.file))), missing, traffic,
                                time.perf_counter() - t0), segments, again)
