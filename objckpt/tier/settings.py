"""``TierSettings``: the tier options of :class:`objckpt.CheckpointManager`, as one value.

    m = objckpt.CheckpointManager("s3://bucket/run",
                                  tier=objckpt.TierSettings(local_dir="/dev/shm/ckpt/{node}", persist_every=10))

Why one frozen value rather than nine keywords: these options travel together (every
rank all-gathers them and compares them field by field, so ranks that disagree are
refused naming the field), they mean nothing without ``local_dir``, and a frozen value
can be built once and handed to every manager of a job.

Two tier-related options stay keywords of the manager, on purpose: ``node_override``
differs per rank by design (it names this rank's node, whereas every field here must be
the same on every rank), and ``failure_rate`` is a diagnostic input of
:meth:`~objckpt.CheckpointManager.advice` that changes nothing that is saved.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from .errors import TierSettingsError
from .retry_clock import DRAIN_RETRY_S, retry_s_error
from .wire import BACKENDS

#: the manager's default drain interval, in saves
PERSIST_EVERY = 10
#: the manager's default number of local steps kept per node
LOCAL_KEEP = 2


@dataclass(frozen=True)
class TierSettings:
    """The tier options, which every rank must pass alike (all-gathered and compared).
    See docs/tiering.md; each field's default is the manager's."""

    #: a node-local directory; ``{node}`` in it is replaced by the node's name
    local_dir: str
    #: peers on other nodes that get a copy of each step; None: one where the job spans
    #: several nodes, none on a single node
    replicas: Optional[int] = None
    #: every that many saves drain to the manager's root (None: by ``persist_every_seconds`` only)
    persist_every: Optional[int] = PERSIST_EVERY
    #: one drain when that many seconds passed since the last (None: by count only)
    persist_every_seconds: Optional[float] = None
    #: local steps kept per node
    local_keep: int = LOCAL_KEEP
    #: bytes/s per rank while draining (None: no cap)
    drain_bandwidth: Optional[float] = None
    #: local blobs written with O_DIRECT
    direct: bool = False
    #: how tier copies move between ranks: "auto" (NCCL where the training's group is NCCL
    #: and CUDA is available, else gloo), "gloo" or "nccl" (see objckpt.tier.wire)
    tier_backend: str = "auto"
    #: seconds before a failed drain is tried again on a clock, without a save or wait()
    #: (doubled per round that fails in a row, at most 10 minutes; None: at saves and wait()
    #: only); see objckpt.tier.retry_clock
    drain_retry_s: Optional[float] = DRAIN_RETRY_S

    def check(self) -> None:
        """:class:`TierSettingsError` naming the first field that is no valid value."""
        if not isinstance(self.local_dir, str) or not self.local_dir:
            raise TierSettingsError(f"local_dir must be a directory path, got {self.local_dir!r}")
        for name in ("replicas", "local_keep"):
            v = getattr(self, name)
            if v is None and name == "replicas":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "replicas" else 1):
                raise TierSettingsError(f"{name} must be an integer >= {0 if name == 'replicas' else 1}, got {v!r}")
        if self.persist_every is not None and (not isinstance(self.persist_every, int) or self.persist_every < 1):
            raise TierSettingsError(f"persist_every must be a positive integer or None, got {self.persist_every!r}")
        for name in ("persist_every_seconds", "drain_bandwidth"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise TierSettingsError(f"{name} must be a positive number or None, got {v!r}")
        if self.tier_backend not in BACKENDS:
            raise TierSettingsError(f"tier_backend must be one of {BACKENDS}, got {self.tier_backend!r}")
        why = retry_s_error(self.drain_retry_s)
        if why:
            raise TierSettingsError(why)


def differences(all_settings: list[TierSettings]) -> list[str]:
    """Each field on which the ranks' settings (``all_settings[rank]``) differ, with its
    values and the ranks that passed each (``persist_every: 10 on rank(s) [0], 3 on rank(s) [1]``)."""
    out = []
    for f in dataclasses.fields(TierSettings):
        by_value: dict[str, list[int]] = {}
        for r, s in enumerate(all_settings):
            by_value.setdefault(repr(getattr(s, f.name)), []).append(r)
        if len(by_value) > 1:
            out.append(f"{f.name}: " + ", ".join(f"{v} on rank(s) {rs}" for v, rs in by_value.items()))
    return out


#: the manager keywords that ``TierSettings`` replaces (deprecated there), in field order
DEPRECATED_KEYWORDS = tuple(f.name for f in dataclasses.fields(TierSettings))


def from_keywords(tier: Optional[TierSettings], old: dict[str, Any]) -> tuple[Optional[TierSettings], str]:
    """The settings of a manager given ``tier=`` or the deprecated keywords ``old`` (only those
    the caller passed), and the deprecation message to emit ("" when none was passed).
    Both at once is a :class:`TierSettingsError`; the old keywords without ``local_dir``
    select no tier, as they always did."""
    if tier is not None and not isinstance(tier, TierSettings):
        raise TierSettingsError(f"tier must be an objckpt.TierSettings, got {type(tier).__name__}: {tier!r}")
    if not old:
        return tier, ""
    names = ", ".join(f"{k}=" for k in old)
    if tier is not None:
        raise TierSettingsError(f"CheckpointManager got tier= and the keyword(s) {names} it replaces: pass the "
                                f"tier options in tier=objckpt.TierSettings(...) only")
    args = ", ".join(f"{k}=..." for k in old)
    warning = (f"the CheckpointManager keyword(s) {names} are deprecated and will be removed in the next "
               f"release: pass tier=objckpt.TierSettings({args}) instead")
    if "local_dir" not in old or old["local_dir"] is None:
        return None, warning + " (without local_dir these keywords select no tier and have no effect)"
    return TierSettings(**old), warning


__all__ = ["DEPRECATED_KEYWORDS", "LOCAL_KEEP", "PERSIST_EVERY", "TierSettings", "differences", "from_keywords"]
