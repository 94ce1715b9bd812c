"""The commit protocol: the manifest written last, conditionally, by rank 0.

The manifest is the commit record: written last, by rank 0 only, after every
rank's blobs are up.  The conditional write makes two writers unable to both
commit; an error on the write is examined before anything is cleaned up,
because a PUT can land even when its reply is lost.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from .. import _runtime
from ..errors import CorruptCheckpointError, NotFoundError, PreconditionFailed
from ..format import keys
from ..format.manifest import Manifest, decode, encode
from ..results import IOStats
from ..storage import ObjectStore


class CommitState(str, enum.Enum):
    OK = "ok"
    #: another writer committed first; this attempt's objects are deleted
    EXISTS = "exists"
    #: the manifest write failed and certainly did not land; this attempt's objects are deleted
    FAILED_CLEAN = "failed-clean"
    #: the manifest write failed and whether it landed is unknown; nothing is deleted (gc decides later)
    FAILED = "failed"


@dataclass(frozen=True)
class CommitStatus:
    """Rank 0's commit outcome, shared with every rank."""

    state: CommitState
    message: str = ""
    manifest_bytes: int = 0


def commit(st: ObjectStore, prefix: str, m: Manifest, overwrite: bool, uri: str,
           written: list[str], stats: IOStats, errors: list[BaseException]) -> CommitStatus:
    """Write the manifest (rank 0); ``written``: every object of this attempt
    rank 0 wrote.  The exception behind a failure is appended to ``errors``."""
    data = encode(m)
    mkey = keys.manifest_key(prefix)

    async def go() -> CommitStatus:
        old: Optional[Manifest] = None
        if overwrite:
            try:
                old = decode(await st.get(mkey), mkey)
            except Exception:
                old = None  # absent or unreadable: nothing of it to clean up
        try:
            await st.put(mkey, data, if_absent=not overwrite)
        except BaseException as e:
            # The PUT may have landed even though we saw an error (a lost reply,
            # then a retry answered 412): look before deleting anything.
            committed = await _committed_attempt(st, mkey)
            if committed != m.attempt:
                errors.append(e)
                if committed != "?":  # ours is certainly not referenced
                    await _delete_async(st, written)
                if isinstance(e, PreconditionFailed):
                    return CommitStatus(CommitState.EXISTS, f"another writer committed a checkpoint at {uri!r} first")
                state = CommitState.FAILED_CLEAN if committed != "?" else CommitState.FAILED
                return CommitStatus(state, f"committing {uri!r} failed: {type(e).__name__}: {e}")
        stats.add(len(data))
        if old is not None and old.attempt != m.attempt:  # the replaced checkpoint's blobs are garbage now
            await _delete_async(st, replaced_keys(prefix, old, m))
        return CommitStatus(CommitState.OK, "", len(data))

    return _runtime.run(go())


def replaced_keys(prefix: str, old: Manifest, new: Manifest) -> list[str]:
    """The keys of the objects of ``old`` (the replaced manifest) that ``new`` does not
    use and that are safe to delete: default-layout names as :func:`replaced_objects`
    says, spread ones only where they place inside this checkpoint's spread namespace
    (``spread/<old attempt>/<file>`` in a hex bucket; :meth:`Manifest.object_key`)."""
    live = set(new.object_keys(prefix))
    entries = [(b.name, b.spread) for b in old.blobs] + [(r.name, r.spread) for r in old.rank_indexes]
    plain = [n for n, s in entries if not s and keys.join(prefix, n) not in live]
    out = replaced_objects(prefix, old.attempt, plain)
    for name, spread in entries:
        if not spread:
            continue
        try:
            key = old.object_key(prefix, name, spread)
        except CorruptCheckpointError:
            continue  # not this checkpoint's: left alone (gc judges what is left)
        if key not in live:
            out.append(key)
    return out


def replaced_objects(prefix: str, attempt: str, names: list[str]) -> list[str]:
    """The keys of ``names`` (a replaced manifest's blobs) that are safe to delete.

    Only names of the form ``blobs/<attempt>/<file>`` of the replaced attempt
    qualify: a damaged or hostile old manifest that lists ``manifest.json``,
    ``../other/x`` or another attempt's blob must not make a successful
    overwrite delete the new commit record or anything outside the old
    attempt's directory (what is skipped is left for gc)."""
    if not _plain_segment(attempt):
        return []
    out = []
    for n in names:
        parts = n.split("/")
        if (len(parts) == 3 and parts[0] == keys.BLOB_DIR and parts[1] == attempt and _plain_segment(parts[2])
                and not parts[2].startswith(keys.MANIFEST_NAME)):
            out.append(keys.join(prefix, n))
    return out


def _plain_segment(name: str) -> bool:
    """One ordinary path component: not empty, not ``.``/``..``, no separators or NUL."""
    return name not in ("", ".", "..") and not any(ch in name for ch in "/\\\0")


async def _committed_attempt(store: ObjectStore, mkey: str) -> Optional[str]:
    """The attempt id of the manifest now at ``mkey``; None if absent, "?" if unknown."""
    try:
        return decode(await store.get(mkey), mkey).attempt
    except NotFoundError:
        return None
    except Exception:
        return "?"


async def _delete_async(store: ObjectStore, names: list[str]) -> None:
    try:
        await store.delete(names)
    except Exception:
        pass  # unreferenced: gc sweeps them


def delete_quietly(store: ObjectStore, names: list[str]) -> None:
    """Delete objects of an attempt that will not commit; what fails is left for gc."""
    if names:
        _runtime.run(_delete_async(store, names))


