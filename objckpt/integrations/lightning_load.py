"""``load_from_checkpoint`` for objckpt checkpoints: build a LightningModule (or DataModule) and load it.

``MyModule.load_from_checkpoint(path)`` reads the path with ``torch.load``, which cannot
read an objckpt checkpoint (a prefix of blobs and a JSON manifest).  This is the same call
with objckpt's reader::

    from objckpt.lightning import load_from_checkpoint
    model = load_from_checkpoint(MyModule, "s3://bucket/run/checkpoints/last.ckpt")

It does what Lightning's ``load_from_checkpoint`` does after reading: migrate an old
checkpoint, apply ``hparams_file`` and keyword overrides to the saved hyper-parameters,
build the class from them, run its ``on_load_checkpoint`` and load its state dict
(``strict``), then move the module to the device the tensors were mapped to.  Lightning's
own steps are reused (``lightning.pytorch.core.saving``), so the result is the module
``load_from_checkpoint`` would have built from a ``torch.save`` checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import torch

from .lightning import MapLocation, ObjckptCheckpointIO

T = TypeVar("T")


def _hparams_from_file(path: Union[str, Path]) -> Any:
    from lightning.pytorch.core.saving import load_hparams_from_tags_csv, load_hparams_from_yaml

    ext = str(path).rsplit(".", 1)[-1].lower()
    if ext == "csv":
        return load_hparams_from_tags_csv(path)
    if ext in ("yml", "yaml"):
        return load_hparams_from_yaml(path)
    raise ValueError(f"hparams_file must be a .csv, .yml or .yaml file, got {str(path)!r}")


def load_from_checkpoint(cls: type[T], checkpoint_path: Union[str, Path], map_location: MapLocation = None,
                         hparams_file: Optional[Union[str, Path]] = None, strict: Optional[bool] = None, *,
                         storage_options: Optional[dict[str, Any]] = None, allow_pickle: bool = False,
                         weights_only: Optional[bool] = None, **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a checkpoint written by
    :class:`ObjckptCheckpointIO`: the module (or DataModule) built from the saved
    hyper-parameters (overridden by ``hparams_file`` and ``kwargs``), its state loaded.

    ``map_location`` as for ``torch.load`` (tensors are read to CPU first);
    ``storage_options``, ``allow_pickle``: as for :class:`ObjckptCheckpointIO`.  A missing
    checkpoint raises :class:`objckpt.NotFoundError` naming it."""
    import lightning.pytorch as pl
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    path = str(checkpoint_path)
    checkpoint = ObjckptCheckpointIO(storage_options, allow_pickle=allow_pickle).load_checkpoint(
        path, map_location=map_location, weights_only=weights_only)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    key = getattr(cls, "CHECKPOINT_HYPER_PARAMS_KEY", "hyper_parameters")
    if hparams_file is not None:
        checkpoint[key] = _hparams_from_file(hparams_file)
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)  # type: ignore[return-value]
    if not issubclass(cls, pl.LightningModule):
        raise TypeError(f"load_from_checkpoint builds a LightningModule or LightningDataModule, not {cls!r}")
    model: Any = _load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model.to(device) if device is not None else model  # type: ignore[no-any-return]
