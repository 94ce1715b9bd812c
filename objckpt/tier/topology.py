"""Which rank runs on which node, and where a rank's replicas go.

A tiered checkpoint keeps each rank's share on its own node and copies it to
``k`` peer ranks.  A copy on the same node dies with the original (a node is
lost whole: its memory, its ``/dev/shm``, its local disk), so peers are always
ranks on *other* nodes, and the ``k`` copies of one share lie on ``k``
different nodes: losing any one node leaves at least ``k`` copies of every
share, losing ``j <= k`` nodes leaves at least one.

"Node" comes from the real topology: ``socket.gethostname()``, unless the
environment variable ``OBJCKPT_NODE`` (tests, where temporary directories stand
for nodes; containers whose hostnames are not the machine's) or an explicit
override names it.  Every rank's node name is all-gathered once, so every rank
holds the same :class:`Topology` and computes the same placement without
further messages.

Placement (:meth:`Topology.peers_for`): nodes in a ring, ordered by their lowest
rank; the peers of the rank with local index ``j`` on node ``i`` are the ranks
of the same local index (modulo the node's size) on nodes ``i+1 .. i+k``.  With
equal nodes every rank sends ``k`` shares and receives ``k``: the load is even.

Tier traffic runs on a gloo group of objckpt's own (:func:`tier_comm`), created
by :meth:`Topology.build` from the caller's thread, so a later replication may
run in a background thread without interleaving with the training's collectives
or with an async save's commit.  The pieces themselves may go over NCCL instead
(:func:`tier_wire`, the manager's ``tier_backend``): a second group of objckpt's own,
made the same way; the agreements stay on the gloo group.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
import threading
from typing import Any, Optional

import torch

from ..distributed.comm import Comm, TorchComm, background_comm
from ..distributed.join import collective_timeout
from .errors import TierSettingsError
from .wire import DeviceWire, HostWire, Wire, register

#: environment variable naming this rank's node (overrides the hostname)
NODE_ENV = "OBJCKPT_NODE"
#: the purpose key of the tier's own gloo group (see :func:`background_comm`)
TIER_GROUP = "tier"


class TopologyError(TierSettingsError):
    """The job's topology cannot hold what was asked: replicas on other nodes when
    there are too few nodes, a rank outside the group, a blank node name."""


def node_name(override: Optional[str] = None) -> str:
    """This process's node: ``override``, else ``$OBJCKPT_NODE``, else the hostname."""
    for value, where in ((override, "node_override"), (os.environ.get(NODE_ENV), NODE_ENV)):
        if value is not None:
            if not value.strip():
                raise TopologyError(f"{where} is blank: name the node (or leave it unset to use the hostname)")
            return value.strip()
    return socket.gethostname()


def tier_comm(comm: Comm) -> Comm:
    """objckpt's gloo group for tier traffic over ``comm``'s ranks (the same object on
    every call).  Made on first use, collectively, so call it first from the
    training thread (:meth:`Topology.build` does).  Its operations time out after the
    collective timeout (``$OBJCKPT_COLLECTIVE_TIMEOUT``, else 600 s), so a rank that
    stops answering is a :class:`~objckpt.errors.CollectiveError`, never a hang."""
    return background_comm(comm, comm.group, purpose=TIER_GROUP, timeout=collective_timeout(None))


_lock = threading.Lock()
#: (caller's group, backend, device) -> objckpt's data group for tier pieces
_wire_groups: dict[tuple[Any, str, str], Any] = {}


def tier_wire(comm: Comm, backend: str, device: "Optional[torch.device | str]" = None) -> Wire:
    """Collective, from the caller's thread: the wire tier copies over ``comm``'s group use
    from now on (registered: :func:`~objckpt.tier.wire.wire_for`), every rank alike.
    ``"gloo"``: pieces over :func:`tier_comm`'s group, from host memory.  ``"nccl"``:
    pieces staged through buffers on ``device`` (default: this rank's current CUDA
    device) over a NCCL group of objckpt's own over the same ranks (made once, with the
    collective timeout; never the training's group, whose collectives the training issues
    meanwhile), warmed up here with one all-reduce so that its communicator is made from
    this thread and with every rank present (a NCCL group's first batched send/receive
    must include every rank).  ``backend="gloo"`` with a ``device`` (``"cpu"``: tests) is
    that staging over a second gloo group.  Ranks that resolved different backends are a
    :class:`TierSettingsError` on every rank."""
    if comm.world_size <= 1 or not isinstance(comm, TorchComm):
        return HostWire(getattr(comm, "group", None))
    import datetime

    import torch.distributed as dist

    tc = tier_comm(comm)
    device = torch.device(device) if device is not None else None
    staged = backend == "nccl" or device is not None
    if staged and device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dev = device if device is not None else torch.device("cpu")
    mine = (backend, None if device is None else device.type)
    everyone = tc.all_gather_object(mine)
    if len(set(everyone)) > 1:
        raise TierSettingsError("the ranks chose different transports for tier copies: "
                                + ", ".join(f"rank {r}: {b}" + (f" on {d}" if d else "")
                                            for r, (b, d) in enumerate(everyone))
                                + "; every rank must pass the same tier_backend and have the same devices")
    wire: Wire
    if not staged:
        wire = HostWire(tc.group)
    else:
        key = (comm.group, backend, dev.type)
        timeout = collective_timeout(None)
        with _lock:
            group = _wire_groups.get(key)
        if group is None:
            ranks = None if comm.group is None else dist.get_process_group_ranks(comm.group)
            group = dist.new_group(ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout))
            ones = torch.ones(1, device=dev)
            dist.all_reduce(ones, group=group)  # the communicator is made now, here, by every rank
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            with _lock:
                _wire_groups[key] = group
        wire = DeviceWire(group, dev, backend, timeout)
    register(comm.group, wire)
    return wire


