"""Deleting one committed checkpoint: its marker, its manifest, then the objects it names.

What a checkpoint owns is defined once, in :mod:`objckpt.ops.owned` (manifest, blobs, rank
indexes, the Lightning marker at its own key), and deleted in that module's order.  The
manifest is the commit, so removing it makes the checkpoint stop existing in one step: a
reader either finds the whole checkpoint or none of it, never a manifest whose blobs are
half gone.  A Lightning marker goes before it, so Lightning never sees a checkpoint that
cannot load.  Only the objects that manifest names (its blobs and, in format v2, its rank
index objects; in v4 these may be spread under hashed prefixes outside the checkpoint's
prefix, and are deleted only where they lie in this checkpoint's own spread namespace)
are deleted afterwards; anything else under the prefix (a save in progress to the same
URI, leftovers of a killed save) is left to :func:`objckpt.ops.gc.collect_garbage`, which
judges age.  A delete interrupted after the manifest went leaves only unreferenced
objects, which ``gc`` removes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import CorruptCheckpointError
from ..format import keys
from ..format.manifest import decode
from ..load.session import manifest_bytes
from ..storage import ObjectStore
from .owned import checkpoint_objects


@dataclass
class DeleteReport:
    """What :func:`delete_checkpoint` removed."""

    manifest: str
    deleted: list[str] = field(default_factory=list)  # object keys deleted after the manifest
    #: True when the manifest could not be decoded: it was deleted, its objects are left for ``gc``
    manifest_unreadable: bool = False
    #: the Lightning marker at the checkpoint's own key, deleted before the manifest (None: there was none)
    marker: Optional[str] = None


async def delete_checkpoint(store: ObjectStore, prefix: str, uri: str = "") -> DeleteReport:
    """Delete the checkpoint at ``prefix``; :class:`NotFoundError` when none is committed there."""
    mkey = keys.manifest_key(prefix)
    raw = await manifest_bytes(store, prefix, uri or prefix)
    report = DeleteReport(manifest=mkey)
    try:
        # decode checked every name; the owned objects refuse a spread entry that would
        # place outside this checkpoint's namespace (then nothing but marker and manifest go)
        owned = await checkpoint_objects(store, prefix, decode(raw, mkey))
    except CorruptCheckpointError:
        report.manifest_unreadable = True
        owned = await checkpoint_objects(store, prefix, None)
    if owned.marker is not None:  # first: Lightning must never see a checkpoint that cannot load
        await store.delete([owned.marker])
        report.marker = owned.marker
    await store.delete([owned.manifest])
    if owned.named:  # the decision record goes with them, in the same request (not reported)
        await store.delete(owned.after_manifest)
    report.deleted = owned.named
    return report
