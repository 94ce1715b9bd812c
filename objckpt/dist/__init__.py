"""Collectives seam: torch.distributed when a process group is up, a no-op otherwise."""
from .comm import Comm, LocalComm, TorchComm, get_comm

__all__ = ["Comm", "LocalComm", "TorchComm", "get_comm"]
