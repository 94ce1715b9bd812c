"""Who settles a multi-rank save when a rank dies inside the commit window.

Rank 0 writes the manifest (the commit) after every rank has reported its blobs
up, then tells every rank the outcome.  When a rank dies in between, the
survivors' collective fails and they no longer learn the outcome from it.
Deleting their blobs is then safe only if rank 0 will never commit this attempt,
and reading the manifest back cannot prove that: rank 0 may still be alive and
about to PUT it.  Keeping every blob is safe but leaves garbage on every
failure.

One conditional create settles it, the **decision record**
``blobs/<attempt>/decision.json`` (:func:`decision_key`):

* rank 0 creates it saying ``commit`` immediately before its manifest PUT, and
  PUTs only when its create won;
* a survivor that could not learn the outcome first reads the manifest: this
  attempt's -> committed, keep everything.  Otherwise it creates the record
  saying ``abort`` and deletes its own objects only when the record then says
  ``abort``.

On a store that honours ``If-None-Match: *`` exactly one create wins, so either
the manifest PUT happens or the deletes do, never both.  A record that says
``commit`` without a manifest (rank 0 died between the two PUTs, or its PUT is
still in flight) leaves the survivor's objects in place: whether the manifest
will appear is unknown, and ``objckpt gc`` deletes them later only if no
manifest names them.  Single-rank saves need no record (no one else decides).

The record is deleted by rank 0 once every rank has learned the outcome; one
left behind by a failure is an ordinary leftover of its attempt for ``gc``.
"""
from __future__ import annotations

import asyncio
import enum
import json
import secrets
from dataclasses import dataclass
from typing import Optional

from ..errors import NotFoundError, PreconditionFailed
from ..format import keys
from ..format.manifest import decode
from ..storage import ObjectStore

#: how long a survivor that finds a ``commit`` record keeps looking for the manifest
#: (seconds between looks): rank 0 PUTs it right after creating the record, so when
#: rank 0 is alive the manifest is normally there by the second look
MANIFEST_LOOKS = (0.0, 0.1, 0.3, 1.0, 2.0)


class Decision(str, enum.Enum):
    COMMIT = "commit"
    ABORT = "abort"
    #: the record could not be written or read: nothing is known
    UNKNOWN = "unknown"


class Fate(str, enum.Enum):
    """What a survivor learned about an attempt it could not hear the outcome of."""

    COMMITTED = "committed"
    NOT_COMMITTED = "not committed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Learned:
    fate: Fate
    #: how it was learned, for the error message
    how: str


def decision_key(prefix: str, attempt: str) -> str:
    return keys.join(prefix, keys.decision_name(attempt))


async def claim(st: ObjectStore, key: str, decision: Decision, rank: int) -> Decision:
    """Create the record at ``key`` saying ``decision``; returns the decision that holds.

    A create that reports success holds.  A refused one (412: the record exists), or
    one that failed otherwise (its reply may have been lost after it landed), is
    settled by reading the record: what it says holds, and a record still absent
    after a failed create is :attr:`Decision.UNKNOWN` to the caller (rank 0 then does
    not commit; a survivor does not delete)."""
    body = json.dumps({"decision": decision.value, "rank": rank, "nonce": secrets.token_hex(8)}).encode()
    try:
        await st.put(key, body, if_absent=True)
        return decision
    except PreconditionFailed:
        pass
    except Exception:  # noqa: BLE001 - settled by reading the record below
        pass
    return await read_decision(st, key)


async def read_decision(st: ObjectStore, key: str) -> Decision:
    try:
        value = json.loads(bytes(await st.get(key)))["decision"]
        return Decision(value) if value in (Decision.COMMIT.value, Decision.ABORT.value) else Decision.UNKNOWN
    except Exception:  # noqa: BLE001 - absent, unreadable or foreign: nothing is known
        return Decision.UNKNOWN


async def _manifest_attempt(st: ObjectStore, prefix: str) -> Optional[str]:
    """The attempt id of the manifest at ``prefix``; None when absent or unreadable."""
    mkey = keys.manifest_key(prefix)
    try:
        return decode(await st.get(mkey), mkey).attempt
    except NotFoundError:
        return None
    except Exception:  # noqa: BLE001 - unreadable: not known to be ours
        return None


async def learn_fate(st: ObjectStore, prefix: str, attempt: str, rank: int,
                     looks: tuple[float, ...] = MANIFEST_LOOKS, *, trusted: bool = True) -> Learned:
    """A survivor's view of ``attempt`` (see the module docstring).  ``trusted``: the
    store honours create-only writes; on one that does not, the record cannot settle
    anything, and what the manifest does not show is unknown."""
    if await _manifest_attempt(st, prefix) == attempt:
        return Learned(Fate.COMMITTED, "the manifest at the URI is this save's")
    if not trusted:
        return Learned(Fate.UNKNOWN, "the manifest is not this save's yet, and the store ignores create-only "
                                     "writes, so the decision record cannot settle it")
    decided = await claim(st, decision_key(prefix, attempt), Decision.ABORT, rank)
    if decided == Decision.ABORT:
        return Learned(Fate.NOT_COMMITTED, "the save was aborted by its decision record before rank 0 committed")
    for delay in looks:  # rank 0 decided to commit: its manifest PUT follows the record
        if delay:
            await asyncio.sleep(delay)
        if await _manifest_attempt(st, prefix) == attempt:
            return Learned(Fate.COMMITTED, "rank 0 committed the manifest")
    why = ("rank 0 decided to commit but its manifest has not appeared" if decided == Decision.COMMIT
           else "the decision record could not be written or read")
    return Learned(Fate.UNKNOWN, why)
