"""The recipes of docs/integrations.md's DCP, convert and Hugging Face sections, run against moto S3."""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

import pytest

RECIPES = pathlib.Path(__file__).resolve().parent.parent / "examples" / "integrations"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _run(name: str, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return int(mod.main(argv))


@pytest.mark.parametrize("name", ["dcp_plugin", "convert", "hf_export"])
def test_recipe_runs_against_moto(name: str, moto_s3: tuple[str, dict[str, Any]], capsys: Any) -> None:
    import objckpt

    bucket, opts = moto_s3
    prefix = f"s3://{bucket}/recipes/{name}"
    assert _run(name, [prefix, "--endpoint-url", opts["endpoint_url"]]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("ok:")
    # what the recipe left behind is real, committed objckpt checkpoints
    found = [p for p in ("step-100", "step-101", "from-dcp", "from-safetensors", "from-torch-save", "step-1000")
             if _exists(f"{prefix}/{p}", opts)]
    assert found, "the recipe committed no checkpoint"
    for p in found:
        assert objckpt.inspect(f"{prefix}/{p}", storage_options=opts).tensors


def _exists(uri: str, opts: dict[str, Any]) -> bool:
    import objckpt

    try:
        objckpt.inspect(uri, storage_options=opts, chunks=False)
        return True
    except objckpt.NotFoundError:
        return False
