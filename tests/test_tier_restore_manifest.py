"""A restore from the local tier decodes the chosen step's manifest once: the plan reads it
from the node's folder to choose the step, and the load takes that one instead of fetching
and decoding it again (a many-tensor manifest takes ~0.1 s to decode)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from objckpt.format import manifest as _manifest
from objckpt.load import session as _session


def _state(step: int) -> dict[str, Any]:
    return {f"layer{i}.w": torch.full((64, 9), float(step * 10 + i)) for i in range(6)} | {"step": step}


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = _manifest.decode

    def counting(data: bytes, where: str = "<manifest>") -> Any:
        seen.append(where)
        return real(data, where)

    monkeypatch.setattr(_manifest, "decode", counting)  # the tier's scan
    monkeypatch.setattr(_session, "decode", counting)  # a load's fetch
    return seen


@pytest.mark.parametrize("which", [None, 1])
def test_the_chosen_steps_manifest_is_decoded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   which: Any) -> None:
    m = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                  persist_every=None, local_keep=2)
    m.save(1, _state(1))
    m.save(2, _state(2))
    m.wait()
    seen = _count_decodes(monkeypatch)
    back = _state(0)
    res = m.load(back, step=which)
    want = which or 2
    assert res.step == want and res.source == "local"
    assert all(torch.equal(back[k], v) for k, v in _state(want).items() if k != "step") and back["step"] == want
    name = f"step-{want:010d}"
    assert sum(name in w for w in seen) == 1, seen  # the plan's decode; the load took it
    m.close()


def test_a_fresh_manager_and_a_plain_load_restore_the_same_bytes(tmp_path: Path) -> None:
    """A new manager (a restarted job: nothing decoded before its plan) restores through the
    handed-over manifest, and a plain ``objckpt.load`` of the same folder (no held manifest)
    gets the same bytes."""
    m = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                  persist_every=None)
    m.save(3, _state(3))
    m.close()
    fresh = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                      persist_every=None)
    back = _state(0)
    assert fresh.load(back).step == 3 and back["step"] == 3 and torch.equal(back["layer5.w"], _state(3)["layer5.w"])
    plain = _state(0)
    objckpt.load(plain, str(tmp_path / "local" / "step-0000000003"))
    assert torch.equal(plain["layer0.w"], _state(3)["layer0.w"])
    fresh.close()
