"""Filesystem faults for tests: the campaign's (:mod:`testkit.campaign_disk`) real
tmpfs helpers, and its simulated refusals installed through pytest's monkeypatch."""
from __future__ import annotations

import os

import pytest

from testkit.campaign_disk import fill_up, mounted_tmpfs, refusing_calls, remount_read_only

__all__ = ["fill_up", "mounted_tmpfs", "remount_read_only", "refuse_writes_under"]


def refuse_writes_under(monkeypatch: pytest.MonkeyPatch, root: str, code: int, only: str = "") -> None:
    """Every ``os`` call that would change something under ``root`` fails with ``code``
    (``only``: just the data writes into files whose path contains it)."""
    for name, fn in refusing_calls(root, code, only).items():
        monkeypatch.setattr(os, name, fn)
