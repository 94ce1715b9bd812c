"""The public API type-checks from a user's point of view (``mypy --strict``), and ships ``py.typed``."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import objckpt

ROOT = pathlib.Path(objckpt.__file__).parent.parent
DATA = pathlib.Path(__file__).parent / "data"


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "objckpt" / "py.typed").is_file()
    assert re.search(r'objckpt = \[[^\]]*"py\.typed"', (ROOT / "pyproject.toml").read_text())


def test_user_script_passes_mypy_strict_and_wrong_calls_fail(tmp_path: Any) -> None:
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(DATA / "mypy_user.ini"), "--cache-dir",
           str(tmp_path / "cache"), "--no-color-output", "--show-error-codes",
           str(DATA / "typed_user.py"), str(DATA / "typed_user_wrong.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out  # errors found (2 would be a crash or a config error)
    assert "typed_user.py:" not in out.replace("typed_user_wrong.py:", ""), out  # the right script is clean
    wrong = (DATA / "typed_user_wrong.py").read_text().splitlines()
    expected = {i + 1 for i, line in enumerate(wrong) if "# E" in line}
    reported = {int(n) for n in re.findall(r"typed_user_wrong\.py:(\d+): error", out)}
    assert expected == reported, out
    assert 'read_strategy" to "load"' in out and "Literal['auto', 'direct', 'broadcast', 'allgather']" in out
