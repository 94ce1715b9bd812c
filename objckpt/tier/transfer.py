"""Move files between ranks: bounded pieces over a wire, atomic on arrival, one agreed outcome.

The engine behind :func:`~objckpt.tier.peers.replicate` and :func:`~objckpt.tier.peers.repair`.
Every rank holds the same plan (a list of :class:`Transfer`, computed alike everywhere from one
all-gather); each ordered pair of ranks has one stream, the concatenation of its files cut into
pieces, and piece ``i`` of every stream moves in round ``i`` (``isend``/``irecv``: a rank serves
all its partners at once).

Three threads keep the wire busy: a reader fills the next round's send buffers
(``readinto`` straight into them), the calling thread posts round ``i+1`` before
it waits for round ``i`` (so gloo always has a round queued), and a writer
empties the received buffers into the temp files (``os.write`` from them, no
other copy).  Two buffers per partner and direction are all the memory it
takes; they come from the process-wide :class:`~objckpt.runtime.memory.HostPool`
(reused from one copy to the next) and are drawn from one
:class:`~objckpt.runtime.memory.OperationBudget` (``memory_bytes``, else
:data:`~objckpt.runtime.memory.TIER_COPY_BYTES`): the piece is the smaller of
``piece_bytes`` and what that budget allows, agreed by every rank (one small
all-gather), and a budget that cannot hold pieces of
:data:`~objckpt.runtime.memory.TIER_MIN_PIECE_BYTES` is a
:class:`~objckpt.errors.MemoryBudgetError` on every rank before a byte moves.
Gloo matches the messages of one pair in order, and every rank posts its rounds
in order, so the rounds cannot deadlock.

How a round's pieces cross is the wire's (:mod:`objckpt.tier.wire`): gloo straight
from and into the host buffers, or NCCL through device bounce buffers (two per
partner and direction, also for a restore's in-memory receives, so the agreed piece
counts them); everything else here, the reads, writes, budget and outcome, is the
same for both.  The agreements always go over ``tc`` (gloo).

A piece that cannot be read (a file shrank) or written (a full disk) does not
stop the rounds, which would leave partners waiting: the rank sends zeros or
drops the bytes, carries on, and reports the failure in the outcome
all-gather, after which every rank raises :class:`PeerCopyError`.  Received
files stay under temp names until that outcome says every rank succeeded; only
then are they renamed.  Each is fsynced once, when complete, and (a replica,
not a repair's file, which the restore reads right back) dropped from the page
cache, except on tmpfs (``/dev/shm``), where the file *is* memory and
an fsync means nothing.  A failed collective (a dead rank: gloo's closed
connection, or the group's timeout) removes this rank's temp files and raises
:class:`~objckpt.errors.CollectiveError`.

A restore from peers (``into=``) receives into memory instead: each incoming file is one uint8
tensor of its size, every piece received straight into its place there (no receive buffer, no
writer, no file; the sender's side is as above), handed back only when every rank succeeded.
"""
from __future__ import annotations

import collections
import os
import pathlib
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, cast

import torch

from ..distributed.comm import Comm, RankError
from ..errors import CollectiveError, MemoryBudgetError, ObjckptError, error_name
from ..runtime.memory import (TIER_COPY_BYTES, TIER_MIN_PIECE_BYTES, Budget, OperationBudget, given_or_default,
                              host_pool, positive_bytes)
from ..storage.local import fsync_dir
from .mounts import volatile
from .wire import Link, Piece, Posted, Wire, wire_for

#: the largest piece one message carries (memory per partner and direction is twice this)
PIECE_BYTES = 16 << 20
#: marks a file being received: never a final name (see :func:`is_temp_name`)
TEMP_MARK = ".objckpt-tmp-"


class PeerCopyError(ObjckptError, OSError):
    """A tier copy between ranks failed on some rank (a listed file missing, a full
    disk); raised on every rank alike, nothing renamed into place.  ``failures`` maps
    each failed rank to what failed there."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures

    @classmethod
    def from_message(cls, message: str) -> "PeerCopyError":
        """(Each rank's failure is in the text only: ``failures`` is empty.)"""
        return cls(message, {})


def copy_problem(text: str) -> Optional[RankError]:
    """One rank's failure in a tier copy as it crosses ranks (None when ``text`` is empty:
    no failure): every rank raises :class:`PeerCopyError` for it."""
    return RankError(error_name(PeerCopyError), text) if text else None


def copy_failures(problems: Sequence[Optional[RankError]]) -> dict[int, str]:
    """Of every rank's gathered problem (None: none), what failed on each rank that failed
    (:attr:`PeerCopyError.failures`)."""
    return {r: p.text for r, p in enumerate(problems) if p is not None}


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a file name) is a transfer's temp file, left only by a dead rank."""
    return TEMP_MARK in name


