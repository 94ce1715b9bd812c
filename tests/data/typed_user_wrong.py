"""Calls that must FAIL ``mypy --strict`` (tests/test_typing.py checks each line is reported)."""
from __future__ import annotations

import objckpt

objckpt.save({}, 123)  # E1: uri is a str
objckpt.load({}, "s3://b/ck", read_strategy="fastest")  # E2: not a read strategy
objckpt.save({}, "s3://b/ck", overwrite="yes")  # E3: overwrite is a bool
n: str = objckpt.save({}, "s3://b/ck").bytes  # E4: bytes is an int
objckpt.read("s3://b/ck", keys=[1, 2])  # E5: keys are str
objckpt.inspect("s3://b/ck", chunk=False)  # E6: no such keyword
h: objckpt.LoadResult = objckpt.async_save({}, "s3://b/ck")  # E7: a SaveHandle
