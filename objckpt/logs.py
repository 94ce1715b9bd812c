"""How objckpt reports what it does: loggers, phase timings, the guard that keeps
credentials out of log lines, and the progress bar of the commands that move data.

Loggers form one hierarchy under ``"objckpt"`` (``objckpt.save``, ``objckpt.load``,
``objckpt.storage``, ``objckpt.copy``, ...).  The package logger carries a
do-nothing handler (a library never configures logging; the application does),
so nothing is printed until the application sets up logging, e.g.
``logging.basicConfig(level=logging.INFO)``.

INFO: one line per save, load, read and copy, with the seconds of each phase.
WARNING: retries and throttling of storage requests.

Why a redaction guard: storage errors and retries are logged with the
exception text, which comes from botocore, aiohttp or a user's fsspec backend;
a credential must never reach a log file through one of them.  Every record
logged on an objckpt logger passes :class:`RedactingFilter` twice over: on the
logger that made it (handlers attached there) and on the package logger's
handler, which runs before any handler of an ancestor (the root logger) sees
the same record object.  The filter formats the message, replaces known
secret values (registered by the stores that hold them) and credential-shaped
patterns, and drops the arguments, so no handler can format a secret back in.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Iterator, Optional, TextIO

ROOT = "objckpt"
REDACTED = "[REDACTED]"

#: credential-shaped text, whatever its value: AWS key ids, signed-URL query
#: parameters, Authorization / token headers, key=value pairs naming a secret
_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"),
    re.compile(r"(?i)(X-Amz-(?:Signature|Credential|Security-Token)=)[^&\s'\"]+"),
    re.compile(r"(?i)((?:Signature|AWSAccessKeyId|x-amz-security-token)=)[^&\s'\"]+"),
    re.compile(r"(?i)(\bAuthorization['\"]?\s*[:=]\s*['\"]?)[^'\"\n]+"),
    re.compile(r"(?i)((?:aws_)?(?:secret_access_key|session_token|security_token|access_key_id|secret|password|token)"
               r"['\"]?\s*[:=]\s*['\"]?)[^'\"\s,}&]+"),
)

_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def register_secret(value: Optional[str]) -> None:
    """Never log ``value`` (a secret key, a session token): every objckpt log line
    that contains it gets :data:`REDACTED` instead.  Values shorter than 8
    characters are ignored (they would redact ordinary words)."""
    if value and len(value) >= 8:
        with _secrets_lock:
            _secrets.add(value)


def redact(text: str) -> str:
    """``text`` without registered secrets and credential-shaped substrings."""
    with _secrets_lock:
        known = sorted(_secrets, key=len, reverse=True)
    for s in known:
        if s in text:
            text = text.replace(s, REDACTED)
    for p in _PATTERNS:
        text = p.sub(lambda m: (m.group(1) if m.groups() else "") + REDACTED, text)
    return text


class RedactingFilter(logging.Filter):
    """Format the record's message once, redacted, and drop its arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_objckpt_redacted", False):
            return True
        try:
            msg = record.getMessage()
        except Exception:  # a bad format string: keep what we can show safely
            msg = f"{record.msg!s} {record.args!r}"
        record.msg, record.args = redact(msg), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        setattr(record, "_objckpt_redacted", True)
        return True


_FILTER = RedactingFilter()


class _GuardHandler(logging.NullHandler):
    """The package logger's handler: emits nothing, but (unlike a plain
    NullHandler) runs its filter, which redacts the shared record before the
    handlers of ancestor loggers see it."""

    def handle(self, record: logging.LogRecord) -> bool:
        return bool(self.filter(record))


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` (``"objckpt.<part>"``), with the redaction filter on it."""
    log = logging.getLogger(name)
    if _FILTER not in log.filters:
        log.addFilter(_FILTER)
    return log


def _install() -> logging.Logger:
    root = get_logger(ROOT)
    if not any(isinstance(h, _GuardHandler) for h in root.handlers):
        guard = _GuardHandler()
        guard.addFilter(_FILTER)
        root.addHandler(guard)
    return root


_install()


@dataclass
class Timings:
    """Seconds spent in each phase of one operation, in the order phases ran.

    Cheap: one ``perf_counter`` pair per phase (not per request); a phase entered
    several times (batches) accumulates."""

    phases: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t)

    def __getitem__(self, phase: str) -> float:
        return self.phases.get(phase, 0.0)

    def describe(self) -> str:
        """``"describe 0.001 s, plan 0.002 s, ..."``"""
        return ", ".join(f"{k} {v:.3f} s" for k, v in self.phases.items())


# -- progress bar ------------------------------------------------------------
# A small progress bar for the commands that move data (verify, cp, bench).
# Written to stderr so that a command's output (stdout) stays clean for pipes;
# shown only when both stdout and stderr are terminals (a command piped into
# another tool, or run by a job scheduler, prints no control characters) and
# not turned off (``--no-progress``).  No dependency: one line redrawn with
# ``\r`` at most ten times a second.  Updates may come from any thread (the
# I/O loop reports bytes as they land).


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
