"""The collectives objckpt needs, behind one small interface.

Multi-host runs use torch.distributed (torchrun; NCCL on GPU, gloo on CPU);
objckpt never builds a cluster layer of its own.  Every save/load issues a
fixed, small number of object collectives (metadata exchange, outcome
exchange), always from one thread per operation, so NCCL's rule that
collectives are issued in the same order on every rank holds.  A
single-process :class:`LocalComm` makes every path work without a process
group.

Also here, so that no other module calls ``torch.distributed`` for its own
coordination:

* :func:`decide_on_root`: gather a value from every rank, let rank 0 decide,
  share the decision; an exception in the decision reaches every rank.
* :func:`background_comm`: a gloo group over the same ranks, for collectives
  issued from a background thread (an async save's commit), never NCCL.
* :class:`TensorGroup`: the tensor collectives of a replica group (collective loads).
* :func:`join`: every rank of the group has entered the same objckpt operation,
  or :class:`RanksDidNotJoinError` within the collective timeout, never a hang.
* :func:`refusal_class`: the error class to raise for another rank's refusal.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, TypeVar

import torch

from .. import errors as _errors
from ..errors import ObjckptError

T = TypeVar("T")
R = TypeVar("R")
E = TypeVar("E", bound=ObjckptError)

_lock = threading.Lock()


class Comm(Protocol):
    rank: int
    world_size: int
    #: the torch.distributed process group (None: the default group, or no group at all)
    group: Any

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self) -> None: ...

    def group_rank(self, global_rank: int) -> "int | None": ...

    def global_ranks(self) -> tuple[int, ...]: ...

    def global_rank(self) -> int: ...

    def job_size(self) -> int: ...

    def backend(self) -> str: ...

    def any(self, flag: bool) -> bool: ...


class LocalComm:
    """One process, no process group."""

    rank = 0
    world_size = 1
    group = None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def group_rank(self, global_rank: int) -> Optional[int]:
        return 0 if global_rank == 0 else None

    def global_ranks(self) -> tuple[int, ...]:
        return (0,)

    def global_rank(self) -> int:
        return 0

    def job_size(self) -> int:
        return 1

    def backend(self) -> str:
        return ""

    def any(self, flag: bool) -> bool:
        return flag


def flag_device(group: Any) -> torch.device:
    """Where a small control tensor must live for ``group``'s backend."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective(fn: Callable[..., T]) -> Callable[..., T]:
    """A failed collective (a peer killed mid-save: gloo's "Connection reset by peer")
    is a :class:`~objckpt.errors.CollectiveError` naming the collective and the ranks,
    not a bare ``RuntimeError``."""
    def wrapped(self: "TorchComm", *a: Any, **kw: Any) -> T:
        try:
            return fn(self, *a, **kw)
        except RuntimeError as e:
            raise _errors.CollectiveError(
                f"{fn.__name__} over the {self.world_size} ranks of the process group failed on rank {self.rank} "
                f"(another rank died or the network failed; the operation did not complete): {e}") from e
    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


class TorchComm:
    """torch.distributed over ``group`` (None: the default group)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @_collective
    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    @_collective
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        global_src = self._dist.get_global_rank(self.group, src) if self.group is not None else src
        self._dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

    @_collective
    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def group_rank(self, global_rank: int) -> Optional[int]:
        """This group's rank of a global rank (None when it is not a member)."""
        if self.group is None:
            return global_rank if 0 <= global_rank < self.world_size else None
        try:
            r = self._dist.get_group_rank(self.group, global_rank)
        except (ValueError, RuntimeError):
            return None
        return r if 0 <= r < self.world_size else None

    def global_ranks(self) -> tuple[int, ...]:
        """The job-wide ranks of this group's members, in group order."""
        if self.group is None:
            return tuple(range(self.world_size))
        return tuple(self._dist.get_process_group_ranks(self.group))

    def global_rank(self) -> int:
        """This process's rank in the whole job."""
        return self._dist.get_rank()

    def job_size(self) -> int:
        """How many ranks the whole job has (the default group's size)."""
        return self._dist.get_world_size()

    def backend(self) -> str:
        """The group's backend, e.g. "gloo", "nccl" or "cpu:gloo,cuda:nccl"."""
        return str(self._dist.get_backend(self.group))

    @_collective
    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (one tiny all-reduce)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=flag_device(self.group))
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def get_comm(process_group: Optional[Any] = None) -> Comm:
    """TorchComm when torch.distributed is initialised (or a group is given), else LocalComm."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return LocalComm()
    if process_group is not None or (dist.is_available() and dist.is_initialized()):
        comm = TorchComm(process_group)
        if comm.world_size > 1:
            return comm
    return LocalComm()


# --------------------------------------------------------------------------- gather, decide, share


class RemoteError(ObjckptError):
    """Rank 0's decision failed; raised on the other ranks.  ``kind`` names the
    exception type rank 0 raised, ``message`` its text; when ``kind`` is an
    objckpt error class the exception is also an instance of it (see
    :func:`refusal_class`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"rank 0: {kind}: {message}")
        self.kind = kind
        self.message = message


_refusal_classes: dict[tuple[str, type], type] = {}


