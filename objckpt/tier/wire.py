"""How a tier copy's pieces cross the wire: host buffers over gloo, or device buffers over NCCL.

:mod:`objckpt.tier.transfer` reads pieces into host buffers, moves them round by round
and writes them out; *how* a round's pieces go from one rank's host buffer to another
rank's is this module's seam, so that the file reads and writes, the budget agreement
and the failure handling exist once for every transport.

* :class:`HostWire` (gloo): each piece goes over objckpt's tier gloo group straight
  from the host buffer it was read into (``isend``/``irecv``, TCP).
* :class:`DeviceWire` (NCCL): on a cluster the inter-node fabric (InfiniBand/RoCE with
  GPUDirect) is reached at full speed only through NCCL, which moves device memory.  Each
  piece is copied host→device into a device bounce buffer (two per partner and
  direction, allocated once per transfer, on objckpt's side CUDA stream), sent and
  received with NCCL over a group of objckpt's own (never the training's), and copied
  device→host into the pooled host buffer (or a restore's destination) before it is
  written.  A round's sends and receives are posted as one batch
  (``batch_isend_irecv``): NCCL runs a pair's sends and receives on one stream, and two
  ranks that each posted a send before their receive would wait for each other for ever.
  ``device="cpu"`` with ``backend="gloo"`` is the same staging with CPU "device" buffers
  over gloo: how the staging is tested on machines without GPUs.

A wire is long-lived (its group is made once, collectively, from the caller's thread:
:func:`objckpt.tier.topology.tier_wire`); :meth:`open` gives a :class:`Link` for one
transfer, holding that transfer's bounce buffers.  A failed post or wait raises the
transport's ``RuntimeError``; the transfer turns it into a
:class:`~objckpt.errors.CollectiveError` naming the partners.

:func:`register` / :func:`wire_for`: the wire chosen for a caller's group (by the
manager's ``tier_backend``) is the one every tier copy over that group uses; a group
nothing was registered for uses :class:`HostWire` over the tier gloo group, as before.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import torch

from ..runtime.memory import OperationBudget, side_stream
from .errors import TierSettingsError

#: the accepted values of ``tier_backend``
BACKENDS = ("auto", "gloo", "nccl")
#: how often a wait on NCCL looks whether the round completed (seconds, the first and the most)
_POLL = (0.0005, 0.05)

#: (partner's rank in the caller's group, host tensor: the piece to send, or where it lands)
Piece = tuple[int, torch.Tensor]


def resolve_backend(requested: str, group_backend: str, cuda: bool) -> str:
    """The transport of tier copies: ``"gloo"`` or ``"nccl"``.  ``auto``: NCCL where the
    training's group runs NCCL (``group_backend``, e.g. ``"nccl"`` or
    ``"cpu:gloo,cuda:nccl"``) and CUDA is available, else gloo.  An explicit ``"nccl"``
    without CUDA is a :class:`TierSettingsError` (said before anything is sent)."""
    if requested not in BACKENDS:
        raise TierSettingsError(f"tier_backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "nccl" and not cuda:
        raise TierSettingsError("tier_backend='nccl' needs CUDA on every rank, and this rank has no CUDA "
                                "device: use tier_backend='gloo' (or 'auto')")
    if requested == "auto":
        return "nccl" if cuda and "nccl" in group_backend else "gloo"
    return requested


@dataclass
class Posted:
    """One round's operations on the wire."""

    works: list[Any]
    #: the partners of the round (named when it fails)
    peers: tuple[int, ...]
    #: (device piece, host destination): copied device→host once the round completed
    landing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class Link(Protocol):
    """One transfer's use of a wire."""

    def post(self, slot: int, sends: Sequence[Piece], recvs: Sequence[Piece]) -> Posted:
        """Post one round: ``sends`` (host pieces, read already) and ``recvs`` (host
        destinations); ``slot`` (0 or 1) is the round's buffer slot."""
        ...

    def wait(self, posted: Posted) -> None:
        """Return once the round's pieces are in their host destinations and the host
        pieces it sent may be refilled."""
        ...

    def close(self, reuse: bool) -> None:
        """Let the transfer's buffers go (``reuse=False``: a failed round may still use them)."""
        ...


class Wire(Protocol):
    #: "gloo" or "nccl"
    backend: str

    @property
    def stages(self) -> bool:
        """Whether pieces pass through bounce buffers (then received pieces need them too)."""
        ...

    def open(self, to_global: Sequence[int], sizes: dict[str, dict[int, int]], budget: OperationBudget) -> Link:
        """A link for one transfer: ``to_global`` maps the caller's group ranks to global
        ranks; ``sizes[direction][partner]`` is that stream's largest piece."""
        ...


# --------------------------------------------------------------------------- gloo, host buffers


@dataclass
class HostWire:
    """Pieces go over a gloo group straight from and into host memory."""

    group: Any
    backend: str = "gloo"

    @property
    def stages(self) -> bool:
        return False

    def open(self, to_global: Sequence[int], sizes: dict[str, dict[int, int]], budget: OperationBudget) -> Link:
        return _HostLink(self.group, tuple(to_global))


