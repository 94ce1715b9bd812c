"""How a manager names its step folders, and how a step argument is checked.

Why configurable: a run that already has checkpoints under its own names
(``step_100``, ``checkpoint-00000100``, orbax's ``<prefix>_<step>``) should be
managed where it is, not copied into ``step-<10 digits>``.  A format is a
Python format string with one field for the step (``{step}``, ``{n}`` or
``{}``; plain, ``d`` or zero-padded ``0Nd``) and no ``/``: one folder per step,
directly under the root.  Parsing is the format's inverse checked by a round
trip, so ``step_0100`` is not a step of ``step_{step}`` (it would be saved as
``step_100``) and a listing never maps two folders to one step.

The step index records the format it was written with
(:class:`~objckpt.manager.index.IndexDoc`), so ``objckpt ls | rm | prune`` find
the folders of any root, and a manager opened with another format is told so
instead of looking in the wrong folders.
"""
from __future__ import annotations

import operator
import re
import string
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import ObjckptError

DEFAULT_STEP_FORMAT = "step-{step:010d}"
_FIELD_NAMES = ("", "step", "n")
_SPEC_RE = re.compile(r"(0\d+)?d?")


class InvalidStepError(ObjckptError, ValueError):
    """A step that cannot name a checkpoint (negative, not an integer)."""


class SwappedArgumentsError(InvalidStepError, TypeError):
    """``save(state, step)`` / ``load(step, state)``: a step where the state goes and the other
    way round (the manager's order is ``save(step, state)``, ``load(state, step=...)``)."""


class StepFormatError(ObjckptError, ValueError):
    """A step folder format that cannot name steps (no step field, a ``/``, a bad spec),
    or one that differs from the format the root's index was written with."""


def describe(value: Any, limit: int = 60) -> str:
    """A short description of ``value`` for an error message: its type, and its repr when
    short (a model or a state dict's repr runs to thousands of characters)."""
    kind = type(value).__name__
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails says nothing useful
        text = ""
    if text and len(text) <= limit and "\n" not in text:
        return f"{text} ({kind})"
    if isinstance(value, dict):
        return f"a {kind} with {len(value)} key(s)"
    return f"a {kind}"


def _as_step(value: Any) -> Optional[int]:
    """``value`` as a step number, or None: ints, numpy and 0-d integer torch values; not
    floats, bools or negatives."""
    if isinstance(value, bool):
        return None
    try:
        n = operator.index(value)
    except TypeError:
        return None
    return n if n >= 0 else None


def check_step(step: Any) -> int:
    """``step`` as an int: ints, numpy and 0-d integer torch values; not floats or bools."""
    n = _as_step(step)
    if n is None:
        raise InvalidStepError(f"a checkpoint step must be a non-negative integer, got {describe(step)}")
    return n


def looks_like_step(value: Any) -> bool:
    """Whether ``value`` could be a step (for telling swapped arguments apart).  Asked of
    every state a manager saves or loads, so it never builds an error message: the repr
    of a state dict costs milliseconds per tensor."""
    return _as_step(value) is not None


@dataclass(frozen=True)
class StepNaming:
    """One step folder format (see the module docstring); ``name`` and ``parse`` are inverses."""

    fmt: str = DEFAULT_STEP_FORMAT
    _regex: "re.Pattern[str]" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fmt = self.fmt
        if not isinstance(fmt, str):
            raise StepFormatError(f"step_format must be a str like 'step_{{step}}', got {describe(fmt)}")
        try:
            parts = list(string.Formatter().parse(fmt))
        except ValueError as e:
            raise StepFormatError(f"step_format {fmt!r} is not a format string: {e}") from None
        fields = [(name, spec, conv) for _, name, spec, conv in parts if name is not None]
        if len(fields) != 1 or fields[0][0] not in _FIELD_NAMES or fields[0][2] \
                or not _SPEC_RE.fullmatch(fields[0][1] or ""):
            raise StepFormatError(
                f"step_format {fmt!r} needs exactly one step field: '{{step}}', or zero-padded '{{step:08d}}' "
                "('{n}' and '{}' work too)")
        literal = "".join(text for text, *_ in parts)
        if "/" in literal or "\\" in literal:
            raise StepFormatError(f"step_format {fmt!r}: one folder per step, directly under the root (no '/')")
        if literal.startswith("_objckpt"):
            raise StepFormatError(f"step_format {fmt!r}: names starting with '_objckpt' are objckpt's own")
        pattern = "".join(re.escape(text) + (r"(\d+)" if name is not None else "") for text, name, _, _ in parts)
        object.__setattr__(self, "_regex", re.compile(pattern))

    def name(self, step: Any) -> str:
        """The folder of ``step`` under the root."""
        n = check_step(step)
        return self.fmt.format(n, step=n, n=n)

    def parse(self, name: str) -> Optional[int]:
        """The step of a folder this format names, else None (exactly: the round trip must hold)."""
        m = self._regex.fullmatch(name)
        if m is None:
            return None
        step = int(m.group(1))
        return step if self.name(step) == name else None


DEFAULT_NAMING = StepNaming()


def step_name(step: Any) -> str:
    """The default folder of ``step`` under the root: ``step-`` and 10 digits, so raw listings sort
    (up to step 9,999,999,999; larger steps get more digits and sort after them by length only)."""
    return DEFAULT_NAMING.name(step)


def parse_step_name(name: str) -> Optional[int]:
    """The step of a folder named by :func:`step_name` (exactly: ``step-1`` is not one)."""
    return DEFAULT_NAMING.parse(name)
