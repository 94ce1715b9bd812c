"""Deleting one committed checkpoint: the manifest first, then the objects it names.

The manifest is the commit, so removing it first makes the checkpoint stop
existing in one step: a reader either finds the whole checkpoint or none of
it, never a manifest whose blobs are half gone.  Only the objects that manifest
names (its blobs and, in format v2, its rank index objects; in v4 these may be
spread under hashed prefixes outside the checkpoint's prefix, and are deleted
only where they lie in this checkpoint's own spread namespace) are deleted
afterwards; anything else under the prefix (a save in progress to the same
URI, leftovers of a killed save) is left to :func:`objckpt.ops.gc.collect_garbage`,
which judges age.  A delete interrupted after the manifest went leaves only
unreferenced objects, which ``gc`` removes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CorruptCheckpointError
from ..format import keys
from ..format.manifest import decode
from ..load.session import manifest_bytes
from ..storage import ObjectStore


@dataclass
class DeleteReport:
    """What :func:`delete_checkpoint` removed."""

    manifest: str
    deleted: list[str] = field(default_factory=list)  # object keys deleted after the manifest
    #: True when the manifest could not be decoded: it was deleted, its objects are left for ``gc``
    manifest_unreadable: bool = False


async def delete_checkpoint(store: ObjectStore, prefix: str, uri: str = "") -> DeleteReport:
    """Delete the checkpoint at ``prefix``; :class:`NotFoundError` when none is committed there."""
    mkey = keys.manifest_key(prefix)
    raw = await manifest_bytes(store, prefix, uri or prefix)
    report = DeleteReport(manifest=mkey)
    try:
        m = decode(raw, mkey)
        # decode checked every name; object_keys refuses a spread entry that would
        # place outside this checkpoint's namespace (then nothing but the manifest goes)
        doomed = sorted(set(m.object_keys(prefix)))
        # a decision record a failure may have left (objckpt.save.decision): no part of the
        # checkpoint, so not reported, but gone with it in the same request
        stray = [keys.join(prefix, keys.decision_name(m.attempt))] if keys.plain_segment(m.attempt) else []
    except CorruptCheckpointError:
        doomed, stray, report.manifest_unreadable = [], [], True
    await store.delete([mkey])
    if doomed:
        await store.delete(doomed + stray)
    report.deleted = doomed
    return report
