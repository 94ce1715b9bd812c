"""``objckpt.lightning``: the PyTorch Lightning integration (needs the ``[lightning]`` extra).

    from objckpt.lightning import ObjckptCheckpointIO, ObjckptPreemption, load_from_checkpoint
    trainer = Trainer(plugins=[ObjckptCheckpointIO()], callbacks=[ObjckptPreemption()],
                      default_root_dir="s3://bucket/run")
    model = load_from_checkpoint(MyModule, "s3://bucket/run/checkpoints/last.ckpt")

See :mod:`objckpt.integrations.lightning` and docs/integrations.md.
"""
from __future__ import annotations

from .integrations.lightning import ModelCheckpoint, ObjckptCheckpointIO, apply_map_location
from .integrations.lightning_load import load_from_checkpoint
from .integrations.lightning_preemption import ObjckptPreemption
from .integrations.lightning_marker import (
    NotATorchCheckpointError,
    objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint,
)

__all__ = ["ObjckptCheckpointIO", "ModelCheckpoint", "ObjckptPreemption", "apply_map_location", "load_from_checkpoint",
           "NotATorchCheckpointError", "objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint"]