def refusal_class(kind: str, base: "type[E]") -> "type[E]":
    """The class to raise on this rank for an error of type ``kind`` (a class
    name) that another rank raised: a subclass of both ``base`` and the objckpt
    error class named ``kind`` (``except UnsupportedValueError`` catches it on
    every rank alike), or ``base`` itself when ``kind`` names no objckpt error.
    Exceptions cross ranks as (class name, text), never pickled: the name is
    only looked up in :mod:`objckpt.errors`."""
    cls = getattr(_errors, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, ObjckptError)) or issubclass(base, cls):
        return base
    if any("__init__" in vars(c) for c in cls.__mro__ if issubclass(c, ObjckptError)):
        return base  # e.g. CollectiveLoadError(message, failures): not made from a message alone
    if issubclass(cls, base):
        return cls
    with _lock:
        made = _refusal_classes.get((kind, base))
        if made is None:
            made = type(kind, (cls, base), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                            "__doc__": cls.__doc__})
            _refusal_classes[(kind, base)] = made
    return made  # type: ignore[return-value]


def refusal(kind: str, message: str) -> ObjckptError:
    """An exception of the objckpt class named ``kind`` (else ObjckptError) with ``message``."""
    return refusal_class(kind, ObjckptError)(message)


@dataclass(frozen=True)
class _Verdict:
    value: Any = None
    kind: str = ""
    message: str = ""


def decide_on_root(comm: Comm, mine: T, decide: Callable[[list[T]], R]) -> R:
    """Gather ``mine`` from every rank; rank 0 computes ``decide(everyone)``;
    every rank returns that value.  If ``decide`` raises, rank 0 re-raises its
    own exception and every other rank raises :class:`RemoteError` (of the same
    objckpt error class as rank 0's, see :func:`refusal_class`), so no rank
    is left waiting in a collective the others will never join."""
    everyone = comm.all_gather_object(mine) if comm.world_size > 1 else [mine]
    verdict = _Verdict()
    failure: Optional[BaseException] = None
    if comm.rank == 0:
        try:
            verdict = _Verdict(decide(everyone))
        except Exception as e:  # noqa: BLE001 - shared with every rank, then re-raised
            failure, verdict = e, _Verdict(None, type(e).__name__, str(e))
    if comm.world_size > 1:
        verdict = comm.broadcast_object(verdict)
    if failure is not None:
        raise failure
    if verdict.kind:
        raise refusal_class(verdict.kind, RemoteError)(verdict.kind, verdict.message)
    return verdict.value


# --------------------------------------------------------------------------- groups made by objckpt

_gloo_groups: dict[Any, Any] = {}
_subgroups: dict[tuple[int, tuple[int, ...]], Any] = {}


def background_comm(comm: Comm, process_group: Any, *, purpose: str = "",
                    timeout: Optional[float] = None) -> Comm:
    """A gloo group of objckpt's own over the same ranks, for collectives issued off the
    caller's thread.  Created once per group, collectively, from the caller's thread.
    Never the caller's group itself, even when that is gloo: a background finish
    collective on it interleaves with the caller's own collectives (a
    ``distribute_tensor`` scatter while a save commits) in different orders on
    different ranks, and both wait for ever.  A non-empty ``purpose`` gets a separate
    group (tier replication runs beside an async save's commit, each in its own
    thread); ``timeout`` (seconds, set when the group is made) bounds each of its
    operations, so a rank that stops answering is an error, not a hang."""
    if not isinstance(comm, TorchComm):
        return comm
    import datetime

    import torch.distributed as dist

    key = process_group if not purpose else (process_group, purpose)
    with _lock:
        group = _gloo_groups.get(key)
    if group is None:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks=ranks, backend="gloo",
                               timeout=None if timeout is None else datetime.timedelta(seconds=timeout))
        with _lock:
            _gloo_groups[key] = group
    return TorchComm(group)


def subgroup(ranks: tuple[int, ...]) -> Any:
    """A process group of exactly ``ranks``, created once per default group and reused.

    ``new_group`` must be called by every rank of the job, in the same order:
    the caller calls it on every rank for every group that needs one, in
    sorted order (non-members get a non-member handle, cached alike)."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), ranks)
    with _lock:
        g = _subgroups.get(key)
        if g is None:
            g = dist.new_group(list(ranks))
            _subgroups[key] = g
        return g


class TensorGroup:
    """Tensor collectives among the members of one replica group (``ranks``,
    job-wide, sorted) over the process group ``pg``."""

    def __init__(self, ranks: tuple[int, ...], pg: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.ranks = ranks
        self.pg = pg
        self.me = ranks.index(dist.get_rank())

    def broadcast(self, buf: torch.Tensor, member: int) -> None:
        """``buf`` of member ``member`` to every member."""
        self._dist.broadcast(buf, src=self.ranks[member], group=self.pg)

    def all_gather(self, buf: torch.Tensor, slot: int) -> None:
        """Every member's ``slot`` bytes (member j's at ``buf[j*slot:(j+1)*slot]``) to every member."""
        k = len(self.ranks)
        if buf.is_cuda:  # NCCL: one ring all-gather; the input is a copy, never a view of the output
            # all_gather_single: the newer name of all_gather_into_tensor (which newer torch deprecates)
            gather_fn = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
            gather_fn(buf, buf[self.me * slot : (self.me + 1) * slot].clone(), group=self.pg)
        else:  # gloo: k broadcasts, measured 3-4x faster than gloo's all-gather for large slots
            for j in range(k):
                self.broadcast(buf[j * slot : (j + 1) * slot], j)
