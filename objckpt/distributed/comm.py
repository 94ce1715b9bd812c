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

* :func:`decide_on_root`: gather a value from every rank to rank 0 (only rank 0
  receives them), let it decide, share the decision; an exception in the decision
  reaches every rank.
* :func:`background_comm`: a gloo group over the same ranks, for collectives
  issued from a background thread (an async save's commit), never NCCL.
* :class:`TensorGroup`: the tensor collectives of a replica group (collective loads).
* :func:`join`: every rank of the group has entered the same objckpt operation,
  or :class:`RanksDidNotJoinError` within the collective timeout, never a hang.
* :func:`refusal_class`: the error class to raise for another rank's refusal, found in
  the registry of :mod:`objckpt.errors` (every ObjckptError subclass, wherever defined);
  :class:`RankError`: one rank's error as it crosses ranks (class name and text).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, TypeVar

import torch

from .. import errors as _errors
from ..errors import ObjckptError, error_class, error_name

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

    def gather_object(self, obj: Any) -> Optional[list[Any]]: ...

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

    def gather_object(self, obj: Any) -> Optional[list[Any]]:
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
    def gather_object(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0 (in group order); None on the other ranks, which
        receive nothing but the sizes: what only rank 0 reads costs the others nothing.
        torch all-gathers the sizes first, so a rank that died before the exchange fails
        it on every rank, as an all-gather would; one that dies while sending its object
        fails it on rank 0 only, and the others' next collective (the decision's broadcast)
        fails when rank 0 leaves or the group's timeout passes."""
        out: Optional[list[Any]] = [None] * self.world_size if self.rank == 0 else None
        dst = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._dist.gather_object(obj, out, dst=dst, group=self.group)
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

    @classmethod
    def from_message(cls, message: str) -> "RemoteError":
        """(The kind is in the text only: ``kind`` is empty.)"""
        made = cls("", message)
        made.args = (message,)
        return made


@dataclass(frozen=True)
class RankError:
    """One rank's error as it crosses ranks: never the exception itself (never pickled),
    but the registered name of its class (:func:`objckpt.errors.error_name`), which picks
    the class every rank raises, and the text that describes it."""

    kind: str
    text: str

    @classmethod
    def of(cls, e: BaseException, doing: str = "") -> "RankError":
        """``e`` as it crosses ranks; its text is ``doing`` then ``"ClassName: message"``."""
        return cls(error_name(e), f"{doing}{type(e).__name__}: {e}")

    def __str__(self) -> str:
        return self.text


_refusal_classes: dict[tuple[type, type], type] = {}


def _takes_message(cls: type) -> bool:
    """Whether ``cls(message)`` builds it: no objckpt class in its MRO has an ``__init__`` of its own."""
    return not any("__init__" in vars(c) for c in cls.__mro__ if issubclass(c, ObjckptError))


def refusal_class(kind: str, base: "type[E]") -> "type[E]":
    """The class to raise on this rank for an error of type ``kind`` (a registered
    name, :func:`objckpt.errors.error_name`) that another rank raised: built as ``base``
    is built (``base(message)``; ``RemoteError(kind, message)``; ``CollectiveLoadError(
    message, failures)``), an instance of both ``base`` and the class named ``kind``
    (``except TierSettingsError`` catches it on every rank alike), or ``base`` itself
    when ``kind`` names no ObjckptError class.  Exceptions cross ranks as (class name,
    text), never pickled: the name is only looked up in the registry.

    When ``kind``'s class is built from a message alone and is a ``base``, it is
    returned as it is; otherwise a subclass of it (same name, module and doc) is made
    once, whose ``__init__`` is ``base``'s, and whose attributes beyond ``base``'s take
    the values the class's :meth:`~objckpt.errors.ObjckptError.from_message` gives."""
    cls = error_class(kind)
    if cls is None or issubclass(base, cls):
        return base
    if issubclass(cls, base) and _takes_message(cls) and _takes_message(base):
        return cls  # type: ignore[return-value]
    with _lock:
        made = _refusal_classes.get((cls, base))
        if made is None:
            made = _made_class(cls, base)
            _refusal_classes[(cls, base)] = made
    return made  # type: ignore[return-value]


def _made_class(cls: type[ObjckptError], base: type) -> type:
    """A subclass of ``cls`` (and of ``base``) built as ``base`` is: see :func:`refusal_class`."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)  # type: ignore[misc]  # base's constructor, on purpose
        for name, value in vars(cls.from_message(str(self))).items():  # cls's own attributes, at their defaults
            self.__dict__.setdefault(name, value)
        self._objckpt_made_with = (args, kwargs)

    def __reduce__(self: Any) -> tuple:  # pickled as (cls, base) and base's arguments, not by its name (cls's)
        args, kwargs = self._objckpt_made_with
        return _remade, (cls, base, args, kwargs), self.__dict__

    bases = (cls,) if issubclass(cls, base) else (cls, base)
    return type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                      "__doc__": cls.__doc__, "__init__": __init__, "__reduce__": __reduce__,
                                      "_objckpt_stands_for": cls})


def _remade(cls: type[ObjckptError], base: type, args: tuple, kwargs: dict[str, Any]) -> BaseException:
    """An unpickled instance of the class :func:`refusal_class` made for (``cls``, ``base``)."""
    made: type[BaseException] = refusal_class(error_name(cls), base)
    return made(*args, **kwargs)


def refusal(kind: str, message: str) -> ObjckptError:
    """An exception of exactly the ObjckptError class registered as ``kind`` (else
    ObjckptError) whose text is ``message``."""
    cls = error_class(kind)
    return cls.from_message(message) if cls is not None else ObjckptError(message)


@dataclass(frozen=True)
class _Verdict:
    value: Any = None
    kind: str = ""
    message: str = ""


class DecisionNotShared(_errors.CollectiveError):
    """A collective of :func:`decide_on_root` failed (a rank died or the network did):
    this rank did not learn rank 0's decision, or rank 0 could not share it.

    ``decided`` is true on rank 0 when it had decided (``value`` is then its
    decision, ``failure`` the exception its decision raised, if any) before the
    sharing failed; on every other rank it is false.  The caller must not assume
    what rank 0 did: a save, for one, learns the fate of its commit from storage
    (:mod:`objckpt.save.decision`)."""

    def __init__(self, message: str, *, phase: str = "", decided: bool = False, value: Any = None,
                 failure: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.phase = phase
        self.decided = decided
        self.value = value
        self.failure = failure


def decide_on_root(comm: Comm, mine: T, decide: Callable[[list[T]], R]) -> R:
    """Gather ``mine`` from every rank to rank 0; rank 0 computes ``decide(everyone)``;
    every rank returns that value.  Only rank 0 receives (and unpickles) the reports: at
    65,536 ranks an all-gather made every rank unpickle 65,536 commit outcomes
    (docs/s3-scale.md §6).  If ``decide`` raises, rank 0 re-raises its
    own exception and every other rank raises :class:`RemoteError` (of the same
    objckpt error class as rank 0's, see :func:`refusal_class`), so no rank
    is left waiting in a collective the others will never join.  A failed
    collective raises :class:`DecisionNotShared` (a ``CollectiveError``) saying
    whether rank 0 had decided."""
    try:
        everyone = comm.gather_object(mine) if comm.world_size > 1 else [mine]
    except _errors.CollectiveError as e:
        raise DecisionNotShared(str(e), phase="gathering every rank's report") from e
    verdict = _Verdict()
    failure: Optional[BaseException] = None
    if comm.rank == 0:
        try:
            if everyone is None:  # a Comm whose gather gave rank 0 nothing: a broken implementation
                raise _errors.CollectiveError(
                    f"gathering every rank's report gave rank 0 nothing ({type(comm).__name__}.gather_object)")
            verdict = _Verdict(decide(everyone))
        except Exception as e:  # noqa: BLE001 - shared with every rank, then re-raised
            failure, verdict = e, _Verdict(None, error_name(e), str(e))
    if comm.world_size > 1:
        mine_verdict = verdict
        try:
            verdict = comm.broadcast_object(verdict)
        except _errors.CollectiveError as e:
            raise DecisionNotShared(str(e), phase="sharing rank 0's decision", decided=comm.rank == 0,
                                    value=mine_verdict.value, failure=failure) from e
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
