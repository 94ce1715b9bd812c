"""A resolved S3 setting with its source, and the error that names both.

Every value an S3 store's configuration takes from the user (storage options,
the environment, the AWS config files) is kept with where it came from, so a log
line or an error can say which variable or file to change.  Shared by
:mod:`.config` and the modules that resolve parts of it (:mod:`.retry_settings`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from ...errors import ObjckptError


class S3ConfigError(ObjckptError, ValueError):
    """An S3 setting is wrong; ``setting`` names it and ``source`` where it came from."""

    def __init__(self, setting: str, source: str, message: str) -> None:
        super().__init__(f"S3 setting {setting} ({source}): {message}")
        self.setting = setting
        self.source = source

    @classmethod
    def from_message(cls, message: str) -> "S3ConfigError":
        """(The setting and its source are in the text only: both empty.)"""
        made = cls("", "", "")
        made.args = (message,)
        return made


@dataclass(frozen=True)
class Setting:
    """A resolved value and where it came from (for logs and error messages)."""

    value: Any
    source: str


def env_source(value: Any, *names: str) -> Optional[str]:
    """``environment variable NAME`` for the first of ``names`` set to ``value`` (None: none is)."""
    for n in names:
        if value and os.environ.get(n) == value:
            return f"environment variable {n}"
    return None
