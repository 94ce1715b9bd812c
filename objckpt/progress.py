"""A small progress bar for the commands that move data (verify, cp, bench).

Written to stderr so that a command's output (stdout) stays clean for pipes;
shown only when both stdout and stderr are terminals (a command piped into
another tool, or run by a job scheduler, prints no control characters) and
not turned off (``--no-progress``).  No dependency: one line redrawn with
``\\r`` at most ten times a second.  Updates may come from any thread (the
I/O loop reports bytes as they land).
"""
from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Optional, TextIO


def wanted(disabled: bool = False, stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None) -> bool:
    """Whether a bar should be drawn: not ``disabled`` and both streams are terminals."""
    if disabled:
        return False
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        return bool(out.isatty() and err.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """``with Progress(total, "copy", enabled=...) as bar: bar.update(n)``.

    ``total`` in ``unit`` ("B" formats as bytes; anything else as a count).
    Disabled, every call is a no-op, so callers need not branch."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, unit: str = "B",
                 stream: Optional[TextIO] = None, width: int = 30, interval: float = 0.1) -> None:
        self.total, self.label, self.enabled, self.unit = max(total, 0), label, enabled, unit
        self.stream = stream if stream is not None else sys.stderr
        self.width, self.interval = width, interval
        self.done = 0
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._lock = threading.Lock()
        self._drawn = False

    def update(self, n: int, total: Optional[int] = None) -> None:
        """``n`` more units done; ``total`` (when given) replaces the total (learnt late)."""
        if not self.enabled:
            return
        with self._lock:
            if total is not None:
                self.total = max(total, 0)
            self.done += n
            now = time.perf_counter()
            if now - self._last_draw >= self.interval or self.done >= self.total:
                self._last_draw = now
                self._draw(now)

    def _fmt(self, n: float) -> str:
        return _size(n) if self.unit == "B" else f"{n:.0f}"

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        rate = self.done / max(now - self._t0, 1e-9)
        speed = f"{_size(rate)}/s" if self.unit == "B" else f"{rate:.1f}/s"
        line = f"\r{self.label} [{bar}] {frac * 100:5.1f}% {self._fmt(self.done)}/{self._fmt(self.total)} {speed}"
        try:
            self.stream.write(line)
            self.stream.flush()
            self._drawn = True
        except (OSError, ValueError):
            self.enabled = False

    def close(self) -> None:
        """Finish the line (only if something was drawn)."""
        if self.enabled and self._drawn:
            with self._lock:
                self._draw(time.perf_counter())
                try:
                    self.stream.write("\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
        self.enabled = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et: Optional[type], e: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()
