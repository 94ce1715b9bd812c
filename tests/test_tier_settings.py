"""The tier options as one ``tier=objckpt.TierSettings(...)`` argument, the deprecated keywords
beside it, and the seam the tier is built on (it gets a ``StepsHost``, never the manager).

moto stands for object storage; temporary directories for the node-local tier."""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from objckpt.manager.steps import PlainSteps, StepsHost
from objckpt.manager.tiers import TieredSaves
from objckpt.tier.retry_clock import DRAIN_RETRY_S


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step, "step": step}


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def _run(m: objckpt.CheckpointManager) -> tuple[Any, ...]:
    """Three saves, a wait, where the steps are and what a load of the latest gives."""
    for step in (1, 2, 3):
        m.save(step, _state(step), metadata={"loss": 1.0 / step})
    m.wait()
    st = {"w": torch.zeros(3, 4), "step": -1}
    res = m.load(st)
    out = (m.step_tiers(), m.steps(), res.step, res.source, st["step"], st["w"].tolist())
    m.close()
    return out


def test_tier_settings_defaults_are_the_managers_defaults() -> None:
    s = objckpt.TierSettings(local_dir="/tmp/x")
    assert "TierSettings" in objckpt.__all__
    assert (s.replicas, s.persist_every, s.persist_every_seconds, s.local_keep, s.drain_bandwidth, s.direct,
            s.tier_backend, s.drain_retry_s) == (None, 10, None, 2, None, False, "auto", DRAIN_RETRY_S)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.local_keep = 3  # type: ignore[misc]
    with pytest.raises(objckpt.TierSettingsError, match="local_keep must be an integer >= 1, got 0"):
        objckpt.TierSettings(local_dir="/tmp/x", local_keep=0).check()


def test_old_tier_keywords_warn_once_and_behave_as_tier_settings(moto_s3: tuple[str, dict[str, Any]],
                                                                  tmp_path: Path) -> None:
    bucket, opts = moto_s3
    options = {"persist_every": 2, "local_keep": 1, "replicas": 0, "drain_retry_s": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = objckpt.CheckpointManager(f"s3://{bucket}/new", storage_options=opts,
                                        tier=objckpt.TierSettings(local_dir=str(tmp_path / "new"), **options))
    assert _deprecations(caught) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = objckpt.CheckpointManager(f"s3://{bucket}/old", storage_options=opts,
                                        local_dir=str(tmp_path / "old"), **options)
    said = _deprecations(caught)
    assert len(said) == 1, said  # one warning for the four keywords, naming the replacement
    assert ("tier=objckpt.TierSettings(local_dir=..., replicas=..., persist_every=..., local_keep=..., "
            "drain_retry_s=...)") in said[0]  # in the fields' order
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert old._tiers is not None and new._tiers is not None
    assert dataclasses.replace(old._tiers.s, local_dir="") == dataclasses.replace(new._tiers.s, local_dir="")
    got_new, got_old = _run(new), _run(old)
    assert got_old == got_new
    assert got_new[0] == {2: ["object"], 3: ["local"]} and got_new[2:4] == (3, "local")


def test_old_tier_keywords_without_local_dir_warn_and_select_no_tier(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match="without local_dir these keywords select no tier"):
        m = objckpt.CheckpointManager(str(tmp_path / "root"), persist_every=3)
    assert m._tiers is None and isinstance(m._steps, PlainSteps)
    m.save(1, _state(1))
    assert m.step_tiers() == {1: ["object"]}
    m.close()


@pytest.mark.parametrize("bad", [{"local_dir": "/elsewhere"}, {"persist_every": 5}, {"drain_retry_s": None}])
def test_tier_and_an_old_keyword_together_are_refused_before_anything_is_written(tmp_path: Path,
                                                                                 bad: dict[str, Any]) -> None:
    local = tmp_path / "local"
    name = next(iter(bad))
    with pytest.raises(objckpt.TierSettingsError, match=f"got tier= and the keyword\\(s\\) {name}= it replaces"):
        objckpt.CheckpointManager(str(tmp_path / "root"), tier=objckpt.TierSettings(local_dir=str(local)), **bad)
    with pytest.raises(objckpt.TierSettingsError, match="tier must be an objckpt.TierSettings, got dict"):
        objckpt.CheckpointManager(str(tmp_path / "root"), tier={"local_dir": str(local)})  # type: ignore[arg-type]
    assert not local.exists() and not (tmp_path / "root").exists()


def test_the_tier_drains_through_its_host_callback_only(moto_s3: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """TieredSaves built from a StepsHost whose ``drained`` callback is the test's: a drain
    reports its step, metadata and save time there, and the manager's own bookkeeping is
    not reached around it (its known steps stay unread)."""
    bucket, opts = moto_s3
    m = objckpt.CheckpointManager(f"s3://{bucket}/run", storage_options=opts, clock=lambda: 1234.5)
    drained: list[tuple[int, dict[str, Any], float]] = []
    host: StepsHost = dataclasses.replace(m._host(), drained=lambda *a: drained.append(a),
                                          known_steps=lambda: {})
    tier = TieredSaves(host, objckpt.TierSettings(local_dir=str(tmp_path / "local"), persist_every=1, replicas=0,
                                                  drain_retry_s=None), None, None)
    tier.save(7, _state(7), {"loss": 0.5})
    tier.wait()
    tier.close()
    assert drained == [(7, {"loss": 0.5}, 1234.5)]
    assert m._known is None  # the manager's own bookkeeping was not reached around the host
    st = {"w": torch.zeros(3, 4), "step": -1}
    objckpt.load(st, f"s3://{bucket}/run/step-0000000007", storage_options=opts)
    assert st["step"] == 7
    m.close()
