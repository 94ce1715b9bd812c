"""Does this store honour create-only writes?  Asked once per store per process, before a save writes.

Why: the single-winner commit, the step index's compare-and-swap and a
multi-rank save's decision record all rest on the store refusing a create-only
write (S3 ``If-None-Match: *``) when the object exists.  Some S3-compatible
stores accept the header and ignore it.  Reading each write back
(:mod:`objckpt.save.commit`, :meth:`StepIndex._confirm_ours`) catches a rival
write that landed before the read, not one that lands after, so on such a
store two writers can both be told "committed".  The probe answers the
question for the store itself, deterministically: it creates a probe object
twice with the condition; a store that lets the second create succeed ignores
it.  Three requests (two PUTs, a DELETE).

Who asks: rank 0 of a save that may not replace a checkpoint, right after it
found none there and before the save's first exchange
(:func:`objckpt.save.pipeline.prepare`: every rank then refuses alike, before
any blob is written; an overwrite writes its manifest unconditionally and does
not ask), and the manager's worker before its first index update (a tiered
save's drain reaches object storage without ``prepare``).  The verdict is kept
on the store object: stores are cached per root and options
(:func:`objckpt.storage.open_store`), so a job's saves and its manager's index
share one store and one probe.  A store whose ``if_absent_enforced`` says so
(local files, memory) is never probed.

The probe object is ``<near>/_objckpt_probe/probe-<random>``, ``near`` being
the checkpoint's own prefix (writable wherever the save is; the manager's
worker probes under its root); it is deleted right after.  Its name is no
blob, index or manifest name, so ``ls`` and the index never take it for part
of a checkpoint; one left by a save killed while probing is removed by ``gc``
(:func:`is_probe_key`, aged by its time).
"""
from __future__ import annotations

import re
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

from ..errors import ConditionalWriteIgnoredError, PreconditionFailed
from ..format import keys
from ..logs import get_logger
from ..results import IOStats
from ..storage import ObjectStore

log = get_logger("objckpt.save")

#: the folder (under the checkpoint's prefix) the probe object is created in
PROBE_DIR = "_objckpt_probe"
#: the probe object's key: ``<near>/_objckpt_probe/probe-<16 hex>`` (gc removes one a killed save left)
_PROBE_KEY = re.compile(r"(?:.*/)?" + PROBE_DIR + r"/probe-[0-9a-f]{16}")


def is_probe_key(key: str) -> bool:
    """Whether ``key`` is a probe object (one left behind is garbage: :mod:`objckpt.ops.gc`)."""
    return _PROBE_KEY.fullmatch(key) is not None


@dataclass(frozen=True)
class ConditionalWriteCheck:
    """The probe's verdict; ``detail`` says what the store did."""

    honoured: bool
    detail: str = ""


_verdicts: "weakref.WeakKeyDictionary[ObjectStore, ConditionalWriteCheck]" = weakref.WeakKeyDictionary()
_accepted: "weakref.WeakSet[ObjectStore]" = weakref.WeakSet()  # single-writer acceptance logged
_lock = threading.Lock()


def known(store: ObjectStore) -> Optional[ConditionalWriteCheck]:
    """The verdict on ``store`` without a request, or None when it has to be probed."""
    if store.if_absent_enforced:
        return ConditionalWriteCheck(True)
    with _lock:
        return _verdicts.get(store)


async def conditional_writes(store: ObjectStore, near: str, stats: Optional[IOStats] = None) -> ConditionalWriteCheck:
    """Whether ``store`` honours create-only writes: known, or probed under ``near`` (once
    per store; the probe's requests are added to ``stats``).  A probe that fails raises
    (and is tried again next time): the caller decides what an unknown answer means."""
    found = known(store)
    if found is not None:
        return found
    verdict = await _probe(store, near, stats)
    with _lock:
        _verdicts[store] = verdict
    return verdict


