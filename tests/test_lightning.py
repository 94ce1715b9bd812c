"""objckpt.lightning against a real Lightning Trainer and a real moto S3 server over HTTP.

Lightning's own directory checks (ModelCheckpoint's fsspec filesystem) find the
endpoint through ``AWS_ENDPOINT_URL``, as they would in a user's job.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import pathlib
import subprocess
import sys
import types
from typing import Any, NamedTuple

import boto3  # type: ignore[import-untyped]
import numpy as np
import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import objckpt
from objckpt.errors import CorruptCheckpointError, NotFoundError, UnsupportedValueError
from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO

from conftest import assert_same
from lightning_helpers import Tiny, data, reference_losses, trainer


class Opaque:
    """Not plain data: a custom object in the hyper-parameters."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


class Color(str, enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Point(NamedTuple):
    x: int
    y: float


@dataclasses.dataclass(frozen=True)
class Cfg:
    name: str
    sizes: tuple[int, ...]
    scale: torch.Tensor


def _keys(bucket: str, opts: dict[str, Any]) -> list[str]:
    client = boto3.client("s3", **opts)
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))


def _checkpoints(keys: list[str], under: str) -> set[str]:
    """Names of the checkpoints under ``under/`` that the keys belong to (marker or prefix)."""
    return {k[len(under) + 1:].split("/", 1)[0] for k in keys if k.startswith(under + "/")}


def test_top_k_removes_old_checkpoints_and_resume_is_exact(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    bucket, run, opts = s3_run
    ref_losses, ref_weights = reference_losses(8)

    first = Tiny()
    ckpt = LightningModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="max")
    trainer(6, [ObjckptCheckpointIO(opts)], [ckpt], default_root_dir=run).fit(first, data())
    assert first.losses == ref_losses[:6]

    keys = _keys(bucket, opts)
    # 3 saves (steps 2, 4, 6), top 2 kept: every object of step 2 is gone, marker included
    assert _checkpoints(keys, "run/checkpoints") == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"}, keys
    for name in ("epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"):
        assert f"run/checkpoints/{name}/manifest.json" in keys and f"run/checkpoints/{name}" in keys
    assert ckpt.best_model_path == f"{run}/checkpoints/epoch=2-step=6.ckpt"

    resumed = Tiny()  # a fresh model and Trainer, resuming from an explicit path
    trainer(8, [ObjckptCheckpointIO(opts)], default_root_dir=run).fit(
        resumed, data(), ckpt_path=f"{run}/checkpoints/epoch=2-step=6.ckpt")
    assert resumed.losses == ref_losses[6:]
    assert_same(dict(resumed.state_dict()), dict(ref_weights))


@pytest.mark.parametrize("mode", ["async_save", "lightning_async_wrapper"])
def test_async_saves_then_resume_from_last(s3_run: tuple[str, str, dict[str, Any]], mode: str) -> None:
    bucket, run, opts = s3_run
    ref_losses, ref_weights = reference_losses(8)

    def io() -> Any:
        if mode == "async_save":
            return ObjckptCheckpointIO(opts, async_save=True)
        return AsyncCheckpointIO(ObjckptCheckpointIO(opts))

    def ckpt() -> ModelCheckpoint:
        return ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=True)

    first = Tiny()
    trainer(6, [io()], [ckpt()], default_root_dir=run).fit(first, data())
    assert first.losses == ref_losses[:6]
    keys = _keys(bucket, opts)
    assert _checkpoints(keys, "run/checkpoints") == {"epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"}, keys

    resumed = Tiny()
    trainer(8, [io()], [ckpt()], default_root_dir=run).fit(resumed, data(), ckpt_path="last")
    assert resumed.losses == ref_losses[6:]  # resumed at step 6, not from scratch
    assert_same(dict(resumed.state_dict()), dict(ref_weights))


