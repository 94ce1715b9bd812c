"""Public test doubles for objckpt users (:mod:`objckpt.testing.stores`); save and load never use them.

The project's own test kit (the in-memory S3 server, the fault campaign, the counting
proxy, the reshard meter) lives in the checkout's ``testkit/`` and is not installed.
"""
