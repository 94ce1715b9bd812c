"""The walk of ``objckpt.read(uri)``: how many rooms, moves and climbs back one read takes.

A newcomer following one read through the code walks from module to module; the
fewer modules and the fewer jumps between them, the easier the read is to
follow.  This script measures that walk on a real read, not on the import graph.

How it counts (exactly):

1. A small checkpoint (two tensors, one tied alias, one plain value) is saved to
   a local directory; then a *fresh process* imports torch and objckpt, installs
   the profiler with :func:`sys.setprofile` and :func:`threading.setprofile`
   (so every thread the read starts is seen too: the storage coroutines run on
   objckpt's background loop thread, started by this first call) and calls
   ``objckpt.read(uri)`` once: the walk of a job's first read.
2. Only ``"call"`` events count (not returns, not C calls), and only for frames
   whose code lives in the ``objckpt`` package (its ``__name__`` starts with
   ``objckpt``).  Calls made while a module is being imported (a frame of
   ``importlib``'s bootstrap anywhere up the stack: a lazy import's module
   body) are ignored: they are the import's, not the read's.
3. For each such call the *caller module* is the module of the nearest frame up
   the Python stack (``f_back`` chain) that is also in ``objckpt``; a call with
   no objckpt frame above it (the first call, or a coroutine the event loop
   resumes at the top of its task) has no caller and makes no edge.
4. **moves**: the number of distinct directed edges (caller module -> called
   module) between two *different* modules (full dotted names:
   ``objckpt.load.pipeline`` -> ``objckpt.load.fill`` is a move; a call inside
   one module is not).  Each edge counts once, however often it is taken.
5. **rooms**: the number of distinct top-level units entered (the first
   component under ``objckpt``: ``api``, ``load``, ``layout``, ``storage``,
   ``format``, ``_runtime``...), the units of :data:`tests.test_layering.LAYERS`.
6. **climbs back**: the moves whose caller's unit sits in a *lower* layer of
   ``tests/test_layering.py``'s ``LAYERS`` than the called module's unit (a
   callback or a coroutine resumed upward: the walk goes back up the stack of
   layers).  A unit in no layer counts as the top layer.

Run it from a checkout (it reads that checkout's ``tests/test_layering.py``)::

    python benchmarks/read_walk.py            # or PYTHONPATH=<other tree> python <other tree>/benchmarks/read_walk.py
    python benchmarks/read_walk.py --edges    # also lists the edges

It prints one JSON object: ``rooms``, ``moves``, ``climbs_back`` and the lists behind them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
from types import FrameType
from typing import Any, Optional


def _layers(root: pathlib.Path) -> list[set[str]]:
    """``LAYERS`` from the checkout's ``tests/test_layering.py`` (lower layers first)."""
    spec = importlib.util.spec_from_file_location("_walk_layering", root / "tests" / "test_layering.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [set(x) for x in mod.LAYERS]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(layers: list[set[str]], module: str) -> int:
    """The layer of ``module`` (its unit's; a more specific dotted entry wins where the table has one)."""
    parts = module.split(".")[1:] or ["__init__"]
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for i, names in enumerate(layers):
            if name in names:
                return i
    return len(layers)


def _objckpt_module(frame: Optional[FrameType]) -> Optional[str]:
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and (name == "objckpt" or name.startswith("objckpt.")) else None


class Walk:
    """The calls recorded: distinct caller -> callee module edges, and the modules entered."""

    def __init__(self) -> None:
        self.edges: set[tuple[str, str]] = set()
        self.modules: set[str] = set()
        self._lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = _objckpt_module(frame)
        if callee is None:
            return
        caller: Optional[str] = None
        up: Optional[FrameType] = frame
        while up is not None:
            if up.f_code.co_filename.startswith("<frozen importlib"):
                return  # inside an import (a lazy import's module body), not the read
            if caller is None and up is not frame:
                caller = _objckpt_module(up)
            up = up.f_back
        with self._lock:
            self.modules.add(callee)
            if caller is not None and caller != callee:
                self.edges.add((caller, callee))


def save_checkpoint(uri: str) -> None:
    import torch

    import objckpt

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    objckpt.save({"model": {"w": w, "tied": w, "b": torch.ones(5)}, "step": 7}, uri)


def measure(uri: str) -> dict[str, Any]:
    """The walk of ``objckpt.read(uri)``, the first read of this process (call it in a fresh one)."""
    import torch

    import objckpt

    root = pathlib.Path(objckpt.__file__).resolve().parent.parent
    layers = _layers(root)
    walk = Walk()
    threading.setprofile(walk.profile)
    sys.setprofile(walk.profile)
    try:
        got = objckpt.read(uri)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert torch.equal(got["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4)) and got["step"] == 7
    climbs = sorted((a, b) for a, b in walk.edges if _layer(layers, a) < _layer(layers, b))
    rooms = sorted({_unit(m) for m in walk.modules})
    return {"rooms": len(rooms), "moves": len(walk.edges), "climbs_back": len(climbs),
            "room_names": rooms, "modules": sorted(walk.modules),
            "edges": sorted(f"{a} -> {b}" for a, b in walk.edges),
            "climb_edges": [f"{a} -> {b}" for a, b in climbs]}


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edges", action="store_true", help="also list the modules, edges and climbs")
    ap.add_argument("--measure", metavar="URI", help=argparse.SUPPRESS)  # the fresh process's part
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        uri = str(pathlib.Path(tmp) / "ckpt")
        save_checkpoint(uri)
        proc = subprocess.run([sys.executable, __file__, "--measure", uri], capture_output=True, text=True,
                              check=False)
    if proc.returncode:
        raise SystemExit(f"the measuring process failed:\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if not args.edges:
        out = {k: out[k] for k in ("rooms", "moves", "climbs_back", "room_names")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
