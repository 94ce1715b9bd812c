"""Small things a user hits within the first hour: glob reads, cast refusals, DCP directories,
``objckpt info | head``, mypy under an editable install, packed fp4, the read log's count."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import zipfile
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import MissingKeyError, NotFoundError, StateDictMismatchError
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore

ROOT = pathlib.Path(objckpt.__file__).parent.parent


def _lora_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for i in range(4):
        sd[f"layers.{i}.attn.w"] = torch.randn(512, 1024, generator=g)  # 2 MiB each
        sd[f"layers.{i}.attn.lora_A"] = torch.randn(8, 1024, generator=g)  # 32 KiB
        sd[f"layers.{i}.attn.lora_B"] = torch.randn(1024, 8, generator=g)
    return sd


def test_read_glob_returns_and_fetches_only_the_matching_tensors(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/ck"
    sd = _lora_state()
    objckpt.save({"model": sd, "step": 7}, uri, storage_options=opts)
    m = objckpt.inspect(uri, storage_options=opts)
    counting = CountingStore(open_store(uri, opts)[0])
    out = objckpt.read(uri, keys="model.*lora*", store=counting)
    lora = sorted(f"model.{k}" for k in sd if "lora" in k)
    assert sorted(out) == lora
    assert all(torch.equal(out[f"model.{k}"], sd[k]) for k in sd if "lora" in k)
    # every byte fetched lies in a lora tensor's chunk (plus merge slack between them), none in a weight's
    weights = [(m.blob_key("ck", c.blob), c.offset, c.offset + c.length)
               for k, e in m.tensors.items() if k.endswith(".w") for c in e.chunks]
    for key, off, n in counting.ranges:
        assert not any(key.endswith(b.split("ck/", 1)[1]) and off < hi and lo < off + n for b, lo, hi in weights)
    lora_bytes = sum(sd[k].numel() * 4 for k in sd if "lora" in k)
    assert sum(n for _, _, n in counting.ranges) <= lora_bytes + 4 * (256 << 10)
    # a glob next to a subtree and a value; a glob matching nothing is named
    both = objckpt.read(uri, keys=["model.layers.[0-1].attn.lora_B", "step"], storage_options=opts)
    assert sorted(both) == ["model.layers.0.attn.lora_B", "model.layers.1.attn.lora_B", "step"] and both["step"] == 7
    with pytest.raises(MissingKeyError, match=r"glob pattern\(s\) \['model\.\*nope\*'\] match no key"):
        objckpt.read(uri, keys=["model.*nope*"], storage_options=opts)


def test_subtree_read_logs_the_tensors_it_read(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"optim": {str(i): torch.ones(2) for i in range(6)}, "w": torch.ones(3)}, uri)
    with caplog.at_level(logging.INFO, logger="objckpt.load"):
        assert len(objckpt.read(uri, "optim")["optim"]) == 6
    assert ": 6 tensors," in caplog.text, caplog.text


def test_cast_refusal_says_it_covers_floating_dtypes_only(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"c": torch.ones(3, dtype=torch.complex64), "i": torch.ones(3, dtype=torch.int64)}, uri)
    for key, have in (("c", torch.complex128), ("i", torch.float32)):
        with pytest.raises(StateDictMismatchError, match=rf"'{key}'.*cast=True converts between floating dtypes only"):
            objckpt.load({key: torch.zeros(3, dtype=have)}, uri, cast=True, strict=False)


def test_reading_a_dcp_directory_suggests_convert(tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(4)}, checkpoint_id=path)
    for call in (lambda: objckpt.read(path), lambda: objckpt.load({"w": torch.zeros(4)}, path)):
        with pytest.raises(NotFoundError, match=r"DCP\) directory.*objckpt convert"):
            call()
    with pytest.raises(NotFoundError) as ei:  # an empty directory is just "no checkpoint"
        objckpt.read(str(tmp_path))
    assert "convert" not in str(ei.value)


def test_packed_fp4_round_trips_as_its_bytes(tmp_path: Any) -> None:
    from objckpt.format.manifest import encode

    import jsonschema

    fp4 = torch.float4_e2m1fn_x2
    raw = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    uri = str(tmp_path / "ck")
    objckpt.save({"w": raw.view(fp4), "cols": raw.view(fp4)[:, 3:9]}, uri)
    m = objckpt.inspect(uri)
    assert m.tensors["w"].dtype == "float4_e2m1fn_x2" and m.tensors["w"].shape == (16, 32)
    schema = json.loads((ROOT / "objckpt" / "format" / "manifest.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(encode(m, compress=False)))
    got = objckpt.read(uri)
    assert got["w"].dtype == fp4 and torch.equal(got["w"].view(torch.uint8), raw)
    dst = {"w": torch.empty(16, 32, dtype=fp4), "cols": torch.empty(16, 6, dtype=fp4)}
    objckpt.load(dst, uri)
    assert torch.equal(dst["cols"].view(torch.uint8), raw[:, 3:9])
    with pytest.raises(StateDictMismatchError, match="floating dtypes only"):  # torch converts fp4 to nothing
        objckpt.load({"w": torch.empty(16, 32)}, uri, cast=True, strict=False)


def test_info_into_a_closed_pipe_ends_without_a_traceback(tmp_path: Any) -> None:
    """``objckpt info --all ... | head -1``: the reader leaves after one line of some 160 KB (more
    than a pipe holds, so the command is still writing when the pipe closes)."""
    uri = str(tmp_path / "ck")
    name = "encoder.layers.{:04d}.self_attention.query_key_value.some_rather_long_parameter_name.weight"
    objckpt.save({name.format(i): torch.zeros(1) for i in range(1200)}, uri)
    code = "import sys; from objckpt.cli import main; sys.exit(main())"
    p = subprocess.Popen([sys.executable, "-c", code, "info", "--all", uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=str(tmp_path))
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline().decode().strip() == uri
    p.stdout.close()  # what head does after its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_mypy_finds_the_package_under_an_editable_install(tmp_path: Any) -> None:
    """``pip install -e .`` as the README says, into a fresh environment: mypy resolves
    ``import objckpt`` there (setuptools' import-hook editable install hid it from mypy)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    os.symlink(ROOT / "objckpt", src / "objckpt")
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_editable(sys.argv[1]))")
    p = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=str(src), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    wheel = tmp_path / "dist" / p.stdout.strip().splitlines()[-1]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True, timeout=60)
    py = str(tmp_path / "env" / "bin" / "python")
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    zipfile.ZipFile(wheel).extractall(purelib)  # what pip does with the wheel it builds
    user = tmp_path / "user.py"
    user.write_text("import objckpt\nreveal_type(objckpt.read)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}  # only the install
    p = subprocess.run([sys.executable, "-m", "mypy", "--python-executable", py, "--follow-imports=silent",
                        "--cache-dir", str(tmp_path / "cache"), "--no-color-output", str(user)],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=240, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "import-not-found" not in out, out
    assert 'Revealed type is "def (uri: builtins.str' in out or "def (uri: str" in out, out


def test_reads_work_with_deterministic_algorithms_on(tmp_path: Any) -> None:
    """Lightning's deterministic=True turns on torch.use_deterministic_algorithms, under which
    torch.empty of a packed dtype raises; read() and load() must still allocate their tensors."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    state = {"w": torch.arange(6, dtype=torch.float32)}
    if fp4 is not None:
        state["p"] = torch.arange(4, dtype=torch.uint8).view(fp4)
    uri = str(tmp_path / "ck")
    objckpt.save(state, uri)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = objckpt.read(uri)
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(got["w"], state["w"])
    if fp4 is not None:
        assert got["p"].dtype == fp4 and torch.equal(got["p"].view(torch.uint8), state["p"].view(torch.uint8))
