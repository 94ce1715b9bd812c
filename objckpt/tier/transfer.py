"""Move files between ranks: bounded pieces over gloo, atomic on arrival, one agreed outcome.

The engine behind :func:`~objckpt.tier.peers.replicate` and
:func:`~objckpt.tier.peers.repair`.  Every rank holds the same plan (a list of
:class:`Transfer`, computed alike everywhere from one all-gather); each ordered
pair of ranks has one stream, the concatenation of its files cut into pieces
of at most ``piece_bytes``, and piece ``i`` of every stream moves in round
``i`` (``isend``/``irecv``, so a rank serves all its partners at once).  Round
``i+1`` is posted before round ``i``'s pieces are written, so disk and network
overlap; two buffers per partner, allocated once, are all the memory it takes.
Gloo matches the messages of one pair in order, and every rank posts round
``i`` only after its round ``i-1`` completed, so the rounds cannot deadlock.

A piece that cannot be read (a file shrank) or written (a full disk) does not
stop the rounds, which would leave partners waiting: the rank sends zeros or
drops the bytes, carries on, and reports the failure in the outcome
all-gather, after which every rank raises :class:`PeerCopyError`.  Received
files stay under temp names until that outcome says every rank succeeded; only
then are they renamed (each was fsynced when complete).  A failed collective (a
dead rank: gloo's closed connection, or the group's timeout) removes this
rank's temp files and raises :class:`~objckpt.errors.CollectiveError`.
"""
from __future__ import annotations

import os
import pathlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..distributed.comm import Comm
from ..errors import CollectiveError, ObjckptError

#: the largest piece one message carries (memory per partner is twice this)
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


def is_temp_name(name: str) -> bool:
    """Whether ``name`` (a file name) is a transfer's temp file, left only by a dead rank."""
    return TEMP_MARK in name


@dataclass(frozen=True)
class Transfer:
    """One file from rank ``src`` to rank ``dst`` (``rel`` relative to both step dirs)."""

    src: int
    dst: int
    rel: str
    size: int


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
    reading: dict[tuple[int, str], Any] = field(default_factory=dict)
    writing: dict[tuple[int, str], _Inbound] = field(default_factory=dict)
    done: list[_Inbound] = field(default_factory=list)

    def fail(self, message: str) -> None:
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
    key = (t.dst, t.rel)
    try:
        f = state.reading.get(key)
        if f is None:
            f = state.reading[key] = open(src_path(t), "rb", buffering=0)
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
    except OSError as e:
        buf.zero_()
        state.fail(f"rank {t.src}: reading {t.rel!r} for rank {t.dst}: {e}")


def _start(dst_path: Callable[[Transfer], pathlib.Path], t: Transfer) -> _Inbound:
    final = dst_path(t)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{TEMP_MARK}{t.src}-{os.getpid()}-{secrets.token_hex(4)}")
    inbound = _Inbound(final, tmp)
    inbound.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    return inbound


