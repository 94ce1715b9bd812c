"""The marker object at a checkpoint's own key: what it is, and recognising one without unpickling.

On object stores the Lightning plugin (:mod:`objckpt.integrations.lightning`) writes, after
the manifest of the checkpoint at prefix ``<key>/`` commits, a small object at ``<key>``
itself, so that fsspec's ``exists`` / ``isfile`` / ``modified`` see a ``.ckpt`` file.  That
object belongs to the checkpoint: whatever deletes the checkpoint (``objckpt.delete``,
``objckpt rm``, ``prune``, the manager's retention) deletes it first, and ``gc`` removes one
whose checkpoint is gone.  Those live below the integrations, so the marker's record is
defined here, in one place, and the plugin writes what this module reads.

A marker is a ``torch.save`` file (a zip archive holding ``<name>/data.pkl``) whose pickle
is one call, ``objckpt.lightning.<CALL_NAME>({"objckpt": KIND, "format": 1, "manifest":
"<key>/manifest.json"})``; earlier markers were that dict as JSON.  :func:`read_marker`
reads either with a restricted unpickler that knows that one call and nothing else, so
inspecting an object found at a checkpoint's key never runs code from the store.
"""
from __future__ import annotations

import io
import json
import pickle
import zipfile
from typing import Any, Optional

#: what a marker says it is (its ``objckpt`` field)
KIND = "lightning-checkpoint"
#: the module the marker's pickle names: the public one, importable wherever Lightning is
CALL_MODULE = "objckpt.lightning"
#: the function the marker's pickle calls (raises with advice when ``torch.load`` runs it)
CALL_NAME = "objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint"
#: a marker is a few hundred bytes; an object at a checkpoint's key larger than this is not one
#: (and is never read to find out)
MAX_MARKER_BYTES = 64 * 1024


def marker_key(prefix: str) -> str:
    """The key of the marker of the checkpoint at ``prefix``: the prefix itself, as an object
    ("" for a checkpoint at a bucket's root, which has no marker)."""
    return prefix.strip("/")


def marker_fields(manifest_key: str, fmt: int) -> dict[str, Any]:
    """The fields a marker carries (the argument of its call)."""
    return {"objckpt": KIND, "format": fmt, "manifest": manifest_key}


class _Fields:
    """What the restricted unpickler builds for the marker's call: its argument."""

    def __init__(self, info: Any = None) -> None:
        self.info = info


class _MarkerUnpickler(pickle.Unpickler):
    """Knows the marker's one global; refuses every other global and persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        if module == CALL_MODULE and name == CALL_NAME:
            return _Fields
        raise pickle.UnpicklingError(f"not a marker: names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("not a marker: holds tensor storage")


def _pickle_of(body: bytes) -> Optional[bytes]:
    """The ``data.pkl`` of a ``torch.save`` zip archive, else None."""
    try:
        with zipfile.ZipFile(io.BytesIO(body)) as z:
            names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if len(names) != 1 or z.getinfo(names[0]).file_size > MAX_MARKER_BYTES:
                return None
            return z.read(names[0])
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError, NotImplementedError):
        return None


def read_marker(body: bytes) -> Optional[dict[str, Any]]:
    """The fields of the marker ``body``, or None when it is not a marker."""
    if len(body) > MAX_MARKER_BYTES:
        return None
    info: Any = None
    if body[:1] == b"{":  # the JSON form of earlier releases
        try:
            info = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
    else:
        raw = _pickle_of(body)
        if raw is None:
            return None
        try:
            obj = _MarkerUnpickler(io.BytesIO(raw)).load()
        except Exception:  # anything a foreign or damaged pickle raises: not a marker
            return None
        info = obj.info if isinstance(obj, _Fields) else None
    if not isinstance(info, dict) or info.get("objckpt") != KIND:
        return None
    return info