@dataclass(frozen=True)
class Transfer:
    """One file from rank ``src`` to rank ``dst`` (``rel`` relative to both step dirs); or,
    received into memory, ``size`` bytes of it from ``offset``."""

    src: int
    dst: int
    rel: str
    size: int
    offset: int = 0


@dataclass(frozen=True)
class RankTraffic:
    """What one rank moved in one call."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    files_sent: int = 0
    files_received: int = 0
    #: seconds of the data phase (pieces moving), on that rank
    seconds: float = 0.0
    #: bytes of piece buffers it held
    buffer_bytes: int = 0


@dataclass
class _Inbound:
    """A file being received into a temp name."""

    final: pathlib.Path
    tmp: pathlib.Path
    fd: int = -1


@dataclass
class _State:
    error: str = ""
    reading: dict[tuple[int, str, int], Any] = field(default_factory=dict)
    writing: dict[tuple[int, str], _Inbound] = field(default_factory=dict)
    done: list[_Inbound] = field(default_factory=list)
    #: folder -> whether it is in memory (no fsync there), asked once per folder
    in_memory: dict[pathlib.Path, bool] = field(default_factory=dict)
    #: leave received files in the page cache (a repair's files are read back at once)
    keep_cached: bool = False
    #: complete files for the syncing thread (fsync off the writer's path); None: inline
    syncing: Optional[queue.Queue[Optional[_Inbound]]] = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, message: str) -> None:
        with self.lock:
            if not self.error:
                self.error = message

    def cleanup(self) -> None:
        """Close and remove every temp file (a failed call renames nothing)."""
        for f in self.reading.values():
            f.close()
        for inbound in list(self.writing.values()) + self.done:
            if inbound.fd >= 0:
                os.close(inbound.fd)
                inbound.fd = -1
            try:
                os.unlink(inbound.tmp)
            except FileNotFoundError:
                pass
        self.reading.clear()
        self.writing.clear()
        self.done.clear()


_Piece = tuple[Transfer, int, int]  # (transfer, offset, length)


def _pieces(transfers: Sequence[Transfer], piece: int) -> list[_Piece]:
    return [(t, off, min(piece, t.size - off)) for t in transfers for off in range(0, t.size, piece)]


def _read_piece(state: _State, src_path: Callable[[Transfer], pathlib.Path], t: Transfer, off: int,
                buf: torch.Tensor) -> None:
    """Fill ``buf`` with bytes ``off..`` of ``t``'s file (zeros and a recorded failure when it cannot)."""
    if state.error:
        return
    key = (t.dst, t.rel, t.offset)
    try:
        f = state.reading.get(key)
        if f is None:
            f = state.reading[key] = open(src_path(t), "rb", buffering=0)
            if t.offset:
                f.seek(t.offset)
        view = buf.numpy().data
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{str(src_path(t))!r} is shorter than the {t.size} bytes it had when the copy "
                              "was planned (changed during the copy)")
            got += n
        if off + len(view) >= t.size:
            state.reading.pop(key).close()
    except Exception as e:  # noqa: BLE001 - kept for the outcome: the rounds must go on
        buf.zero_()
        state.fail(f"rank {t.src}: reading {t.rel!r} for rank {t.dst}: {type(e).__name__}: {e}")


def _start(dst_path: Callable[[Transfer], pathlib.Path], t: Transfer) -> _Inbound:
    final = dst_path(t)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{TEMP_MARK}{t.src}-{os.getpid()}-{secrets.token_hex(4)}")
    inbound = _Inbound(final, tmp)
    inbound.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    return inbound


def _in_memory(state: _State, folder: pathlib.Path) -> bool:
    known = state.in_memory.get(folder)
    if known is None:
        known = state.in_memory[folder] = volatile(folder)
    return known


