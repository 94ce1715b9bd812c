"""Counters the engines fill in and results report."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IOStats:
    requests: int = 0
    bytes: int = 0

    def add(self, nbytes: int, requests: int = 1) -> None:
        self.requests += requests
        self.bytes += nbytes
