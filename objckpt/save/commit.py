"""The commit protocol: the manifest written last, conditionally, by rank 0.

The manifest is the commit record: written last, by rank 0 only, after every
rank's blobs are up.  The conditional write makes two writers unable to both
commit; an error on the write is examined before anything is cleaned up,
because a PUT can land even when its reply is lost.

A conditional create that reports success is confirmed with one GET: the
manifest now at the key must be this attempt's.  Some S3-compatible stores
accept ``If-None-Match: *`` and ignore it; there a second writer's PUT replaces
ours and both would be told "committed".  The GET turns that into
:class:`CommitReplacedError` for the writer whose manifest was replaced
(its blobs are deleted; the stored checkpoint is the other writer's).  It cannot
catch every interleaving on such a store (a replacement landing after our GET),
which is why a save refuses such a store before writing anything unless told
``single_writer=True`` (:mod:`.store_check`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from ..runtime import loop as _runtime
from ..errors import (CommitReplacedError, CorruptCheckpointError, NotFoundError, PreconditionFailed,
                      StorageError, error_name)
from ..distributed.comm import RankError
from ..format import keys
from ..format.manifest import Manifest, decode, encode
from ..logs import get_logger
from ..results import IOStats
from ..storage import ObjectStore
from .decision import Decision, claim, decision_key

log = get_logger("objckpt.save")


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
    #: the failure as it crosses ranks (its class's registered name: every rank raises that class)
    error: Optional[RankError] = None

    @property
    def error_kind(self) -> str:
        return self.error.kind if self.error is not None else ""


async def commit_async(st: ObjectStore, prefix: str, m: Manifest, overwrite: bool, uri: str,
                       written: list[str], stats: IOStats, errors: list[BaseException], *,
                       decided_by_record: bool = False, data: Optional[bytes] = None) -> CommitStatus:
    """Write the manifest (rank 0); ``written``: every object of this attempt
    rank 0 wrote.  The exception behind a failure is appended to ``errors``.

    ``data``: the manifest's exact bytes when they exist already (a drain commits the
    local tier's manifest byte for byte, its own crc32c still sealing it); default
    ``m`` encoded.  A manifest of the same attempt found at the key (an earlier try of
    this commit landed, its answer lost) is this commit: OK.

    ``decided_by_record`` (saves of more than one rank): the manifest is PUT only
    after rank 0 has won the attempt's decision record (:mod:`.decision`), so that a
    rank that loses contact during the commit can tell, from storage, whether it
    may delete its blobs."""
    data = encode(m) if data is None else data
    mkey = keys.manifest_key(prefix)
    old: Optional[Manifest] = None
    if overwrite:
        try:
            old = decode(await st.get(mkey), mkey)
        except Exception:
            old = None  # absent or unreadable: nothing of it to clean up
    if decided_by_record:
        decided = await claim(st, decision_key(prefix, m.attempt), Decision.COMMIT, 0)
        if decided != Decision.COMMIT:  # a rank that lost contact aborted it, or nothing is known:
            await _delete_async(st, written)  # rank 0 will not PUT, so nothing can name these
            why = ("a rank that lost contact with the others aborted it first" if decided == Decision.ABORT
                   else "its decision record could not be written")
            return CommitStatus(CommitState.FAILED_CLEAN, f"committing {uri!r} did not happen: {why}")
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
            return CommitStatus(state, f"committing {uri!r} failed: {type(e).__name__}: {e}",
                                error=RankError.of(e, f"committing {uri!r} failed: "))
    else:
        if not overwrite:
            unseen = await _confirm_ours(st, mkey, m.attempt, uri, written, data)
            stats.add(0)  # the GET that confirmed it
            if unseen is not None:
                errors.append(unseen)
                return CommitStatus(CommitState.FAILED, str(unseen), error=RankError(error_name(unseen), str(unseen)))
    stats.add(len(data))
    if old is not None and old.attempt != m.attempt:  # the replaced checkpoint's blobs are garbage now
        doomed = replaced_keys(prefix, old, m)
        if keys.plain_segment(old.attempt):  # and its decision record, if one was left behind
            doomed.append(decision_key(prefix, old.attempt))
        await _delete_async(st, doomed)
    return CommitStatus(CommitState.OK, "", len(data))


def commit(st: ObjectStore, prefix: str, m: Manifest, overwrite: bool, uri: str,
           written: list[str], stats: IOStats, errors: list[BaseException], *,
           decided_by_record: bool = False, data: Optional[bytes] = None) -> CommitStatus:
    """:func:`commit_async` from a thread off the I/O loop: the one conditional manifest
    write of a save, a drain, a copy and a node folder's metadata."""
    return _runtime.run(commit_async(st, prefix, m, overwrite, uri, written, stats, errors,
                                     decided_by_record=decided_by_record, data=data))


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
    if not keys.plain_segment(attempt):
        return []
    out = []
    for n in names:
        parts = n.split("/")
        if (len(parts) == 3 and parts[0] == keys.BLOB_DIR and parts[1] == attempt and keys.plain_segment(parts[2])
                and not parts[2].startswith(keys.MANIFEST_NAME)):
            out.append(keys.join(prefix, n))
    return out


