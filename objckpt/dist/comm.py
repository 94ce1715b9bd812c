"""The few collectives objckpt needs, behind one small interface.

Multi-host runs use torch.distributed (torchrun; NCCL on GPU, gloo on CPU);
objckpt never builds a cluster layer of its own.  Every save/load issues a
fixed, small number of object collectives (metadata exchange, outcome
exchange), always from the caller's thread, so NCCL's rule that collectives
are issued in the same order on every rank from one thread holds.  A
single-process :class:`LocalComm` makes every path work without a process
group.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol


class Comm(Protocol):
    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self) -> None: ...

    def group_rank(self, global_rank: int) -> "int | None": ...


class LocalComm:
    """One process, no process group."""

    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def group_rank(self, global_rank: int) -> Optional[int]:
        return 0 if global_rank == 0 else None


class TorchComm:
    """torch.distributed over ``group`` (None: the default group)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        global_src = self._dist.get_global_rank(self.group, src) if self.group is not None else src
        self._dist.broadcast_object_list(box, src=global_src, group=self.group)
        return box[0]

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
