"""Will a tiered save fit?  Each filesystem's free space against what the save lands on it.

Several ranks of a node write their shares into the same folder, and with
``replicas=k`` each node also receives copies of other nodes' shares
(:meth:`~objckpt.tier.topology.Topology.peers_for`: a node receives the shares of
the ``k`` nodes before it in the ring).  A check of each rank's own share against
its folder's free space passes where the node as a whole does not fit, and the
save then fails part-way, on a full disk.  So before a tiered save every rank
measures its share and its folder (:func:`measure`: a small :class:`Room`), the
records travel in the all-gather the save makes anyway (its checks), and every
rank computes the same verdict from the same records (:func:`node_problems`):
nothing is written unless every filesystem holds what lands on it.

What is counted (an upper bound of what the save writes; the save plan, which knows
the exact bytes, is made inside the save, after this check):

* ``own``: the tensors only this rank holds, whole: the local shards of DTensors
  sharded on every mesh dimension and :class:`objckpt.Shard` values (a box that
  several ranks pass as a ``Shard`` is counted on each of them);
* ``shared``: the tensors several ranks hold alike: plain tensors (the save
  enforces that they are equal on every rank and writes each once, its pieces
  spread over the ranks) and DTensors replicated on some mesh dimension (each box
  written once, by one of the ranks holding it).  A node's ranks write at most all
  of them once, and at most what they hold: ``min(sum of the ranks' local bytes,
  the tensors' whole bytes)`` per node, not the sum (which counts a plain tensor
  once per rank);
* what a node receives: each sending rank's ``own``, and its ``shared`` bounded the
  same way per sending node;
* not counted: the metadata (the manifest and the rank indexes, written on every
  node: small next to the tensors), the filesystem's rounding of each file to its
  blocks, and what an earlier save's background work (an async save's local commit,
  a replication) still has to write when the check runs.

A filesystem is one ``(machine, device)``: the kernel's boot id (the same for
containers on one machine) and the folder's ``st_dev``, so nodes that are folders
on one disk (tests, ``OBJCKPT_NODE`` on one machine) are added up against that
disk's free space.  Each filesystem's free space is the smallest any of its ranks
measured (``statvfs``, the space this user may use).
"""
from __future__ import annotations

import functools
import os
import resource
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from ..distributed.placements import Shard, is_dtensor, is_replicate
from ..state import expand_for_save
from ..distributed.comm import RankError
from .errors import local_problem
from .topology import Topology


@dataclass(frozen=True)
class Share:
    """The bytes of a rank's state, as the space check counts them (see the module docstring)."""

    #: tensors only this rank holds (local shards of fully sharded DTensors, objckpt.Shard)
    own: int = 0
    #: this rank's bytes of the tensors several ranks hold alike (plain, partly replicated DTensors)
    shared: int = 0
    #: those tensors' whole bytes (a plain tensor's own; a DTensor's global size)
    shared_whole: int = 0

    @property
    def total(self) -> int:
        """What this rank alone may write at most: everything it holds."""
        return self.own + self.shared


def share_of(state: Any) -> Share:
    """This rank's :class:`Share` of ``state`` (no tensor is read).  Stateful values are taken
    as the save takes them (:func:`~objckpt.state.expand_for_save`: a state already expanded
    is walked as it is, nothing called twice), tensors told apart as the save tells them."""
    seen: set[int] = set()
    own = shared = whole = 0

    def walk(v: Any) -> None:
        nonlocal own, shared, whole
        if id(v) in seen:
            return
        seen.add(id(v))
        if isinstance(v, Shard):
            own += v.local.numel() * v.local.element_size()
        elif is_dtensor(v):
            local = v.to_local()
            n = local.numel() * local.element_size()
            if any(is_replicate(p) for p in v.placements):
                shared += n
                whole += v.numel() * v.element_size()
            else:
                own += n
        elif isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            shared += n
            whole += n
        elif isinstance(v, Mapping):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(expand_for_save(state))
    return Share(own, shared, whole)


@dataclass(frozen=True)
class Place:
    """A folder's filesystem as one rank measured it."""

    #: the machine: the kernel's boot id (shared by its containers), else the host name
    machine: str
    #: the folder's device (``st_dev``)
    device: int
    #: bytes this user may still write there
    free: int


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def place_of(root: Path) -> Place:
    """``root``'s filesystem and its free space (OSError when they cannot be read)."""
    st = os.statvfs(root)
    return Place(_machine(), os.stat(root).st_dev, st.f_bavail * st.f_frsize)


@dataclass(frozen=True)
class Room:
    """What one rank adds to a save's checks: its share and its folder (small: it is all-gathered)."""

    folder: str
    share: Share
    place: Optional[Place]
    #: why the folder's free space could not be read (``place`` is None then)
    error: Optional[str] = None


