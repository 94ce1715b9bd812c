"""Whole numbers objckpt reads from its own environment variables (``OBJCKPT_*``), read one
way: blank or unset is the caller's default, a number below zero or not a number is a
``ValueError`` that names the variable and what it takes."""
from __future__ import annotations

import os
from typing import Optional


def nonnegative(name: str, what: str) -> Optional[int]:
    """``$name`` as a whole number >= 0, or None when it is unset or blank.  ``what`` says
    what the variable takes, for the error: "a number of bytes (0 or more)"."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"${name} must be {what}, got {raw!r}")
    return n
