"""The package's shape, checked: no module imports upward, planning stays pure, modules stay small.

Read from the source (``ast``), so the test fails on the import that breaks a
rule, naming the module and the import, before any behaviour changes.
"""
from __future__ import annotations

import ast
import pathlib

import objckpt

ROOT = pathlib.Path(objckpt.__file__).parent

#: lower layers first; a module may import its own layer and the layers below it
LAYERS: list[set[str]] = [
    {"units", "errors", "_version", "checksum", "runtime", "options", "logs"},
    {"format", "results"},
    {"planning"},
    {"storage"},
    {"distributed", "state", "testing"},
    {"layout"},
    {"save", "load"},
    {"ops", "tier"},
    {"api"},
    {"manager", "integrations"},
    {"__init__", "dcp", "lightning"},
    {"cli", "__main__"},
]


def _unit(module: str) -> str:
    """The layer unit of a dotted module name inside the package (its first component)."""
    return module.split(".")[0]


def _layer(unit: str) -> int:
    for i, names in enumerate(LAYERS):
        if unit in names:
            return i
    raise AssertionError(f"module {unit!r} is in no layer of tests/test_layering.py; add it")


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def _imports(module: str, path: pathlib.Path) -> list[str]:
    """Package-relative names this module imports (absolute ``objckpt.x`` and relative ``.x`` alike)."""
    tree = ast.parse(path.read_text())
    pkg = module.split(".")[:-1]  # the package a relative import starts from ("save.__init__" -> save)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = ".".join(base + ([node.module] if node.module else []))
                if not node.module:  # from . import x
                    found.extend(f"{target}.{a.name}".lstrip(".") for a in node.names)
                    continue
                found.append(target)
            elif node.module and node.module.startswith("objckpt."):
                found.append(node.module[len("objckpt."):])
        elif isinstance(node, ast.Import):
            found.extend(a.name[len("objckpt."):] for a in node.names if a.name.startswith("objckpt."))
    return [f for f in found if f]


def test_no_module_imports_upward() -> None:
    bad = []
    for module, path in _modules():
        mine = _layer(_unit(module))
        for imp in _imports(module, path):
            if _layer(_unit(imp)) > mine:
                bad.append(f"{module} imports {imp}")
    assert not bad, "imports from a higher layer: " + "; ".join(bad)


def test_planning_is_pure() -> None:
    """Planning modules do no I/O and keep no process-global state."""
    bad = []
    for module, path in _modules():
        if _unit(module) != "planning":
            continue
        src = path.read_text()
        tree = ast.parse(src)
        for imp in _imports(module, path):
            if _unit(imp) == "storage" or imp.startswith("runtime.loop"):
                bad.append(f"{module} imports {imp}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and
                                                         node.module else [])
                if any(n in {"asyncio", "socket", "aiohttp", "aiobotocore", "lru_cache", "cache"} for n in names):
                    bad.append(f"{module} imports {names}")
        for node in tree.body:  # module-level mutable containers are caches in waiting
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Dict, ast.List,
                                                                                            ast.Set, ast.Call)):
                call = node.value
                if isinstance(call, ast.Call) and not (isinstance(call.func, ast.Name) and call.func.id in {
                        "frozenset", "tuple"}):
                    bad.append(f"{module}:{node.lineno} builds a module-level object")
                elif not isinstance(call, ast.Call):
                    bad.append(f"{module}:{node.lineno} holds a module-level container")
        if any(isinstance(n, ast.Global) for n in ast.walk(tree)):
            bad.append(f"{module} rebinds a global")
    assert not bad, "; ".join(bad)


def test_modules_stay_small() -> None:
    big = [f"{m} ({n} lines)" for m, p in _modules() if (n := len(p.read_text().splitlines())) > 600]
    assert not big, f"modules over 600 lines: {big}"


def test_s3_is_one_package() -> None:
    """storage/ has one S3 pipeline, in storage/s3/: no other storage module speaks HTTP
    or imports an S3 client, and the rest of objckpt reaches S3 only through the store."""
    clients = {"socket", "ssl", "botocore", "aiobotocore", "aiohttp", "boto3"}
    bad = []
    for module, path in _modules():
        parts = module.split(".")
        if parts[0] == "storage" and parts[1:2] != ["s3"]:
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
                bad += [f"{module} imports {n}" for n in names if n.split(".")[0] in clients]
        if parts[0] != "storage":
            bad += [f"{module} imports {imp}" for imp in _imports(module, path)
                    if imp.startswith("storage.s3.") and not imp.startswith("storage.s3.store")]
    assert not bad, "; ".join(bad)
    assert not [p for p in (ROOT / "storage").glob("*.py") if p.stem.startswith(("s3_", "sigv4", "wire", "http_"))]


def test_test_kit_is_not_installed() -> None:
    """The S3 server, fault campaign, proxies and meters live in the checkout's testkit/, which
    the wheel leaves out: objckpt.testing holds only the public test doubles, and no installed
    module imports the kit (a user's import of objckpt never starts a server or kills a process)."""
    import fnmatch
    import tomllib

    assert sorted(p.name for p in (ROOT / "testing").glob("*.py")) == ["__init__.py", "stores.py"]
    bad = []
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            bad += [f"{module} imports {n}" for n in names if n.split(".")[0] == "testkit"]
        bad += [f"{module} imports {imp}" for imp in _imports(module, path)
                if _unit(imp) == "testing" and imp not in {"testing", "testing.stores"}]
    assert not bad, "; ".join(bad)
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in include if fnmatch.fnmatch("testkit", p)], f"the wheel would hold testkit/: {include}"