def measure(root: Path, share: Share) -> Room:
    """This rank's :class:`Room`: ``share`` and its folder ``root``'s filesystem."""
    try:
        return Room(str(root), share, place_of(root))
    except OSError as e:
        return Room(str(root), share, None, f"local_dir {str(root)!r}: cannot read its free space: {e.strerror or e}")


def fsize_error(root: Path, need: int) -> Optional[str]:
    """Why this process may not write ``need`` bytes under ``root`` (None: it may): its
    file-size limit (RLIMIT_FSIZE, per process: checked by each rank for its own share)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and need > soft:
        return (f"local_dir {str(root)!r}: this process may write files of at most {soft} bytes (RLIMIT_FSIZE), "
                f"this rank's share of the checkpoint needs up to {need}")
    return None


def _shared_bound(shares: Sequence[Share]) -> int:
    """The most a set of ranks writes of the tensors several ranks hold alike: what they hold,
    and at most those tensors whole once."""
    return min(sum(s.shared for s in shares), max((s.shared_whole for s in shares), default=0))


def _writes(shares: Sequence[Share]) -> int:
    """The most a set of ranks writes (their files: what lands in a node's folder as theirs or as replicas)."""
    return sum(s.own for s in shares) + _shared_bound(shares)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class NodeNeed:
    """What one save lands in one node's folder."""

    node: str
    folder: str
    #: its ranks' shares
    writes: int
    #: the replicas it receives, by sending node
    receives: dict[str, int]

    @property
    def total(self) -> int:
        return self.writes + sum(self.receives.values())


def node_needs(rooms: Sequence[Room], topology: Topology, replicas: int) -> list[NodeNeed]:
    """Each node's :class:`NodeNeed` for one save (``rooms[r]``: rank ``r``'s), in ring order
    (linear in the ranks: a node receives the shares of :meth:`Topology.senders` whole)."""
    ranks: dict[str, list[int]] = {}
    for r, n in enumerate(topology.nodes):
        ranks.setdefault(n, []).append(r)
    writes = {n: _writes([rooms[r].share for r in rs]) for n, rs in ranks.items()}
    senders = topology.senders(replicas) if replicas else {}
    return [NodeNeed(n, rooms[rs[0]].folder, writes[n], {src: writes[src] for src in senders.get(n, ())})
            for n, rs in ranks.items()]


def node_problems(rooms: Sequence[Room], topology: Topology, replicas: int) -> list[Optional[RankError]]:
    """Per rank, its problem with the save's space (None: none), the same list on every rank
    given the same ``rooms``: a rank whose folder's free space cannot be read; a filesystem
    that cannot hold what the save lands on it (its nodes' shares and the replicas they
    receive), reported on the first rank of its first node, naming the nodes, the folder,
    the bytes needed and free."""
    out: list[Optional[RankError]] = [local_problem(r.error) if r.error else None for r in rooms]
    if any(p is not None for p in out):
        return out
    first: dict[str, int] = {}
    for r, n in enumerate(topology.nodes):
        first.setdefault(n, r)
    by_fs: dict[tuple[str, int], list[NodeNeed]] = {}
    for need in node_needs(rooms, topology, replicas):
        place = rooms[first[need.node]].place
        if place is None:  # unreachable: every room has a place when none has an error
            continue
        by_fs.setdefault((place.machine, place.device), []).append(need)
    free_of: dict[tuple[str, int], int] = {}
    for room in rooms:
        if room.place is not None:
            key = (room.place.machine, room.place.device)
            free_of[key] = min(free_of.get(key, room.place.free), room.place.free)
    for key, needs in by_fs.items():
        free = free_of[key]
        total = sum(n.total for n in needs)
        if total <= free:
            continue
        parts = [_node_text(n, replicas) for n in needs]
        out[first[needs[0].node]] = local_problem((
            f"local_dir {needs[0].folder!r} (node {needs[0].node!r}) has {free} bytes free ({_mib(free)}), the step "
            f"needs up to {total} bytes ({_mib(total)}) there: " + "; ".join(parts)
            + (" (the folders of these nodes are on one filesystem)" if len(needs) > 1 else "")
            + ": the disk is (nearly) full; free space there, keep fewer local steps (local_keep)"
            + (", lower replicas" if any(n.receives for n in needs) else "") + " or point local_dir at a larger disk"))
    return out


def _node_text(need: NodeNeed, replicas: int) -> str:
    text = f"node {need.node!r}: {need.writes} bytes for the shares of its rank(s)"
    if need.receives:
        text += (f" + {sum(need.receives.values())} bytes for the replicas (replicas={replicas}) it receives from "
                 + ", ".join(f"node {src!r} ({b} bytes)" for src, b in need.receives.items()))
    return text