def test_non_plain_value_needs_allow_pickle(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    bucket, run, opts = s3_run
    ckpt = LightningModelCheckpoint(every_n_train_steps=1)
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.extra.*Opaque.*allow_pickle=True"):
        trainer(1, [ObjckptCheckpointIO(opts)], [ckpt], default_root_dir=run).fit(Tiny(extra=Opaque(3)), data())
    assert not [k for k in _keys(bucket, opts) if k.endswith("manifest.json")]

    ckpt = LightningModelCheckpoint(every_n_train_steps=1)
    trainer(1, [ObjckptCheckpointIO(opts, allow_pickle=True)], [ckpt], default_root_dir=run).fit(
        Tiny(extra=Opaque(3)), data())
    path = ckpt.best_model_path
    loaded = ObjckptCheckpointIO(opts, allow_pickle=True).load_checkpoint(path)
    assert loaded["hyper_parameters"]["extra"] == Opaque(3) and loaded["global_step"] == 1
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.extra.*allow_pickle=True"):
        ObjckptCheckpointIO(opts).load_checkpoint(path)
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.extra"):
        ObjckptCheckpointIO(opts, allow_pickle=True).load_checkpoint(path, weights_only=True)


def test_python_values_round_trip_without_pickle(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    _, run, opts = s3_run
    sd = torch.nn.Linear(3, 2).state_dict()  # an OrderedDict with torch's _metadata
    dd: collections.defaultdict[str, list[int]] = collections.defaultdict(list, {"a": [1]})
    state: dict[str, Any] = {
        "state_dict": sd,
        "hyper_parameters": AttributeDict(lr=0.1, color=Color.RED, level=Level.HIGH, where=pathlib.Path("/x/y")),
        "cfg": Cfg("c", (1, 2), torch.tensor([2.0])),
        "point": Point(1, 2.5),
        "tags": {"a", "b"},
        "frozen": frozenset({3}),
        "ns": argparse.Namespace(depth=2),
        "np": {"arr": np.arange(6, dtype=np.float32).reshape(2, 3), "scalar": np.int64(7), "f": np.float64(0.5)},
        "by_int": {0: "zero", 1: dd},
        "odd": {"$ref": 1, "a.b": 2},
    }
    io = ObjckptCheckpointIO(opts)
    io.save_checkpoint(state, f"{run}/values.ckpt")
    manifest_tree = str(objckpt.inspect(f"{run}/values.ckpt", storage_options=opts, chunks=False).tree)
    assert "$pickle" not in manifest_tree

    back = ObjckptCheckpointIO(opts).load_checkpoint(f"{run}/values.ckpt")
    assert type(back["state_dict"]) is collections.OrderedDict
    assert back["state_dict"]._metadata == sd._metadata  # type: ignore[attr-defined]
    assert_same(dict(back["state_dict"]), dict(sd))
    hp = back["hyper_parameters"]
    assert type(hp) is AttributeDict and hp.lr == 0.1 and hp.color is Color.RED and hp.level is Level.HIGH
    assert hp.where == pathlib.Path("/x/y") and type(hp.where) is type(pathlib.Path("/x/y"))
    assert type(back["cfg"]) is Cfg and back["cfg"].sizes == (1, 2)
    assert torch.equal(back["cfg"].scale, state["cfg"].scale)
    assert type(back["point"]) is Point and back["point"] == Point(1, 2.5)
    assert back["tags"] == {"a", "b"} and back["frozen"] == frozenset({3}) and type(back["frozen"]) is frozenset
    assert back["ns"] == argparse.Namespace(depth=2)
    assert back["np"]["arr"].dtype == np.float32 and (back["np"]["arr"] == state["np"]["arr"]).all()
    assert type(back["np"]["scalar"]) is np.int64 and back["np"]["scalar"] == 7 and type(back["np"]["f"]) is np.float64
    assert type(back["by_int"][1]) is collections.defaultdict and back["by_int"][1].default_factory is list
    assert back["by_int"] == {0: "zero", 1: {"a": [1]}} and back["odd"] == {"$ref": 1, "a.b": 2}
    # the stored keys stay the natural ones: a plain objckpt.read finds the weights by name
    assert torch.equal(objckpt.read(f"{run}/values.ckpt", ["state_dict.weight"], storage_options=opts)
                       ["state_dict.weight"], sd["weight"])

    on_meta = io.load_checkpoint(f"{run}/values.ckpt", map_location="meta")
    assert on_meta["state_dict"]["weight"].is_meta and on_meta["cfg"].scale.is_meta  # inside a dataclass too
    assert io.load_checkpoint(f"{run}/values.ckpt", map_location={"cpu": "meta"})["state_dict"]["bias"].is_meta
    kept = io.load_checkpoint(f"{run}/values.ckpt", map_location=lambda storage, loc: storage)
    assert torch.equal(kept["state_dict"]["bias"], sd["bias"])


def test_class_not_imported_comes_back_as_plain_data(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    _, run, opts = s3_run
    mod = types.ModuleType("objckpt_lightning_test_configs")
    sys.modules[mod.__name__] = mod
    try:
        exec("import dataclasses\n@dataclasses.dataclass\nclass Late:\n    k: int\n", mod.__dict__)
        ObjckptCheckpointIO(opts).save_checkpoint({"cfg": mod.Late(4)}, f"{run}/late.ckpt")
    finally:
        del sys.modules[mod.__name__]
    with pytest.warns(UserWarning, match=r"'cfg'.*objckpt_lightning_test_configs:Late.*not imported"):
        back = ObjckptCheckpointIO(opts).load_checkpoint(f"{run}/late.ckpt")
    assert back == {"cfg": {"k": 4}}


def test_remove_waits_for_the_save_in_flight_and_errors_surface(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    bucket, run, opts = s3_run
    io = ObjckptCheckpointIO(opts, async_save=True)
    state: dict[str, Any] = {"w": torch.randn(64, 64), "step": 1}
    io.save_checkpoint(state, f"{run}/a.ckpt")
    state["w"].zero_()  # Lightning may change its tensors once save_checkpoint returned
    io.save_checkpoint(state, f"{run}/b.ckpt")
    io.remove_checkpoint(f"{run}/b.ckpt")  # right away: waits for b's commit and marker, then deletes
    io.teardown()
    assert _checkpoints(_keys(bucket, opts), "run") == {"a.ckpt"}
    assert ObjckptCheckpointIO(opts).load_checkpoint(f"{run}/a.ckpt")["w"].abs().sum() > 0

    io.remove_checkpoint(f"{run}/never-saved.ckpt")  # as Lightning's own plugin: nothing there, nothing to do
    with pytest.raises(NotFoundError, match="never-saved.ckpt"):
        io.load_checkpoint(f"{run}/never-saved.ckpt")

    failing = ObjckptCheckpointIO(opts, async_save=True)
    with pytest.raises(objckpt.BucketNotFoundError, match="no-such-bucket"):  # from the call or from teardown
        failing.save_checkpoint(state, "s3://no-such-bucket/run/c.ckpt")
        failing.teardown()
    failing.teardown()  # reported once


def test_bad_input_is_named(s3_run: tuple[str, str, dict[str, Any]]) -> None:
    _, run, opts = s3_run
    io = ObjckptCheckpointIO(opts)
    with pytest.raises(UnsupportedValueError, match=r"'callbacks\.cb\.fn'.*function"):
        io.save_checkpoint({"callbacks": {"cb": {"fn": lambda: 1}}}, f"{run}/x.ckpt")
    with pytest.raises(UnsupportedValueError, match=r"'loops\.seen'.*key \(1, 2\)"):
        io.save_checkpoint({"loops": {"seen": {(1, 2): 3}}}, f"{run}/x.ckpt")
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    with pytest.raises(UnsupportedValueError, match="reference cycle"):
        io.save_checkpoint({"c": cyclic}, f"{run}/x.ckpt")
    with pytest.raises(ValueError, match="__objckpt_lightning__"):
        io.save_checkpoint({"__objckpt_lightning__": 1}, f"{run}/x.ckpt")
    objckpt.save({"w": torch.zeros(2), "__objckpt_lightning__": {"notes": [["w"]]}}, f"{run}/bad.ckpt",
                 storage_options=opts)
    with pytest.raises(CorruptCheckpointError, match="malformed type note"):
        io.load_checkpoint(f"{run}/bad.ckpt")


def test_import_objckpt_does_not_import_lightning() -> None:
    code = "import sys, objckpt; assert 'lightning' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
