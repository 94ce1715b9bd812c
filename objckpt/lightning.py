"""``objckpt.lightning``: the PyTorch Lightning integration (needs the ``[lightning]`` extra).

    from objckpt.lightning import ObjckptCheckpointIO
    trainer = Trainer(plugins=[ObjckptCheckpointIO()], default_root_dir="s3://bucket/run")

See :mod:`objckpt.integrations.lightning` and docs/integrations.md.
"""
from __future__ import annotations

from .integrations.lightning import ModelCheckpoint, ObjckptCheckpointIO, apply_map_location

__all__ = ["ObjckptCheckpointIO", "ModelCheckpoint", "apply_map_location"]
