"""``objckpt.lightning.load_from_checkpoint``: build a LightningModule from an objckpt checkpoint in
one call; and ``LightningModule.load_from_checkpoint`` (torch.load) on one says what to call instead."""
from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from lightning_helpers import Tiny, data, trainer
from objckpt.errors import NotFoundError
from objckpt.lightning import NotATorchCheckpointError, ObjckptCheckpointIO, load_from_checkpoint

TRAP = "objckpt_checkpoint_load_it_with_objckpt_lightning_load_from_checkpoint"


def _trained(uri: str) -> Tiny:
    model = Tiny(lr=0.02)
    t = trainer(3, plugins=[ObjckptCheckpointIO()])
    t.fit(model, data())
    t.save_checkpoint(uri)
    return model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_load_from_checkpoint_on_s3_and_what_torch_load_says(moto_s3: tuple[str, dict[str, Any]],
                                                             moto_endpoint: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, opts = moto_s3
    for k, v in {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": opts["aws_access_key_id"],
                 "AWS_SECRET_ACCESS_KEY": opts["aws_secret_access_key"],
                 "AWS_DEFAULT_REGION": opts["region_name"]}.items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{bucket}/run/model.ckpt"
    trained = _trained(uri)

    loaded = load_from_checkpoint(Tiny, uri)  # one call: built from the saved hyper-parameters, state loaded
    assert isinstance(loaded, Tiny) and loaded.hparams["lr"] == 0.02
    _same_weights(loaded, trained)
    assert next(loaded.parameters()).device.type == "cpu"
    overridden = load_from_checkpoint(Tiny, uri, lr=0.5)  # keyword overrides, as Lightning's
    assert overridden.hparams["lr"] == 0.5
    _same_weights(overridden, trained)

    # Lightning's own call reads the marker object with torch.load: the error names the call to use
    with pytest.raises(Exception) as ei:
        Tiny.load_from_checkpoint(uri)
    assert TRAP in str(ei.value)
    with pytest.raises(NotATorchCheckpointError, match=r"objckpt\.lightning\.load_from_checkpoint\(MyModule, path\)"):
        Tiny.load_from_checkpoint(uri, weights_only=False)  # torch's advice leads here, not to "invalid load key"


def test_load_from_checkpoint_local_and_missing(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "local.ckpt")
    trained = _trained(path)
    loaded = load_from_checkpoint(Tiny, path, map_location="cpu", strict=True)
    _same_weights(loaded, trained)
    with pytest.raises(NotFoundError, match="nothing.ckpt"):
        load_from_checkpoint(Tiny, str(tmp_path / "nothing.ckpt"))
    with pytest.raises(TypeError, match="LightningModule"):
        load_from_checkpoint(dict, path)
