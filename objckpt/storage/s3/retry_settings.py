"""How many times an S3 store tries a request: the storage options, the AWS retry
settings botocore reads, and objckpt's deadline variables, resolved in one place.

objckpt keeps its own retry loop (:meth:`.send.Pipeline.send`) with a budget per
kind of failure (:class:`.retry.RetryPolicy`), because botocore's single budget
made a dead endpoint take 30-40 s to report.  But a user who wrote
``max_attempts = 1`` in ``~/.aws/config`` (or ``AWS_MAX_ATTEMPTS=1``) has said
"never retry", and boto3 honours it; so the AWS setting is read as botocore reads
it (``Session.get_config_variable``: the environment, then the profile) and caps
every kind of failure at that many attempts, the first one included, as in
botocore.  The storage option ``max_attempts`` means the same and wins over the
AWS setting; the per-kind options win over both.  Where nothing is set the
per-kind defaults stand.

``retry_mode`` (``legacy``, ``standard``, ``adaptive``) is read and checked as
botocore checks it, and kept for the store's log line: it does not change the
budgets, because objckpt's loop already backs off exponentially with full jitter
(what ``standard`` does) and adapts its concurrency to throttling (the storage
option ``adaptive``, on by default: what ``adaptive`` asks for).

The deadline settings (``deadline_floor``, ``min_rate``) come from the options,
else ``OBJCKPT_S3_DEADLINE_FLOOR`` / ``OBJCKPT_S3_MIN_RATE``.  They are read here,
when the store opens, so the store cache (keyed on the environment,
:mod:`.env_state`) follows them like every other setting.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .retry import RetryPolicy
from .setting import S3ConfigError, Setting

#: the retried kinds of failure; ``max_attempts`` caps them all
ATTEMPT_BUDGETS = ("throttle_attempts", "error_attempts", "timeout_attempts", "connect_attempts")
#: where the deadline settings come from when the storage options do not give them
DEADLINE_ENV = {"deadline_floor": "OBJCKPT_S3_DEADLINE_FLOOR", "min_rate": "OBJCKPT_S3_MIN_RATE"}
#: botocore's retry modes (``botocore.config``)
RETRY_MODES = ("legacy", "standard", "adaptive")


@dataclass(frozen=True)
class RetrySettings:
    """The store's retry policy and the AWS settings it was made from (for its log line)."""

    policy: RetryPolicy
    max_attempts: Setting  #: value None: set nowhere (the per-kind defaults stand)
    mode: Setting  #: botocore's ``retry_mode`` as read (``legacy`` where unset, botocore's default)

    def describe(self) -> str:
        """``retries: ...`` for the store's INFO line."""
        p = self.policy
        budgets = "/".join(str(getattr(p, k)) for k in ATTEMPT_BUDGETS)
        said = (f"max_attempts {self.max_attempts.value} ({self.max_attempts.source})"
                if self.max_attempts.value is not None else "objckpt's per-kind defaults")
        return (f"retries {budgets} attempts for throttling/errors/timeouts/refusals ({said}), "
                f"retry_mode {self.mode.value} ({self.mode.source})")


def resolve_retry(options: dict[str, Any], session: Any, in_file: str) -> RetrySettings:
    """Pop the retry and deadline options from ``options`` and read the AWS retry
    settings of botocore ``session`` (whose profile's section of the config file is
    ``in_file``, for messages); bad input is an :class:`S3ConfigError` naming the
    setting and its source."""
    kw = _option_numbers(options)
    total = _max_attempts(options, session, in_file)
    if total.value is not None:
        for name in ATTEMPT_BUDGETS:
            kw.setdefault(name, total.value)
    for name in ATTEMPT_BUDGETS:
        if name in kw and kw[name] < 1:
            raise S3ConfigError(name, "storage option", f"{kw[name]}: must be >= 1 (attempts count the first one)")
    _deadlines(kw)
    return RetrySettings(RetryPolicy(**kw), total, _mode(session, in_file))


def _option_numbers(options: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(RetryPolicy):
        if f.name in options:
            value = options.pop(f.name)
            try:
                kw[f.name] = type(f.default)(value)  # type: ignore[operator]
            except (TypeError, ValueError):
                raise S3ConfigError(f.name, "storage option", f"{value!r}: expected a number") from None
    return kw


def _aws_source(env: str, in_file: str) -> str:
    """Where botocore took a config variable from: its environment variable when set (it wins), else the file."""
    return f"environment variable {env}" if env in os.environ else f"{in_file}"


def _max_attempts(options: dict[str, Any], session: Any, in_file: str) -> Setting:
    """Storage option ``max_attempts``, else botocore's ``max_attempts`` (``AWS_MAX_ATTEMPTS``,
    the profile's ``max_attempts``); botocore refuses values below 1, so does this."""
    if "max_attempts" in options:
        value: Any = options.pop("max_attempts")
        source = "storage option max_attempts"
    else:
        source = _aws_source("AWS_MAX_ATTEMPTS", in_file)
        try:
            value = session.get_config_variable("max_attempts")
        except ValueError:  # botocore's int() of the raw text
            raw = os.environ.get("AWS_MAX_ATTEMPTS", session.get_scoped_config().get("max_attempts"))
            raise S3ConfigError("max_attempts", source, f"{raw!r}: expected a whole number") from None
        if value is None:
            return Setting(None, "not set")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise S3ConfigError("max_attempts", source, f"{value!r}: expected a whole number") from None
    if n < 1:
        raise S3ConfigError("max_attempts", source,
                            f"{n}: must be >= 1 (it counts the first attempt, as in botocore; 1 = never retry)")
    return Setting(n, source)


def _mode(session: Any, in_file: str) -> Setting:
    """botocore's ``retry_mode``: set, else ``standard`` under any ``defaults_mode`` but
    ``legacy`` (botocore's smart defaults, applied when a client is built), else ``legacy``."""
    value = session.get_config_variable("retry_mode")
    if "AWS_RETRY_MODE" not in os.environ and not session.get_scoped_config().get("retry_mode"):
        defaults = session.get_config_variable("defaults_mode") or "legacy"
        if defaults != "legacy":
            return Setting("standard", f"defaults_mode {defaults} ({_aws_source('AWS_DEFAULTS_MODE', in_file)})")
        return Setting(value or "legacy", "botocore's default")
    source = _aws_source("AWS_RETRY_MODE", in_file)
    if value not in RETRY_MODES:
        raise S3ConfigError("retry_mode", source, f"{value!r} is not one of {RETRY_MODES}")
    return Setting(value, source)


def _deadlines(kw: dict[str, Any]) -> None:
    for name, var in DEADLINE_ENV.items():
        where = f"storage option {name}"
        if name not in kw and os.environ.get(var, "").strip():
            where = f"environment variable {var}"
            try:
                kw[name] = float(os.environ[var])
            except ValueError:
                raise S3ConfigError(name, where, f"{os.environ[var]!r}: expected a number") from None
        if name in kw and not 0 < kw[name] < float("inf"):
            raise S3ConfigError(name, where, f"must be a positive number, got {kw[name]}")
