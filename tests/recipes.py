"""The examples' recipes (examples/integrations/), loaded as modules by the tests that run them."""
from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

RECIPES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations"


def load_recipe(file: str, name: str) -> ModuleType:
    """``examples/integrations/<file>`` imported as module ``name`` (each call a fresh module)."""
    spec = importlib.util.spec_from_file_location(name, RECIPES / file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the recipe {RECIPES / file}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
