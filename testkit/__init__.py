"""The project's test kit: an in-memory S3 server, the fault campaign, the counting proxy and the reshard meter.

It lives beside ``tests/`` and ``benchmarks/`` and is not installed: nothing in the
``objckpt`` package starts a server or kills a process.  The public test doubles an
installed user may want stay in :mod:`objckpt.testing.stores`.  Importing this package
imports nothing (``python -m testkit.s3server`` must not pull torch in).
"""
