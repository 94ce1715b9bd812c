"""A tiered save whose state cannot be read on one rank fails on every rank at once, and
writes nothing: no rank waits in a collective for the collective timeout."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import objckpt
from mp import run_multiprocess


class _Optimizer:
    """A Stateful value whose ``state_dict()`` fails on one rank (say, its state was freed)."""

    def __init__(self, broken: bool, value: float) -> None:
        self.broken, self.value = broken, value

    def state_dict(self) -> dict[str, Any]:
        if self.broken:
            raise RuntimeError("optimizer state was freed on this rank")
        return {"m": torch.full((5,), self.value)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = float(sd["m"][0])


def _state(rank: int, step: int, broken: bool = False) -> dict[str, Any]:
    return {"w": torch.full((3, 7), float(step)), "opt": _Optimizer(broken, step + 0.5)}


def _one_rank_cannot_read_its_state(rank: int, world: int, root: str, local: str, async_save: bool) -> Any:
    # a collective timeout far beyond the test's own: a rank left waiting fails the test by hanging
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "900"
    with objckpt.CheckpointManager(root, local_dir=local, node_override=f"n{rank}", replicas=1,
                                   persist_every=None, async_save=async_save) as m:
        m.save(1, _state(rank, 1))
        m.wait()
        try:
            m.save(2, _state(rank, 2, broken=rank == 1))
            err: Any = None
        except objckpt.ObjckptError as e:
            err = (type(e).__name__, str(e), type(e.__cause__).__name__ if e.__cause__ else None)
        held = sorted(os.listdir(local.replace("{node}", f"n{rank}")))
        m.save(2, _state(rank, 2))  # nothing of the failed attempt is in the way
        m.wait()
        back = _state(rank, 0)
        res = m.load(back)
        return err, held, res.step, float(back["w"][0, 0]), back["opt"].value


def _check(tmp_path: Path, async_save: bool) -> None:
    local = str(tmp_path / "{node}")
    got = run_multiprocess(2, _one_rank_cannot_read_its_state, str(tmp_path / "root"), local, async_save,
                           timeout=150)
    for rank, (err, held, step, w, opt) in enumerate(got):
        assert err is not None, f"rank {rank} saved step 2 though rank 1 could not read its state"
        kind, text, cause = err
        # every rank raises the class rank 1 raised (objckpt's own, naming the key and the value)
        assert kind == "UnsupportedValueError" and "step 2 not saved, nothing written" in text, err
        assert ("rank 1: its state could not be read (UnsupportedValueError: value at key 'opt' (_Optimizer) is "
                "Stateful but its state_dict() raised RuntimeError: optimizer state was freed") in text, err
        assert cause == ("UnsupportedValueError" if rank == 1 else None), err
        assert "step-0000000002" not in held, (rank, held)  # nothing written for the failed step
        assert (step, w, opt) == (2, 2.0, 2.5)


def test_a_state_dict_failing_on_one_rank_fails_the_tiered_save_on_every_rank(tmp_path: Path) -> None:
    _check(tmp_path, async_save=False)


def test_the_same_with_async_tiered_saves(tmp_path: Path) -> None:
    _check(tmp_path, async_save=True)