async def _probe(store: ObjectStore, near: str, stats: Optional[IOStats]) -> ConditionalWriteCheck:
    """Create ``<near>/_objckpt_probe/probe-<random>`` twice with ``if_absent``; then delete it."""
    key = keys.join(near.strip("/"), PROBE_DIR, f"probe-{secrets.token_hex(8)}")
    counted = stats if stats is not None else IOStats()
    await store.put(key, b"objckpt conditional-write probe", if_absent=True)
    counted.add(0)
    try:
        await store.put(key, b"objckpt conditional-write probe, second create", if_absent=True)
    except PreconditionFailed:
        return ConditionalWriteCheck(True)
    finally:
        counted.add(0)
        try:
            await store.delete([key])
            counted.add(0)
        except Exception:  # noqa: BLE001 - a stray probe object is harmless (gc removes it)
            pass
    return ConditionalWriteCheck(False, f"{store.describe()} accepted a second create-only write "
                                        f"(If-None-Match: *) of {key!r}: it ignores the condition")


@dataclass(frozen=True)
class BeforeSave:
    """What rank 0 of a save that may not replace a checkpoint asks the store first."""

    #: a checkpoint is committed there (its manifest exists)
    exists: bool
    #: whether the store honours the create-only commit; None: not asked (a checkpoint is there)
    check: Optional[ConditionalWriteCheck]


async def ask_before_save(store: ObjectStore, prefix: str, stats: IOStats) -> BeforeSave:
    """A HEAD of the manifest at ``prefix``, then, when there is none, the store's verdict
    (:func:`conditional_writes`, probed beside the checkpoint): a save refused because a
    checkpoint exists writes nothing, not even a probe.  Requests are added to ``stats``."""
    found = await store.head(keys.manifest_key(prefix))
    stats.add(0)
    if found is not None:
        return BeforeSave(True, None)
    return BeforeSave(False, await conditional_writes(store, prefix, stats))


async def overwrite_check(store: ObjectStore, prefix: str, stats: IOStats) -> BeforeSave:
    """What rank 0 of a multi-rank overwrite asks: only the store's verdict, which says
    whether the save's decision record can be trusted (:mod:`objckpt.save.decision`).  An
    overwrite is never refused for it; a probe that fails counts as "not honoured" (a
    survivor of a lost rank then deletes nothing)."""
    try:
        return BeforeSave(False, await conditional_writes(store, prefix, stats))
    except Exception as e:  # noqa: BLE001 - an unknown verdict: trust nothing, refuse nothing
        return BeforeSave(False, ConditionalWriteCheck(False, f"the conditional-write probe failed: {e}"))


def save_refusal(store: ObjectStore, check: Optional[ConditionalWriteCheck], uri: str, single_writer: bool) -> str:
    """Rank 0's word on saving to ``uri``: "" to go on, else why it is refused (the
    :class:`ConditionalWriteIgnoredError` message every rank raises).  ``single_writer``
    accepts a store that ignores the condition, said once per store in the log."""
    if check is None or check.honoured:
        return ""
    if single_writer:
        with _lock:
            first = store not in _accepted
            _accepted.add(store)
        if first:
            log.warning("objckpt: %s; saving anyway (single_writer=True, first at %r): objckpt relies on one "
                        "writer per root there, as two writers could both be told they committed", check.detail, uri)
        return ""
    return (f"save to {uri!r} refused, nothing written: {check.detail}.  Two writers of one checkpoint (two jobs, "
            "or a restarted job beside the old one) could then both be told they committed, one of them "
            "silently replaced.  Pass single_writer=True (objckpt.save / async_save, or "
            "CheckpointManager(..., single_writer=True)) if you guarantee one writer per root, or use a store "
            "that honours If-None-Match (docs/reliability.md, 'What objckpt requires of a store').")


def refuse_if(message: str) -> None:
    """Raise the refusal rank 0 shared (every rank alike); nothing when ``message`` is empty."""
    if message:
        raise ConditionalWriteIgnoredError(message)