def _finish(state: _State, inbound: _Inbound) -> None:
    """A complete temp file: fsynced once and let go from the page cache (it stays on its
    medium), except in memory (tmpfs), where there is nothing to sync or let go.  With a
    syncing thread the fsync happens there, while the writer goes on with the next file."""
    if not _in_memory(state, inbound.tmp.parent):
        if state.syncing is not None:
            state.syncing.put(inbound)
            return
        _sync(state, inbound)
    os.close(inbound.fd)
    inbound.fd = -1
    state.done.append(inbound)


def _sync(state: _State, inbound: _Inbound) -> None:
    os.fsync(inbound.fd)
    if hasattr(os, "posix_fadvise") and not state.keep_cached:
        os.posix_fadvise(inbound.fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write_piece(state: _State, dst_path: Callable[[Transfer], pathlib.Path], t: Transfer, off: int,
                 buf: torch.Tensor) -> None:
    if state.error:
        return
    key = (t.src, t.rel)
    try:
        inbound = state.writing.get(key)
        if inbound is None:
            inbound = state.writing[key] = _start(dst_path, t)
        view = buf.numpy().data
        done = 0
        while done < len(view):
            done += os.pwrite(inbound.fd, view[done:], off + done)
        if off + len(view) >= t.size:
            _finish(state, state.writing.pop(key))
    except Exception as e:  # noqa: BLE001 - kept for the outcome: the rounds must go on
        state.fail(f"rank {t.dst}: writing {t.rel!r} from rank {t.src}: {type(e).__name__}: {e}")


def _streams(plan: Sequence[Transfer], me: int, piece: int) -> tuple[dict[int, list[_Piece]], dict[int, list[_Piece]]]:
    """This rank's send and receive streams, by partner, cut into pieces of ``piece``."""
    outgoing = [t for t in plan if t.src == me]
    incoming = [t for t in plan if t.dst == me]
    sends = {p: _pieces([t for t in outgoing if t.dst == p], piece) for p in sorted({t.dst for t in outgoing})}
    recvs = {p: _pieces([t for t in incoming if t.src == p], piece) for p in sorted({t.src for t in incoming})}
    return sends, recvs


def _piece_limit(plan: Sequence[Transfer], me: int, budget: OperationBudget, in_memory: bool = False,
                 stages: bool = False) -> int:
    """The largest piece this rank's budget allows: two buffers per partner and direction
    (none for receiving, ``in_memory``: pieces land in the received files' own memory,
    unless the wire ``stages`` them through device buffers, which are as many as the host
    ones and drawn from a device budget of the same size)."""
    receiving = set() if in_memory and not stages else {t.src for t in plan if t.dst == me}
    partners = len({t.dst for t in plan if t.src == me}) + len(receiving)
    return budget.nbytes // (2 * partners) if partners else 1 << 62


def _agree_piece(comm: Comm, tc: Comm, plan: Sequence[Transfer], piece: int, budget: OperationBudget,
                 in_memory: bool = False, stages: bool = False) -> int:
    """The piece every rank uses (senders and receivers must cut alike): the smallest of
    ``piece`` and every rank's budget limit.  A budget that cannot hold the minimal piece is
    a :class:`MemoryBudgetError` on every rank, naming the ranks and their budgets."""
    mine = (_piece_limit(plan, comm.rank, budget, in_memory, stages), budget.name)
    limits = tc.all_gather_object(mine) if comm.world_size > 1 else [mine]
    low = {r: (lim, name) for r, (lim, name) in enumerate(limits) if lim < TIER_MIN_PIECE_BYTES}
    if low:
        shown = "; ".join(f"rank {r}: the {name} allows pieces of {lim} bytes" for r, (lim, name) in low.items())
        raise MemoryBudgetError(
            f"a tier copy needs two buffers of at least {TIER_MIN_PIECE_BYTES} bytes per partner and direction "
            f"(TIER_MIN_PIECE_BYTES), more than a rank's budget holds ({shown}); give a larger memory_bytes")
    return min([piece] + [lim for lim, _name in limits])


class _Buffers:
    """The piece buffers of one call: taken from the process-wide pool, drawn from the budget."""

    def __init__(self, budget: OperationBudget, sizes: dict[str, dict[int, int]]) -> None:
        self.pool, self.budget, self.held = host_pool(), budget, 0
        self.taken: list[torch.Tensor] = []
        #: [slot][direction][partner] -> a buffer of exactly the stream's largest piece
        self.slots: list[dict[str, dict[int, torch.Tensor]]] = []
        total = 2 * sum(n for by_partner in sizes.values() for n in by_partner.values())
        self.budget.draw(total, f"the piece buffers of a tier copy ({total} bytes)")
        self.held = total
        try:
            for _slot in range(2):
                slot: dict[str, dict[int, torch.Tensor]] = {}
                for direction, by_partner in sizes.items():
                    slot[direction] = {}
                    for p, n in by_partner.items():
                        # exactly n: a larger idle buffer would hold more than the budget drew
                        buf = self.pool.take(max(n, 1), Budget(max(n, 1)))
                        self.taken.append(buf)
                        slot[direction][p] = buf[:n]
                self.slots.append(slot)
        except BaseException:
            self.close()
            raise

    def close(self, reuse: bool = True) -> None:
        if reuse:
            for buf in self.taken:
                self.pool.give(buf)
        self.taken.clear()
        self.budget.release(self.held)
        self.held = 0


def _open_link(comm: Comm, tc: Comm, wire: Wire, to_global: Sequence[int], sizes: dict[str, dict[int, int]],
               budget: OperationBudget, bufs: _Buffers, what: str) -> Link:
    """``wire``'s link for this transfer.  A wire that stages allocates device buffers here,
    which can fail on one rank (the device is full): every rank learns it from one small
    all-gather and raises :class:`PeerCopyError` alike, before a piece moves, rather than
    wait for that rank's pieces until the timeout."""
    link: Optional[Link] = None
    problem = ""
    try:
        link = wire.open(to_global, sizes, budget)
    except (RuntimeError, MemoryError, ObjckptError) as e:  # CUDA's OutOfMemoryError is a RuntimeError
        problem = f"rank {comm.rank}: the {wire.backend} wire's buffers: {type(e).__name__}: {e}"
    except BaseException:
        bufs.close()
        raise
    mine = copy_problem(problem)
    failures = copy_failures(tc.all_gather_object(mine) if wire.stages else [mine])
    if failures or link is None:
        if link is not None:
            link.close(reuse=True)
        bufs.close()
        raise PeerCopyError(f"{what} failed before a piece moved: " + "; ".join(failures.values()), failures)
    return link


def _exchange(comm: Comm, tc: Comm, plan: Sequence[Transfer], src_path: Callable[[Transfer], pathlib.Path],
              dst_path: Callable[[Transfer], pathlib.Path], piece: int, budget: OperationBudget, state: _State,
              what: str, wire: Wire, into: Optional[dict[tuple[int, str, int], torch.Tensor]] = None) -> RankTraffic:
    """This rank's part of the rounds over ``wire``; a failed collective raises
    CollectiveError.  ``into`` given: each incoming transfer is received straight into
    ``into[(source rank, name, offset)]`` (a uint8 tensor of its size: the caller's, else a
    new one stored there); no host receive buffers, no writer, no file."""
    me = comm.rank
    to_global = comm.global_ranks()
    sends, recvs = _streams(plan, me, piece)
    outgoing = [t for t in plan if t.src == me]
    incoming = [t for t in plan if t.dst == me]
    if into is not None:  # a caller's destination (received in place), else new memory
        for t in incoming:
            if (t.src, t.rel, t.offset) not in into:
                into[(t.src, t.rel, t.offset)] = torch.empty(t.size, dtype=torch.uint8)
    for t in incoming:
        if into is None and t.size == 0 and not state.error:
            try:
                _finish(state, _start(dst_path, t))
            except OSError as e:
                state.fail(f"rank {me}: writing {t.rel!r} from rank {t.src}: {e}")
    rounds = max([len(v) for v in sends.values()] + [len(v) for v in recvs.values()] + [0])

    def size(stream: list[_Piece]) -> int:
        return max((n for _t, _o, n in stream), default=0)

    send_sizes = {p: size(v) for p, v in sends.items()}
    recv_sizes = {p: size(v) for p, v in recvs.items()}
    bufs = _Buffers(budget, {"send": send_sizes, "recv": {} if into is not None else recv_sizes})
    held = bufs.held
    link = _open_link(comm, tc, wire, to_global, {"send": send_sizes, "recv": recv_sizes}, budget, bufs, what)
    stop = threading.Event()
    free_send: queue.Queue[Optional[int]] = queue.Queue()
    ready: queue.Queue[int] = queue.Queue()
    free_recv: queue.Queue[int] = queue.Queue()
    to_write: queue.Queue[Optional[tuple[int, int]]] = queue.Queue()
    sync_q: queue.Queue[Optional[_Inbound]] = queue.Queue()
    state.syncing = sync_q
    for slot in range(2):
        free_send.put(slot)
        free_recv.put(slot)

    def reader() -> None:  # fills round i's send buffers while the wire carries round i-1
        for i in range(rounds):
            slot = free_send.get()
            if slot is None or stop.is_set():
                return
            for p, stream in sends.items():
                if i < len(stream):
                    t, off, n = stream[i]
                    _read_piece(state, src_path, t, off, bufs.slots[slot]["send"][p][:n])
            ready.put(slot)

    def writer() -> None:  # empties round i's receive buffers while the wire carries round i+1
        while True:
            item = to_write.get()
            if item is None or stop.is_set():
                return
            i, slot = item
            for p, stream in recvs.items():
                if i < len(stream) and into is None:
                    t, off, n = stream[i]
                    _write_piece(state, dst_path, t, off, bufs.slots[slot]["recv"][p][:n])
            free_recv.put(slot)

    def syncer() -> None:  # fsyncs complete files while the writer goes on (disk only)
        while True:
            inbound = sync_q.get()
            if inbound is None:
                return
            try:
                if not stop.is_set():
                    _sync(state, inbound)
            except OSError as e:
                state.fail(f"rank {me}: syncing {str(inbound.final)!r}: {e}")
            finally:
                os.close(inbound.fd)
                inbound.fd = -1
                state.done.append(inbound)

    def failed(peers: Sequence[int], e: RuntimeError) -> CollectiveError:
        ranks = sorted(set(peers))
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        return CollectiveError(
            f"{what}: rank {me} of {comm.world_size}: moving pieces to/from {who} over "
            f"{wire.backend}{' (staged through device buffers)' if wire.stages else ''} failed (a rank died, the network failed, or it did not answer within the "
            f"collective timeout); nothing was renamed into place: {e}")

    def post(i: int, sslot: int, rslot: int) -> Posted:
        out: list[Piece] = [(p, bufs.slots[sslot]["send"][p][: stream[i][2]])
                            for p, stream in sends.items() if i < len(stream)]
        inc: list[Piece] = []
        for p, stream in recvs.items():
            if i < len(stream):
                t, off, n = stream[i]
                inc.append((p, into[(t.src, t.rel, t.offset)][off: off + n] if into is not None
                            else bufs.slots[rslot]["recv"][p][:n]))
        try:  # at most two rounds are in flight: round i's wire buffers are free again at i + 2
            return link.post(i % 2, out, inc)
        except RuntimeError as e:
            raise failed([p for p, _ in out + inc], e) from e

    def complete(i: int, sslot: int, rslot: int, posted: Posted) -> None:
        try:
            link.wait(posted)
        except RuntimeError as e:
            raise failed(posted.peers, e) from e
        free_send.put(sslot)
        if files:
            to_write.put((i, rslot))
        else:  # received in place: nothing to write
            free_recv.put(rslot)

    # only the threads needed (each start waits for the thread's first run): no reader without
    # sends, no writer or syncer when received in place (``into``)
    files = into is None
    reading = threading.Thread(target=reader, name="objckpt-tier-read", daemon=True) if sends else None
    writing = threading.Thread(target=writer, name="objckpt-tier-write", daemon=True) if files else None
    syncing = threading.Thread(target=syncer, name="objckpt-tier-sync", daemon=True) if files else None
    threads = [th for th in (reading, writing, syncing) if th is not None]
    t0 = time.perf_counter()
    clean = False
    try:
        for th in threads:
            th.start()
        inflight: collections.deque[tuple[int, int, int, Posted]] = collections.deque()
        for i in range(rounds):
            sslot = ready.get() if reading is not None else cast(int, free_send.get())  # None: only after finally
            rslot = free_recv.get()
            inflight.append((i, sslot, rslot, post(i, sslot, rslot)))
            if len(inflight) > 1:  # round i is queued behind i-1: the wire never waits for us
                complete(*inflight.popleft())
        while inflight:
            complete(*inflight.popleft())
        if writing is not None and syncing is not None:
            to_write.put(None)
            writing.join()
            sync_q.put(None)
            syncing.join()
        clean = True
    finally:
        stop.set()
        free_send.put(None)
        to_write.put(None)
        for th in threads:
            if th is syncing:
                sync_q.put(None)  # after the writer: every file it finished gets closed
            if th.ident is not None:
                th.join()
        state.syncing = None
        # after a failed collective the wire may still hold a posted buffer: those are not handed
        # back to the pool (another operation would reuse them), only released from the budget
        link.close(reuse=clean)
        bufs.close(reuse=clean)
    return RankTraffic(me, sum(t.size for t in outgoing), sum(t.size for t in incoming), len(outgoing),
                       len(incoming), time.perf_counter() - t0, held)


def copy_budget(memory_bytes: Optional[int]) -> OperationBudget:
    """A tier copy's budget: ``memory_bytes`` when given, else :data:`TIER_COPY_BYTES` (strict
    either way: a piece never needs more than the budget's share)."""
    given = None if memory_bytes is None else positive_bytes(memory_bytes, "memory_bytes")
    return given_or_default("tier copy memory budget", given, TIER_COPY_BYTES, strict_default=True)


def run_transfers(comm: Comm, tc: Comm, plan: Sequence[Transfer], src_path: Callable[[Transfer], pathlib.Path],
                  dst_path: Callable[[Transfer], pathlib.Path], piece: int, what: str,
                  budget: Optional[OperationBudget] = None, keep_cached: bool = False,
                  into: Optional[dict[tuple[int, str, int], torch.Tensor]] = None,
                  wire: Optional[Wire] = None) -> tuple[RankTraffic, ...]:
    """Collective: carry out ``plan`` (the same on every rank) with the pieces over ``wire``
    (default: the one registered for ``comm``'s group, :func:`~objckpt.tier.wire.wire_for`,
    else gloo on ``tc``) and the agreements over ``tc`` (the tier's gloo group over
    ``comm``'s ranks), agree on the outcome, then rename.  ``budget``
    bounds the piece buffers (default: :func:`copy_budget`).  ``keep_cached``: received
    files stay in the page cache (a restore reads them right back); otherwise they are
    dropped from it once synced (a replica is read only after a failure).  ``into`` (a dict):
    every transfer this rank receives lands in memory instead, in the uint8 tensor
    ``into[(source rank, name, offset)]`` (given: the caller's destination, received in
    place; else a new one, stored there), trusted only when every rank succeeded
    (``dst_path`` is not used).
    Returns every rank's traffic, by rank."""
    if not (isinstance(piece, int) and piece > 0):
        raise ValueError(f"piece_bytes must be a positive number of bytes, got {piece!r}")
    budget = budget if budget is not None else copy_budget(None)
    state = _State(keep_cached=keep_cached)
    mine: Optional[RankTraffic] = None
    try:
        if comm.world_size > 1:
            wire = wire if wire is not None else wire_for(comm.group, tc.group)
            piece = _agree_piece(comm, tc, plan, piece, budget, into is not None, wire.stages)
            mine = _exchange(comm, tc, plan, src_path, dst_path, piece, budget, state, what, wire, into)
            outcomes: list[tuple[Optional[RankError], RankTraffic]] = tc.all_gather_object(
                (copy_problem(state.error), mine))
        else:
            outcomes = [(None, RankTraffic(comm.rank))]
    except BaseException:
        state.cleanup()
        if into is not None:
            into.clear()
        raise
    failures = copy_failures([err for err, _t in outcomes])
    if failures:
        state.cleanup()
        if into is not None:
            into.clear()
        raise PeerCopyError(f"{what} failed; nothing was renamed into place: " + "; ".join(failures.values()),
                            failures)
    if into is not None:  # nothing to rename: every rank's bytes are in its own memory already
        return tuple(t for _err, t in outcomes)
    dirs, problem = set(), ""
    try:
        for inbound in state.done:
            os.replace(inbound.tmp, inbound.final)
            dirs.add(inbound.final.parent)
        for d in sorted(dirs):
            if not _in_memory(state, d):
                fsync_dir(d)
    except OSError as e:
        problem = f"rank {comm.rank}: renaming a received file into place: {e}"
        state.cleanup()
    state.done.clear()
    # when any rank returns, every rank's files are in place (ranks sharing a node's
    # folder read what another of them received), or every rank raises alike
    renamed = copy_problem(problem)
    failures = copy_failures(tc.all_gather_object(renamed) if comm.world_size > 1 else [renamed])
    if failures:
        raise PeerCopyError(f"{what} failed: " + "; ".join(failures.values()), failures)
    return tuple(t for _err, t in outcomes)
