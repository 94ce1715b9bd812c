"""One read session: every reader opens a checkpoint through ``objckpt.load.session``.

``load``, ``read``, ``inspect``, ``diff``, ``copy``, ``objckpt verify`` and the DCP reader
take the store, the prefix, the manifest and the stored keys (a tied tensor's bytes are
its target's) from one :class:`ReadSession`, so they cannot disagree on where a
checkpoint is or which bytes a key names.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import objckpt
import objckpt.dcp
from objckpt.load.session import ReadSession, open_location
from objckpt.ops.verify import verify_checkpoint
from objckpt.storage.memory import MemoryStore

ROOT = pathlib.Path(objckpt.__file__).parent


def _state() -> dict[str, Any]:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"w": w, "tied": w, "b": torch.full((5,), 2.0, dtype=torch.bfloat16), "step": 7}


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(uri, prefix) of every manifest a read session fetches from now on."""
    seen: list[tuple[str, str]] = []
    real = ReadSession.refresh

    def spy(self: ReadSession, *args: Any, **kwargs: Any) -> Any:
        seen.append((self.uri, self.prefix))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ReadSession, "refresh", spy)
    return seen


def test_every_reader_fetches_its_manifest_through_the_session(tmp_path: pathlib.Path,
                                                                 sessions: list[tuple[str, str]]) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    objckpt.save(_state(), a)
    objckpt.save(_state(), b)
    readers = {
        "read": lambda: objckpt.read(a),
        "inspect": lambda: objckpt.inspect(a),
        "load": lambda: objckpt.load({"w": torch.zeros(3, 4), "tied": torch.zeros(3, 4),
                                      "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}, a),
        "diff": lambda: objckpt.diff(a, b),
        "copy": lambda: objckpt.copy(a, str(tmp_path / "c")),
        "verify": lambda: verify_checkpoint(ReadSession(a), 1 << 20),
        "dcp": lambda: objckpt.dcp.StorageReader(a).read_metadata(),
    }
    for name, call in readers.items():
        before = len(sessions)
        call()
        assert any(uri == a for uri, _ in sessions[before:]), f"{name} did not read through the session"


def test_a_store_and_a_prefix_resolve_keys_alike_in_every_reader(sessions: list[tuple[str, str]]) -> None:
    """A caller's store with the URI's path as prefix, tied keys, and a template whose keys carry
    torch's wrapper prefix: every reader finds the same bytes under the same keys."""
    store = MemoryStore()
    a, b, c = "mem://bucket/runs/a", "mem://bucket/runs/b", "mem://bucket/runs/copy"
    objckpt.save(_state(), a, store=store)
    objckpt.save(_state(), b, store=store)
    assert open_location(a, None, store) == (store, "runs/a")

    m = objckpt.inspect(a, store=store)
    assert m.tensors["tied"].alias_of == "w"
    got = objckpt.read(a, store=store)
    assert got["tied"] is got["w"] and torch.equal(got["w"], _state()["w"]) and got["step"] == 7
    assert objckpt.read(a, ["tied"], store=store)["tied"].equal(_state()["w"])

    template = {"module.w": torch.zeros(3, 4), "module.tied": torch.zeros(3, 4),
                "module.b": torch.zeros(5, dtype=torch.bfloat16), "module.step": 0}
    objckpt.load(template, a, store=store)  # the wrapper's prefix on one side only: matched without it
    assert torch.equal(template["module.tied"], _state()["w"]) and template["module.step"] == 7

    assert objckpt.diff(a, b, a_store=store, b_store=store).equal
    objckpt.copy(a, c, src_store=store, dst_store=store)
    copied = ReadSession(c, store=store)
    assert copied.stored_key("tied") == "w" and torch.equal(copied.read("tied"), _state()["w"])
    rep = verify_checkpoint(ReadSession(a, store=store), 1 << 20)
    assert rep.tensors == 3 and rep.nbytes == m.nbytes()
    assert {p for _, p in sessions} >= {"runs/a", "runs/b", "runs/copy"}


def test_only_the_session_opens_a_checkpoint_and_resolves_stored_keys() -> None:
    """The helpers that were written twice (``api._open`` / ``open_uri``, ``_stored_key``)
    exist once, in load/session.py; no other reader decodes a fetched manifest itself."""
    again = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "load/session.py":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in {
                    "open_uri", "open_location", "_stored_key", "stored_key", "_fetch_manifest",
                    "fetch_manifest", "manifest_bytes"}:
                again.append(f"{rel}: def {node.name}")
        for node in ast.walk(tree):  # a given store's prefix taken from the URI again (api._open, copy, diff did)
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", getattr(node.value.func, "attr", "")) == "split_uri"
                    and isinstance(node.slice, ast.Constant) and node.slice.value == 2):
                again.append(f"{rel}:{node.lineno} takes a given store's prefix from the URI itself")
    assert not again, again
    assert not (ROOT / "integrations" / "reading.py").exists()


_FRESH = textwrap.dedent("""
    import sys
    entry, a, b, out = sys.argv[1:]
    if entry == "read":
        import objckpt
        got = objckpt.read(a)
        assert got["tied"] is got["w"] and got["step"] == 7
        assert objckpt.inspect(a).tensors["tied"].alias_of == "w"
    elif entry == "load":
        from objckpt.load.pipeline import load_into  # the load's own module first: no import cycle
        import torch, objckpt
        t = {"w": torch.zeros(3, 4), "tied": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16),
             "step": 0}
        objckpt.load(t, a)
        assert t["tied"][2, 3].item() == 11.0 and t["step"] == 7
    elif entry == "ops":
        from objckpt.ops.verify import verify_checkpoint  # an operation's module first
        from objckpt.load.session import ReadSession
        assert verify_checkpoint(ReadSession(a), 1 << 20).tensors == 3
        from objckpt.ops.diff import diff
        from objckpt.ops.copy import copy
        assert diff(a, b).equal
        copy(a, out)
        from objckpt.integrations.dcp import StorageReader
        assert "w" in StorageReader(a).read_metadata().state_dict_metadata
    print("ok", entry)
""")


def test_each_entry_point_reads_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    """Each reader's module imported first, in a process of its own: no import cycle through
    the session, and the first read of a process takes the same path as any other."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    objckpt.save(_state(), a)
    objckpt.save(_state(), b)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    procs = {entry: subprocess.Popen([sys.executable, "-c", _FRESH, entry, a, b, str(tmp_path / f"out-{entry}")],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for entry in ("read", "load", "ops")}
    failed = {}
    for entry, p in procs.items():
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0 or f"ok {entry}" not in out:
            failed[entry] = out[-2000:]
    assert not failed, failed
    assert objckpt.read(str(tmp_path / "out-ops"))["step"] == 7
