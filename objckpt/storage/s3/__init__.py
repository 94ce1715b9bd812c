"""S3 (and S3-compatible) storage: one request pipeline.

``config`` resolves a store's settings once (the only reader of storage_options and
the environment for S3), ``send`` is the one loop every request goes through,
``transport`` says how bytes move (``direct``: objckpt's own sockets, signed by
``sigv4`` with what ``credentials`` hands it; or botocore's client), ``request`` reads S3's XML answers, ``answers``
what an answer says beyond its status, ``refusals`` which refusals are of the credentials (and their fix), ``writer`` writes one object from parts,
and ``store`` is the :class:`S3Store` the rest of objckpt opens.
"""
from .store import S3Store

__all__ = ["S3Store"]
