"""What installing objckpt pulls in: only what the library itself imports.

Read from the source (``ast``) and pyproject.toml: every third-party module the
library imports is a core dependency (or comes with one: botocore with
aiobotocore); what only the test rig (``objckpt.testing``), the demo or the
optional integrations import is in an extra.  boto3 was a core dependency that
no library module used.
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys
import tomllib

import objckpt

ROOT = pathlib.Path(objckpt.__file__).parent
PYPROJECT = ROOT.parent / "pyproject.toml"
#: import name -> the distribution that provides it, where they differ or one brings the other
PROVIDED_BY = {"botocore": "aiobotocore", "typing_extensions": "typing-extensions", "crc32c": "crc32c"}
#: parts of the package that only tests, the demo and benchmarks use
OUTSIDE_CORE = ("testing/", "cli/demo.py", "cli/bench.py")


def _third_party_imports() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith(OUTSIDE_CORE):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "objckpt":
                    found.setdefault(top, set()).add(rel)
    return found


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_core_dependencies_are_what_the_library_imports() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    core = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    in_extras = set().union(*(_names(v) for v in extras.values()))
    used: set[str] = set()
    for module, where in _third_party_imports().items():
        dist = PROVIDED_BY.get(module, module).lower().replace("_", "-")
        used.add(dist)
        if dist not in core:  # an optional integration's own library: in an extra, imported there only
            assert dist in in_extras and all(w.startswith("integrations/") for w in where), (module, where)
    assert core <= used, f"core dependencies no library module imports (move them to an extra): {sorted(core - used)}"
    for extra in ("test", "demo", "bench"):  # the rig, the demo and benchmarks set up buckets with boto3
        assert "boto3" in _names(extras[extra]), extra