def _finish(state: _State, inbound: _Inbound) -> None:
    """fsync a complete temp file and let it go from the page cache (it stays on its medium)."""
    os.fsync(inbound.fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(inbound.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(inbound.fd)
    inbound.fd = -1
    state.done.append(inbound)


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
            done += os.write(inbound.fd, view[done:])
        if off + len(view) >= t.size:
            _finish(state, state.writing.pop(key))
    except OSError as e:
        state.fail(f"rank {t.dst}: writing {t.rel!r} from rank {t.src}: {e}")


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(comm: Comm, tc: Comm, plan: Sequence[Transfer], src_path: Callable[[Transfer], pathlib.Path],
              dst_path: Callable[[Transfer], pathlib.Path], piece: int, state: _State, what: str) -> RankTraffic:
    """This rank's part of the rounds; a failed collective raises CollectiveError."""
    import torch.distributed as dist

    me = comm.rank
    to_global = comm.global_ranks()
    outgoing = [t for t in plan if t.src == me]
    incoming = [t for t in plan if t.dst == me]
    sends = {p: _pieces([t for t in outgoing if t.dst == p], piece) for p in sorted({t.dst for t in outgoing})}
    recvs = {p: _pieces([t for t in incoming if t.src == p], piece) for p in sorted({t.src for t in incoming})}
    for t in incoming:
        if t.size == 0 and not state.error:
            try:
                _finish(state, _start(dst_path, t))
            except OSError as e:
                state.fail(f"rank {me}: writing {t.rel!r} from rank {t.src}: {e}")
    rounds = max([len(v) for v in sends.values()] + [len(v) for v in recvs.values()] + [0])

    def size(stream: list[_Piece]) -> int:
        return max((n for _t, _o, n in stream), default=0)

    sbuf = [{p: torch.empty(size(v), dtype=torch.uint8) for p, v in sends.items()} for _ in range(2)]
    rbuf = [{p: torch.empty(size(v), dtype=torch.uint8) for p, v in recvs.items()} for _ in range(2)]
    held = sum(b.numel() for slot in sbuf + rbuf for b in slot.values())
    group = tc.group

    def failed(p: int, e: RuntimeError) -> CollectiveError:
        return CollectiveError(
            f"{what}: rank {me} of {comm.world_size}: moving a piece to/from rank {p} failed (a rank died, "
            f"the network failed, or it did not answer within the collective timeout); nothing was "
            f"renamed into place: {e}")

    def post(i: int) -> list[Any]:
        slot, works = i % 2, []
        for p, stream in sends.items():
            if i < len(stream):
                t, off, n = stream[i]
                buf = sbuf[slot][p][:n]
                _read_piece(state, src_path, t, off, buf)
                try:
                    works.append((p, dist.isend(buf, dst=to_global[p], group=group)))
                except RuntimeError as e:
                    raise failed(p, e) from e
        for p, stream in recvs.items():
            if i < len(stream):
                try:
                    works.append((p, dist.irecv(rbuf[slot][p][: stream[i][2]], src=to_global[p], group=group)))
                except RuntimeError as e:
                    raise failed(p, e) from e
        return works

    def wait(works: list[Any]) -> None:
        for p, w in works:
            try:
                w.wait()
            except RuntimeError as e:
                raise failed(p, e) from e

    t0 = time.perf_counter()
    pending = post(0) if rounds else []
    for i in range(rounds):
        following = post(i + 1) if i + 1 < rounds else []
        wait(pending)
        slot = i % 2
        for p, stream in recvs.items():
            if i < len(stream):
                t, off, n = stream[i]
                _write_piece(state, dst_path, t, off, rbuf[slot][p][:n])
        pending = following
    return RankTraffic(me, sum(t.size for t in outgoing), sum(t.size for t in incoming), len(outgoing),
                       len(incoming), time.perf_counter() - t0, held)


def run_transfers(comm: Comm, tc: Comm, plan: Sequence[Transfer], src_path: Callable[[Transfer], pathlib.Path],
                  dst_path: Callable[[Transfer], pathlib.Path], piece: int, what: str) -> tuple[RankTraffic, ...]:
    """Collective: carry out ``plan`` (the same on every rank) over ``tc`` (the tier's
    gloo group over ``comm``'s ranks), agree on the outcome, then rename.  Returns
    every rank's traffic, by rank."""
    if not (isinstance(piece, int) and piece > 0):
        raise ValueError(f"piece_bytes must be a positive number of bytes, got {piece!r}")
    state = _State()
    mine: Optional[RankTraffic] = None
    try:
        if comm.world_size > 1:
            mine = _exchange(comm, tc, plan, src_path, dst_path, piece, state, what)
            outcomes: list[tuple[str, RankTraffic]] = tc.all_gather_object((state.error, mine))
        else:
            outcomes = [("", RankTraffic(comm.rank))]
    except BaseException:
        state.cleanup()
        raise
    failures = {r: err for r, (err, _t) in enumerate(outcomes) if err}
    if failures:
        state.cleanup()
        raise PeerCopyError(f"{what} failed; nothing was renamed into place: " + "; ".join(failures.values()),
                            failures)
    dirs, problem = set(), ""
    try:
        for inbound in state.done:
            os.replace(inbound.tmp, inbound.final)
            dirs.add(inbound.final.parent)
        for d in sorted(dirs):
            _fsync_dir(d)
    except OSError as e:
        problem = f"rank {comm.rank}: renaming a received file into place: {e}"
        state.cleanup()
    state.done.clear()
    # when any rank returns, every rank's files are in place (ranks sharing a node's
    # folder read what another of them received), or every rank raises alike
    renamed = tc.all_gather_object(problem) if comm.world_size > 1 else [problem]
    failures = {r: p for r, p in enumerate(renamed) if p}
    if failures:
        raise PeerCopyError(f"{what} failed: " + "; ".join(failures.values()), failures)
    return tuple(t for _err, t in outcomes)