async def _committed_attempt(store: ObjectStore, mkey: str) -> Optional[str]:
    """The attempt id of the manifest now at ``mkey``; None if absent, "?" if unknown."""
    try:
        return decode(await store.get(mkey), mkey).attempt
    except NotFoundError:
        return None
    except Exception:
        return "?"


async def _confirm_ours(st: ObjectStore, mkey: str, attempt: str, uri: str,
                        written: list[str], data: bytes = b"") -> Optional[BaseException]:
    """After a conditional create reported success: check that the manifest at ``mkey`` is
    ``attempt``'s.  Another attempt's there: the store ignored ``If-None-Match`` (this
    attempt's objects are deleted, :class:`CommitReplacedError` raised).  None
    there: the store does not read back what it just acknowledged; the error is returned
    (nothing is deleted: the manifest may still appear).  A GET that fails outright
    cannot tell, and the store did acknowledge the create: a warning, and the commit stands.
    The bytes read back being ``data`` (what this attempt wrote) is proof enough: only
    other bytes are decoded to learn whose they are (a large manifest takes ~0.1 s)."""
    try:
        got = await st.get(mkey)
        if data and bytes(got) == data:
            return None
        found: Optional[str] = decode(got, mkey).attempt
    except NotFoundError:
        return StorageError(
            f"committing {uri!r}: {st.describe()} acknowledged the manifest {mkey!r} but a GET right after "
            "does not find it: objckpt needs read-after-write consistency from a store (docs/reliability.md, "
            "'What objckpt requires of a store'); this save's objects are left for gc")
    except CorruptCheckpointError:
        found = "?"  # a damaged or foreign document: not ours
    except Exception as e:  # noqa: BLE001 - the create was acknowledged; do not fail a committed save
        log.warning("objckpt: committed %s, but could not read its manifest back to confirm it (%s: %s)",
                    uri, type(e).__name__, e)
        return None
    if found == attempt:
        return None
    await _delete_async(st, written)
    raise CommitReplacedError(
        f"committing {uri!r}: {st.describe()} reported the create-only write (If-None-Match: *) of {mkey!r} as "
        f"successful, but the manifest there now belongs to save attempt {found!r}, not this one ({attempt!r}): "
        "the store does not honour conditional writes, so two writers of one checkpoint can both be told they "
        "committed.  This save did NOT commit (the stored checkpoint is the other writer's).  Use a store that "
        "honours If-None-Match (docs/reliability.md, 'What objckpt requires of a store').")


async def _delete_async(store: ObjectStore, names: list[str]) -> None:
    try:
        await store.delete(names)
    except Exception:
        pass  # unreferenced: gc sweeps them


def delete_quietly(store: ObjectStore, names: list[str]) -> None:
    """Delete objects of an attempt that will not commit; what fails is left for gc."""
    if names:
        _runtime.run(_delete_async(store, names))


