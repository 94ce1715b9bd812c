"""Check that every rank entered the same objckpt operation before its first collective.

A save or load called by one rank alone (``if rank == 0: objckpt.save(...)``,
Lightning's ``save_checkpoint`` under DDP) would wait in its first
``all_gather_object`` until the process group's timeout, 30 minutes by
default, or for ever.  Before that collective every rank registers with the
job's rendezvous store (the TCPStore ``init_process_group`` made), which needs
no collective and waits server-side (no polling):

* each rank adds 1 to a counter named for the group and this operation's
  sequence number; the rank that completes the count marks the operation
  ``done`` (a compare-and-set), waking the others;
* a rank that waited ``collective_timeout`` seconds marks it ``cancelled``
  instead (the same compare-and-set, so exactly one of ``done`` and
  ``cancelled`` wins) and raises :class:`RanksDidNotJoinError`; a rank that
  arrives later sees ``cancelled`` and raises too, and the next operation
  starts a new generation of that sequence number, so ranks that never joined
  the cancelled one pair up with the others again.

Only ranks that saw ``done`` enter the collectives, so none is left waiting.
One store round trip per rank and operation; nothing when there is no process
group (:class:`LocalComm`) or no default store.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import threading
from typing import Any, Optional

from ..errors import RanksDidNotJoinError
from .comm import Comm, TorchComm

#: default of ``collective_timeout`` (seconds); the environment variable overrides it
DEFAULT_COLLECTIVE_TIMEOUT = 600.0
TIMEOUT_ENV = "OBJCKPT_COLLECTIVE_TIMEOUT"

_DONE, _CANCELLED = b"done", b"cancelled"
_lock = threading.Lock()
_seq: dict[str, int] = {}


def collective_timeout(value: Optional[float]) -> float:
    """Seconds to wait for the other ranks: ``value``, else ``$OBJCKPT_COLLECTIVE_TIMEOUT``,
    else 600; never more than the rendezvous store's own timeout."""
    if value is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        try:
            value = float(env) if env else DEFAULT_COLLECTIVE_TIMEOUT
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
    if not value > 0:
        raise ValueError(f"collective_timeout must be a positive number of seconds, got {value!r}")
    return float(value)


def _default_store() -> Any:
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (or a torch without it): no check, as before
        return None


def join(comm: Comm, what: str, timeout: Optional[float]) -> None:
    """Return once every rank of ``comm`` has entered operation ``what``;
    raise :class:`RanksDidNotJoinError` (on every rank that did) when some
    rank has not after ``timeout`` seconds (see :func:`collective_timeout`)."""
    if not isinstance(comm, TorchComm) or comm.world_size <= 1:
        return
    seconds = collective_timeout(timeout)
    store = _default_store()
    if store is None:
        return
    store_timeout = getattr(store, "timeout", None)
    if isinstance(store_timeout, datetime.timedelta) and store_timeout.total_seconds() > 0:
        seconds = min(seconds, store_timeout.total_seconds())
    group = hashlib.blake2b(repr(comm.global_ranks()).encode(), digest_size=8).hexdigest()
    with _lock:
        seq = _seq.get(group, 0)
    base = f"objckpt/join/{group}/{seq}"
    gen = store.add(f"{base}/gen", 0)
    key = f"{base}/{gen}"
    state_key = f"{key}/state"
    if store.add(f"{key}/n", 1) >= comm.world_size:
        state = store.compare_set(state_key, "", _DONE.decode())
    else:
        try:
            store.wait([state_key], datetime.timedelta(seconds=seconds))
            state = store.get(state_key)
        except RuntimeError:  # DistStoreError: nobody completed the count in time
            state = store.compare_set(state_key, "", _CANCELLED.decode())
            if state == _CANCELLED:  # this rank cancelled it: the next operation starts a new generation
                store.add(f"{base}/gen", 1)
    if state == _DONE:
        with _lock:
            _seq[group] = seq + 1
        return
    raise RanksDidNotJoinError(
        f"{what}: rank {comm.rank} of {comm.world_size} waited {seconds:g} s but not every rank of the "
        "process group called it (objckpt's collective operations must be called by every rank). "
        "To save or load from this rank alone (e.g. rank 0 only), pass no_dist=True; to wait longer, "
        f"pass collective_timeout=... or set {TIMEOUT_ENV}."
    )


#: how long survivors of a failed collective wait for each other's roll call (seconds)
ROLL_CALL_SECONDS = 2.0


def unanswered_ranks(comm: Comm, tag: str, seconds: float = ROLL_CALL_SECONDS) -> Optional[tuple[int, ...]]:
    """After a collective failed: the ranks of ``comm`` that did not answer a roll call
    on the rendezvous store within ``seconds`` (dead, or stuck elsewhere), for an error
    that names them.  Each survivor sets its own key and waits for the others' (no
    collective: the group itself may be broken).  None when it cannot be told (no
    process group or store, or the store itself is gone with the rank that hosted it).
    ``tag`` must name the failed operation the same way on every rank."""
    if not isinstance(comm, TorchComm) or comm.world_size <= 1:
        return None
    store = _default_store()
    if store is None:
        return None
    base = f"objckpt/roll/{tag}"
    names = [f"{base}/{r}" for r in range(comm.world_size)]
    try:
        store.set(names[comm.rank], b"1")
        try:
            store.wait(names, datetime.timedelta(seconds=seconds))
            return ()
        except RuntimeError:  # someone did not answer in time: who
            return tuple(r for r, k in enumerate(names) if not store.check([k]))
    except Exception:  # noqa: BLE001 - the store is unreachable (its host died): cannot tell
        return None
