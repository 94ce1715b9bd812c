"""A restore from the local tier decodes one manifest, the chosen step's, once: the plan learns
each local step's files from its file list (objckpt.tier.step_files), not by decoding its
manifest, and the load takes the manifest bytes the plan read instead of fetching them again
(a many-tensor manifest takes ~0.1 s to decode).  A step whose list is missing, damaged or
taken from another manifest is decoded instead, with the same outcome."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import logging
import shutil

import pytest
import torch

import objckpt
from objckpt.format import manifest as _manifest
from objckpt.load import session as _session
from objckpt.tier import owner, step_files


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
    assert seen == [str(tmp_path / "local" / f"step-{want:010d}" / "manifest.json")]  # the load's, no other
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


def _steps(tmp_path: Path, n: int) -> objckpt.CheckpointManager:
    m = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                  persist_every=None, local_keep=n)
    for s in range(1, n + 1):
        m.save(s, _state(s))
    m.close()
    return objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                     persist_every=None, local_keep=n)


def test_a_fresh_manager_learns_every_steps_files_without_decoding_a_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _steps(tmp_path, 3)  # a restarted job: three local steps, nothing read yet
    seen = _count_decodes(monkeypatch)
    assert fresh.latest_step() == 3 and fresh.step_tiers() == {1: ["local"], 2: ["local"], 3: ["local"]}
    assert seen == []
    back = _state(0)
    assert fresh.load(back).step == 3 and back["step"] == 3 and torch.equal(back["layer2.w"], _state(3)["layer2.w"])
    assert len(seen) == 1 and "step-0000000003" in seen[0]
    fresh.close()


def _spoil(d: Path, how: str, other: Path) -> None:
    f = d / step_files.FILES_NAME
    if how == "absent":  # a step committed by an older release, or a rank killed before writing it
        f.unlink()
    elif how == "damaged":  # one byte changed: its seal fails
        raw = bytearray(f.read_bytes())
        raw[raw.index(b"blobs/") + 1] ^= 0x01
        f.write_bytes(bytes(raw))
    else:  # "stale": taken from another manifest (a reused step folder)
        shutil.copyfile(other / step_files.FILES_NAME, f)


@pytest.mark.parametrize("how", ["absent", "damaged", "stale"])
def test_a_step_whose_file_list_is_absent_damaged_or_stale_is_decoded_instead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str) -> None:
    fresh = _steps(tmp_path, 2)
    d, other = tmp_path / "local" / "step-0000000002", tmp_path / "local" / "step-0000000001"
    data = (d / "manifest.json").read_bytes()
    assert step_files.read(d, data) == step_files.of_manifest(_manifest.decode(data))  # intact: used
    _spoil(d, how, other)
    assert step_files.read(d, data) is None
    seen = _count_decodes(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="objckpt.manager"):
        back = _state(0)
        res = fresh.load(back)
    assert res.step == 2 and res.source == "local" and back["step"] == 2
    assert all(torch.equal(back[k], v) for k, v in _state(2).items() if k != "step")
    # the spoiled step's manifest decoded by the plan (then handed to the load), step 1's list used
    assert seen == [str(d / "manifest.json")]
    assert ("unusable" in caplog.text) == (how == "damaged")
    fresh.close()


def test_a_list_naming_a_file_the_folder_lacks_makes_the_step_incomplete(tmp_path: Path) -> None:
    """The list says which files the step needs; a blob deleted from the folder (a damaged
    node) makes the step local-partial, and the restore takes the older whole step."""
    fresh = _steps(tmp_path, 2)
    d = tmp_path / "local" / "step-0000000002"
    listed = step_files.read(d, (d / "manifest.json").read_bytes())
    assert listed is not None
    blob = next(n for n in listed.needed if n.endswith(".bin"))
    (d / blob).unlink()
    assert fresh.step_tiers() == {1: ["local"], 2: ["local-partial"]}
    back = _state(0)
    assert fresh.load(back).step == 1 and back["step"] == 1
    fresh.close()


def _save_counting(rank: int, world: int, root: str, local: str, per_node: int = 0) -> int:
    seen = []
    real = _manifest.decode

    def counting(data: bytes, where: str = "<manifest>") -> Any:
        seen.append(where)
        return real(data, where)

    _manifest.decode = counting  # type: ignore[assignment]  # a fresh process of its own
    node = f"n{rank // per_node}" if per_node else "same"
    with objckpt.CheckpointManager(root, local_dir=local, replicas=1 if per_node else 0, persist_every=2,
                                   node_override=node) as m:
        for s in (1, 2):  # step 2 drains: every rank uploads its files
            m.save(s, {"w": objckpt.Shard(torch.full((4, 3), float(rank + s)), (4 * world, 3), (4 * rank, 0)),
                       "step": s})
        m.wait()
    return len(seen)


def test_after_a_tiered_save_only_each_nodes_first_rank_decodes_the_manifest(tmp_path: Path) -> None:
    """Each rank replicates the files its save reported (SaveResult.files); the node's first
    rank decodes the step's manifest once, to write its file list, and its drain reuses that
    decode; another rank decodes it once per drained step only (the drain checks every byte it
    uploads against the manifest's crc32c)."""
    from mp import run_multiprocess

    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    assert run_multiprocess(2, _save_counting, root, local) == [2, 1]  # rank 0: one per step
    back = {"w": torch.zeros(8, 3), "step": 0}
    objckpt.load(back, f"{root}/step-0000000002")  # drained whole by both ranks
    assert back["step"] == 2 and torch.equal(back["w"][4:], torch.full((4, 3), 3.0))


def test_a_file_list_that_cannot_be_written_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The list is a hint: a full disk or an unwritable folder at that moment is a warning,
    the step stays committed, and restores decode its manifest instead."""
    import os as _os

    real = _os.replace

    def refuse(src: Any, dst: Any) -> None:
        if str(dst).endswith(step_files.FILES_NAME):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(_os, "replace", refuse)
    with caplog.at_level(logging.WARNING, logger="objckpt.manager"):
        m = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                      persist_every=None)
        m.save(4, _state(4))
        m.wait()
        m.close()
    d = tmp_path / "local" / "step-0000000004"
    assert "cannot write the file list" in caplog.text
    assert sorted(p.name for p in d.iterdir()) == [owner.OWNER_NAME, "blobs", "manifest.json"]  # no list, no temporary
    monkeypatch.undo()
    seen = _count_decodes(monkeypatch)
    fresh = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                      persist_every=None)
    back = _state(0)
    assert fresh.load(back).step == 4 and back["step"] == 4 and torch.equal(back["layer1.w"], _state(4)["layer1.w"])
    assert seen == [str(d / "manifest.json")]
    fresh.close()


def test_on_two_nodes_only_each_nodes_first_rank_decodes_the_manifest(tmp_path: Path) -> None:
    """Four ranks on two nodes, replicated and drained: the metadata's spread to every node
    and the file list are the nodes' first ranks' (ranks 0 and 2); ranks 1 and 3 decode
    only the drained step's, to check what they upload (each used to decode every step's
    manifest twice)."""
    from mp import run_multiprocess

    root, local = str(tmp_path / "root"), str(tmp_path / "{node}")
    assert run_multiprocess(4, _save_counting, root, local, 2) == [2, 1, 2, 1]
    back = {"w": torch.zeros(16, 3), "step": 0}
    objckpt.load(back, f"{root}/step-0000000002")
    assert back["step"] == 2 and torch.equal(back["w"][12:], torch.full((4, 3), 5.0))
    for node in ("n0", "n1"):  # each node's folder is whole (its own blobs, the peers' replicas) and listed
        d = tmp_path / node / "step-0000000002"
        listed = step_files.read(d, (d / "manifest.json").read_bytes())
        assert listed is not None and all((d / f).is_file() for f in listed.needed)