@dataclass
class _HostLink:
    group: Any
    to_global: tuple[int, ...]

    def post(self, slot: int, sends: Sequence[Piece], recvs: Sequence[Piece]) -> Posted:
        import torch.distributed as dist

        # gloo matches one pair's messages in order: separate posts cannot deadlock
        works = [dist.isend(buf, dst=self.to_global[p], group=self.group) for p, buf in sends]
        works += [dist.irecv(buf, src=self.to_global[p], group=self.group) for p, buf in recvs]
        return Posted(works, tuple(p for p, _ in sends) + tuple(p for p, _ in recvs))

    def wait(self, posted: Posted) -> None:
        for w in posted.works:
            w.wait()

    def close(self, reuse: bool) -> None:
        pass


# --------------------------------------------------------------------------- NCCL, device buffers


@dataclass
class DeviceWire:
    """Pieces are staged into device bounce buffers and moved by ``backend`` over ``group``
    (objckpt's own NCCL group; gloo with ``device="cpu"`` for the CPU mirror).
    ``timeout``: seconds a round may take before it is a failure (the collective timeout)."""

    group: Any
    device: torch.device
    backend: str = "nccl"
    timeout: Optional[float] = None

    @property
    def stages(self) -> bool:
        return True

    def open(self, to_global: Sequence[int], sizes: dict[str, dict[int, int]], budget: OperationBudget) -> Link:
        return _DeviceLink(self, tuple(to_global), sizes, budget)


class _DeviceLink:
    """The bounce buffers of one transfer: ``[slot][direction][partner]``, each exactly the
    stream's largest piece, drawn from a device budget of the host budget's size (the
    agreed piece already fits both: :func:`objckpt.tier.transfer._piece_limit`)."""

    def __init__(self, wire: DeviceWire, to_global: tuple[int, ...], sizes: dict[str, dict[int, int]],
                 budget: OperationBudget) -> None:
        self.wire, self.to_global = wire, to_global
        self.budget = OperationBudget(budget.nbytes, f"the device bounce buffers of a tier copy on {wire.device} "
                                                     f"(as large as the {budget.name})")
        total = 2 * sum(n for by_partner in sizes.values() for n in by_partner.values())
        self.budget.draw(total, f"the device bounce buffers of a tier copy ({total} bytes)")
        self.held = total
        cuda = wire.device.type == "cuda"
        self.stream = side_stream(wire.device) if cuda else None
        self.slots = [{d: {p: torch.empty(n, dtype=torch.uint8, device=wire.device) for p, n in by.items()}
                       for d, by in sizes.items()} for _slot in range(2)]

    def _side(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else _nothing

    def post(self, slot: int, sends: Sequence[Piece], recvs: Sequence[Piece]) -> Posted:
        import torch.distributed as dist

        ops, landing = [], []
        # on the side stream: the wire waits for the host→device copies (the process group
        # orders its own stream after the current one), the training's stream does not
        with self._side():
            for p, host in sends:
                dev = self.slots[slot]["send"][p][: host.numel()]
                dev.copy_(host, non_blocking=True)
                ops.append(dist.P2POp(dist.isend, dev, self.to_global[p], self.wire.group))
            for p, host in recvs:
                dev = self.slots[slot]["recv"][p][: host.numel()]
                ops.append(dist.P2POp(dist.irecv, dev, self.to_global[p], self.wire.group))
                landing.append((dev, host))
            works = dist.batch_isend_irecv(ops) if ops else []
        return Posted(list(works), tuple(p for p, _ in sends) + tuple(p for p, _ in recvs), landing)

    def wait(self, posted: Posted) -> None:
        if self.stream is not None:
            self._until_complete(posted)
        with self._side():
            for w in posted.works:
                w.wait()  # NCCL: the side stream waits for the wire; gloo: the host does
            for dev, host in posted.landing:
                host.copy_(dev, non_blocking=True)
        if self.stream is not None:
            # the host pieces are written (and the sent ones refilled) only after this
            self.stream.synchronize()

    def _until_complete(self, posted: Posted) -> None:
        """NCCL's ``wait`` does not block the host: look until the round completed, and call
        one that takes longer than the timeout a failure (never a wait for ever)."""
        deadline = None if self.wire.timeout is None else time.monotonic() + self.wire.timeout
        pause = _POLL[0]
        for w in posted.works:
            while not w.is_completed():
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"a round of NCCL sends/receives did not complete within "
                                       f"{self.wire.timeout} s (the collective timeout)")
                time.sleep(pause)
                pause = min(pause * 2, _POLL[1])

    def close(self, reuse: bool) -> None:
        self.slots = []
        self.budget.release(self.held)
        self.held = 0


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_nothing = _Nothing()


# --------------------------------------------------------------------------- the wire of a group

_lock = threading.Lock()
_wires: dict[Any, Wire] = {}


def register(process_group: Any, wire: Optional[Wire]) -> None:
    """Tier copies over ``process_group`` (the caller's group; None: the default group) go
    over ``wire`` from now on (None: back to :class:`HostWire`)."""
    with _lock:
        if wire is None:
            _wires.pop(process_group, None)
        else:
            _wires[process_group] = wire


def wire_for(process_group: Any, tier_group: Any) -> Wire:
    """The wire registered for ``process_group``, else :class:`HostWire` over ``tier_group``
    (the tier's gloo group)."""
    with _lock:
        wire = _wires.get(process_group)
    return wire if wire is not None else HostWire(tier_group)
