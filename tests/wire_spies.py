"""Spies on the direct S3 path's system calls, for tests that count what it did."""
from __future__ import annotations

from typing import Any

import pytest


def spy_splice(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte counts of every ``os.splice`` the wire makes from now on (the list grows)."""
    from objckpt.storage.s3 import wire

    spliced: list[int] = []
    real = wire.os.splice

    def spy(*a: Any, **k: Any) -> int:
        n = real(*a, **k)
        spliced.append(n)
        return n

    monkeypatch.setattr(wire.os, "splice", spy)
    return spliced