@dataclass(frozen=True)
class Topology:
    """The node of every rank of a group, the same on every rank.

    ``nodes[r]`` is the node name of rank ``r`` (ranks of the group ``comm`` that built it)."""

    nodes: tuple[str, ...]

    @classmethod
    def build(cls, comm: Comm, node_override: Optional[str] = None) -> "Topology":
        """Collective: gather every rank's node name (``node_override``, else
        ``$OBJCKPT_NODE``, else the hostname).  Also creates the tier's gloo group
        (:func:`tier_comm`) here, on the caller's thread."""
        mine = node_name(node_override)
        if comm.world_size <= 1:
            return cls((mine,))
        return cls(tuple(tier_comm(comm).all_gather_object(mine)))

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def node_names(self) -> tuple[str, ...]:
        """The distinct nodes, ordered by their lowest rank (the placement ring)."""
        return tuple(dict.fromkeys(self.nodes))

    def node_of(self, rank: int) -> str:
        """The node rank ``rank`` runs on."""
        self._check_rank(rank)
        return self.nodes[rank]

    def ranks_on(self, node: str) -> tuple[int, ...]:
        """The ranks on ``node``, ascending (empty for an unknown node)."""
        return tuple(r for r, n in enumerate(self.nodes) if n == node)

    def check_replicas(self, k: int) -> None:
        """:class:`TopologyError` unless ``k`` replicas fit: ``0 <= k < nodes`` and ``k < world size``."""
        n_nodes = len(self.node_names)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise TopologyError(f"replicas must be a non-negative integer, got {k!r}")
        if k >= self.world_size:
            raise TopologyError(
                f"replicas={k} needs more than {k} ranks, but the group has world size {self.world_size}: "
                f"use replicas < {self.world_size}")
        if k >= n_nodes:
            raise TopologyError(
                f"replicas={k} needs {k + 1} nodes (each replica on a node other than the original's, "
                f"no two on one node), but the {self.world_size} ranks run on {n_nodes} node(s) "
                f"{list(self.node_names)[:8]}: use replicas < {n_nodes}, or set {NODE_ENV} per rank")

    def peers_for(self, rank: int, k: int) -> list[int]:
        """The ``k`` ranks that hold copies of ``rank``'s share: one on each of the ``k``
        nodes after ``rank``'s own in the ring, at ``rank``'s local index (modulo the
        node's size).  Never on ``rank``'s node, never two on one node."""
        self._check_rank(rank)
        self.check_replicas(k)
        ring = self.node_names
        here = ring.index(self.nodes[rank])
        local = self.ranks_on(ring[here]).index(rank)
        out = []
        for d in range(1, k + 1):
            there = self.ranks_on(ring[(here + d) % len(ring)])
            out.append(there[local % len(there)])
        return out

    def senders(self, k: int) -> dict[str, tuple[str, ...]]:
        """Each node -> the nodes whose shares it receives copies of with ``k`` replicas: the
        ``k`` nodes before it in the ring, nearest first.  Every rank of each of them sends
        its share to exactly one rank of the node (:meth:`peers_for`), so a node receives
        those nodes' shares whole.  Per node, not per rank: the space check before every
        save asks it for every node (linear in the ranks, where :meth:`sources_for` of
        every rank is quadratic)."""
        self.check_replicas(k)
        ring = self.node_names
        return {n: tuple(ring[(i - d) % len(ring)] for d in range(1, k + 1)) for i, n in enumerate(ring)}

    def sources_for(self, rank: int, k: int) -> list[int]:
        """The ranks whose shares ``rank`` holds copies of (the inverse of :meth:`peers_for`)."""
        self._check_rank(rank)
        return [s for s in range(self.world_size) if rank in self.peers_for(s, k)]

    def _check_rank(self, rank: int) -> None:
        if not (isinstance(rank, int) and 0 <= rank < self.world_size):
            raise TopologyError(f"rank {rank!r} is not a rank of this group (world size {self.world_size})")
