"""``objckpt.dcp``: the torch.distributed.checkpoint storage plugin.

``dcp.save(sd, storage_writer=objckpt.dcp.StorageWriter("s3://b/run/step-100"))``
writes an objckpt checkpoint; ``dcp.load(sd, storage_reader=objckpt.dcp.StorageReader(uri))``
reads one (whoever wrote it).  See :mod:`objckpt.integrations.dcp`.
"""
from .integrations.dcp import StorageReader, StorageWriter

__all__ = ["StorageWriter", "StorageReader"]
