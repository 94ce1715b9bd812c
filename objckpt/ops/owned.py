"""The objects one committed checkpoint owns: the one definition that deletes and ``gc`` share.

A checkpoint at ``<prefix>`` owns

* its manifest ``<prefix>/manifest.json`` (the commit);
* the blobs and rank index objects that manifest names (:func:`named_objects`; spread ones
  under hashed prefixes above the checkpoint too, only within its own spread namespace);
* the decision record of its attempt, which a failed multi-rank save may leave
  (``blobs/<attempt>/decision.json``, no part of the checkpoint's data);
* the Lightning marker at ``<prefix>`` itself, when the plugin wrote one
  (:mod:`objckpt.format.marker`): recognised by reading it, never by name alone, so an
  unrelated object a user keeps under the same name is left alone.

No integration writes other objects into a checkpoint: the Hugging Face Trainer and the
manager keep their state inside the checkpoint's tree, and a step's entry in its root's
step index belongs to the index (``objckpt rm`` and retention remove it first).

:class:`CheckpointObjects` lists them in the order a delete removes them, chosen for a
delete killed midway: the marker first, so Lightning (whose fsspec checks see only the
marker) never sees a checkpoint that can no longer load (a committed checkpoint without
its marker still loads, and objckpt still lists it); then the manifest, after which the
checkpoint does not exist; then the rest, which ``gc`` removes if the delete stops
before them.  ``gc`` keeps what :func:`named_objects` names and removes a marker only once
no manifest is there (:func:`orphaned_marker`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import NotFoundError
from ..format import keys
from ..format.manifest import Manifest
from ..format.marker import MAX_MARKER_BYTES, marker_key, read_marker
from ..storage import ObjectStore


@dataclass(frozen=True)
class CheckpointObjects:
    """Every object the checkpoint at ``prefix`` owns, in the order a delete removes them."""

    prefix: str
    #: the Lightning marker at the checkpoint's own key, when one is there (deleted first)
    marker: Optional[str]
    #: the commit (deleted second: from then on the checkpoint does not exist)
    manifest: str
    #: the blobs and rank index objects the manifest names (empty when it cannot be decoded)
    named: list[str]
    #: the attempt's decision record, which a failure may have left (not reported as deleted)
    strays: list[str]

    @property
    def after_manifest(self) -> list[str]:
        """What goes once the manifest is deleted."""
        return self.named + self.strays


def named_objects(m: Manifest, prefix: str) -> list[str]:
    """The keys of the objects manifest ``m`` of the checkpoint at ``prefix`` names: its blobs
    and rank indexes.  :class:`CorruptCheckpointError` when a spread entry would place one
    outside this checkpoint's namespace."""
    return sorted(set(m.object_keys(prefix)))


def _strays(m: Manifest, prefix: str) -> list[str]:
    return [keys.join(prefix, keys.decision_name(m.attempt))] if keys.plain_segment(m.attempt) else []


async def is_marker_at(store: ObjectStore, key: str, size: Optional[int] = None) -> bool:
    """Whether the object at ``key`` is a marker: one HEAD (none when a listing gave its
    ``size``), then a GET only for an object of a marker's size.  A missing object, or a
    folder where the store has folders, is not."""
    if not key:
        return False
    if size is None:
        info = await store.head(key)
        if info is None:
            return False
        size = info.size
    if not 0 < size <= MAX_MARKER_BYTES:
        return False
    try:
        body = await store.get(key)
    except (NotFoundError, IsADirectoryError):  # gone since, or a folder after all
        return False
    return read_marker(body) is not None


async def find_marker(store: ObjectStore, prefix: str) -> Optional[str]:
    """The key of the Lightning marker of the checkpoint at ``prefix``, when one is there."""
    key = marker_key(prefix)
    return key if await is_marker_at(store, key) else None


async def checkpoint_objects(store: ObjectStore, prefix: str, m: Optional[Manifest]) -> CheckpointObjects:
    """The objects the checkpoint at ``prefix`` owns; ``m`` its decoded manifest (None when it
    could not be decoded: then only the marker and the manifest are known)."""
    named = named_objects(m, prefix) if m is not None else []
    strays = _strays(m, prefix) if m is not None else []
    return CheckpointObjects(prefix, await find_marker(store, prefix), keys.manifest_key(prefix), named, strays)


async def orphaned_marker(store: ObjectStore, key: str, size: Optional[int] = None) -> bool:
    """Whether the object at ``key`` is a marker whose checkpoint is gone: a marker, and no
    manifest at ``<key>/manifest.json``, asked last (after the marker is read, just before a
    caller deletes it), so a checkpoint committed since a listing keeps its marker.  A save
    of that very path committing in the one round trip between this answer and the delete
    would lose its new marker: the checkpoint stays whole and loadable, only unseen by
    Lightning (the safe side), until it is saved again."""
    if not await is_marker_at(store, key, size):
        return False
    return await store.head(keys.manifest_key(key)) is None
