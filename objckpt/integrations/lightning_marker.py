"""The marker object at a Lightning checkpoint's path, written so ``torch.load`` explains itself.

On object stores :class:`objckpt.lightning.ObjckptCheckpointIO` writes a small object at
the ``.ckpt`` path itself (the checkpoint is the prefix under it), so Lightning's fsspec
checks see a file.  Lightning's ``LightningModule.load_from_checkpoint`` and anything else
that calls ``torch.load`` on that path read the marker.  A JSON marker gave them torch's
unpickling error, whose advice (``weights_only=False``) only led to ``invalid load key,
'{'``.

So the marker is a ``torch.save`` file whose only content is a call to
:func:`objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint`:

* ``torch.load(weights_only=True)`` (torch's default) refuses the call, and its message
  names it: ``Unsupported global: GLOBAL objckpt.lightning.objckpt_checkpoint_load_it_with_
  objckpt_lightning_load_from_checkpoint``;
* ``torch.load(weights_only=False)`` makes the call, which raises
  :class:`NotATorchCheckpointError` saying what to call instead.

The marker still carries the JSON fields it had (``objckpt``, ``format``, ``manifest``),
as the call's argument.  Its record (kind, call, fields) is :mod:`objckpt.format.marker`,
which the deletes and ``gc`` read it with (they lie below the integrations).
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ..errors import ObjckptError
from ..format.marker import CALL_MODULE, marker_fields

#: the module the marker's pickle names: the public one, importable wherever Lightning is
PUBLIC_MODULE = CALL_MODULE

ADVICE = ("this path holds an objckpt checkpoint (written by objckpt.lightning.ObjckptCheckpointIO), not a "
          "torch.save file, so torch.load cannot read it. Load a module with "
          "objckpt.lightning.load_from_checkpoint(MyModule, path) instead of MyModule.load_from_checkpoint(path), "
          "resume with Trainer(plugins=[ObjckptCheckpointIO()]).fit(..., ckpt_path=path), or read it with "
          "objckpt.lightning.ObjckptCheckpointIO().load_checkpoint(path)")


class NotATorchCheckpointError(ObjckptError, pickle.UnpicklingError):
    """``torch.load`` was given an objckpt checkpoint's marker object."""


def objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint(info: Any = None) -> Any:
    """Called by ``torch.load(weights_only=False)`` reading a marker: raise what to do instead."""
    manifest = info.get("manifest") if isinstance(info, dict) else None
    where = f" (its manifest: {manifest!r})" if manifest else ""
    raise NotATorchCheckpointError(f"{ADVICE}{where}")


# pickled by this name, from the public module that re-exports it (the record format/marker.py reads)
objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint.__module__ = PUBLIC_MODULE


class _Marker:
    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info

    def __reduce__(self) -> Any:
        return (objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint, (self.info,))


def marker_body(manifest_key: str, fmt: int) -> bytes:
    """The marker object's bytes: a ``torch.save`` file that refuses to load, with advice."""
    buf = io.BytesIO()
    torch.save(_Marker(marker_fields(manifest_key, fmt)), buf)
    return buf.getvalue()
