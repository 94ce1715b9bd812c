"""The package's shape, checked against ``docs/design.md``: every module sits in a row of its
Layers table, no module imports from a higher row, no two modules import each other (however
indirectly), planning stays pure, modules stay small.

The Layers table is the one statement of the layering: this test reads it (the rows between
the ``layers:begin`` and ``layers:end`` markers) and holds the code to it, so the table
cannot go stale (a new module, a moved one, a name that no longer exists all fail here,
named).  Read from the source (``ast``), so the test fails on the import that breaks a rule,
naming the module and the import, before any behaviour changes.
"""
from __future__ import annotations

import ast
import pathlib
import re

import objckpt

ROOT = pathlib.Path(objckpt.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"


def design_layers() -> list[tuple[int, list[str]]]:
    """(layer, names) per row of design.md's Layers table: names as written there
    (``units.py``, ``storage/s3/``, ``storage/__init__.py``), package-relative paths."""
    text = DESIGN.read_text()
    begin, end = text.index("<!-- layers:begin -->"), text.index("<!-- layers:end -->")
    rows = []
    for line in text[begin:end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        rows.append((int(cells[0]), re.findall(r"`([^`]+)`", cells[1])))
    return rows


def _table() -> dict[str, int]:
    """Each name of the table -> its layer; a name in two rows is an error."""
    out: dict[str, int] = {}
    for layer, names in design_layers():
        for n in names:
            assert n not in out, f"docs/design.md's Layers table names {n!r} in two rows"
            out[n] = layer
    return out


def _rel(module: str) -> str:
    """``storage.s3.direct`` -> ``storage/s3/direct.py``; a package's ``__init__`` stays a file."""
    return module.replace(".", "/") + ".py"


def layer_of(module: str, table: dict[str, int]) -> int:
    """The layer of a module: the table's longest name that is the module's file or a folder
    above it (``storage/__init__.py`` before ``storage/``, ``storage/s3/`` before ``storage/``)."""
    rel = _rel(module)
    best = ""
    for name in table:
        hit = rel == name if name.endswith(".py") else rel.startswith(name)
        if hit and len(name) > len(best):
            best = name
    if not best:
        raise LookupError(f"objckpt/{rel} is in no row of docs/design.md's Layers table; add it there")
    return table[best]


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for b in node.body for n in ast.walk(b) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


def _imports(module: str, path: pathlib.Path, *, run_only: bool = False) -> list[str]:
    """Package-relative names this module imports (absolute ``objckpt.x`` and relative ``.x``
    alike; imports inside functions too).  ``run_only``: leave out ``if TYPE_CHECKING:`` ones."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree) if run_only else set()
    pkg = module.split(".")[:-1]  # the package a relative import starts from ("save.__init__" -> save)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module + ".").startswith("objckpt."):
                target = node.module[len("objckpt."):]
            else:
                continue
            # each name as a possible module: ``from ..format import keys`` is format.keys,
            # ``from ..errors import X`` is errors (see _module_of)
            found.extend(f"{target}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend(a.name[len("objckpt."):] for a in node.names if a.name.startswith("objckpt."))
            found.extend("__init__" for a in node.names if a.name == "objckpt")
    return [f for f in found if f]


def _module_of(name: str, known: set[str]) -> str:
    """The module an imported name lives in: ``save.pipeline.prepare`` -> ``save.pipeline``,
    ``storage`` -> ``storage.__init__``."""
    while name:
        if name in known:
            return name
        if f"{name}.__init__" in known or (ROOT / name.replace(".", "/")).is_dir():
            return f"{name}.__init__"  # a package (or a namespace package: its folder's row)
        name = name.rpartition(".")[0]
    return "__init__"


def _graph(run_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    known = {m for m, _ in mods}
    return {m: {_module_of(i, known) for i in _imports(m, p, run_only=run_only)} - {m} for m, p in mods}


def test_every_module_is_in_the_layers_table_and_every_name_there_exists() -> None:
    table = _table()
    missing = []
    for module, _ in _modules():
        try:
            layer_of(module, table)
        except LookupError as e:
            missing.append(str(e))
    assert not missing, "; ".join(missing)
    stale = [n for n in table if not (ROOT / n).exists()]
    assert not stale, f"docs/design.md's Layers table names what does not exist: {stale}"


def test_no_module_imports_upward() -> None:
    table = _table()
    bad = []
    for module, deps in _graph(run_only=False).items():
        mine = layer_of(module, table)
        bad += [f"{module} (layer {mine}) imports {d} (layer {layer_of(d, table)})" for d in sorted(deps)
                if layer_of(d, table) > mine]
    assert not bad, "imports from a higher layer: " + "; ".join(bad)


def test_no_import_cycle() -> None:
    """No module reaches itself through what it imports when it runs (a cycle inside a
    layer is as hard to read as one across layers); ``TYPE_CHECKING`` imports do not run."""
    g = _graph(run_only=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"modules that import each other: {cycles}"


def _unit(module: str) -> str:
    """The top-level unit of a dotted module name inside the package (its first component)."""
    return module.split(".")[0]


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


#: the S3 modules that read the environment: the one configuration resolution and its parts
S3_ENV_READERS = {"config", "env_state", "setting", "retry_settings", "request_settings"}


def test_s3_reads_the_environment_in_one_place() -> None:
    """Every S3 setting from the environment is read when a store opens, by the configuration
    resolution, so the store cache (keyed on that environment) follows it; a module that read
    ``os.environ`` on its own would keep using a value the cache no longer stands for."""
    bad = []
    for module, path in _modules():
        parts = module.split(".")
        if parts[:2] == ["storage", "s3"] and parts[-1] not in S3_ENV_READERS:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                    bad.append(f"{module} line {node.lineno}: os.{node.attr}")
    assert not bad, "; ".join(bad)


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
        known = {m for m, _ in _modules()}
        bad += [f"{module} imports {imp}" for imp in _imports(module, path)
                if _unit(imp) == "testing" and _module_of(imp, known) not in {"testing.__init__", "testing.stores"}]
    assert not bad, "; ".join(bad)
    pyproject = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [p for p in include if fnmatch.fnmatch("testkit", p)], f"the wheel would hold testkit/: {include}"
