"""The crc32c implementation objckpt hashes with agrees with the ``crc32c`` package (the
reference) byte for byte, and a build that disagrees is never used."""
from __future__ import annotations

import logging
import os
import random
import sys
import threading
import types

import pytest
import torch

from objckpt import checksum
from objckpt.checksum import REFERENCE, crc32c


def test_fast_implementation_is_the_one_in_use_where_installed(monkeypatch):
    """The test environment installs ``crc32c_rs`` on Python >= 3.11 (pyproject's marker), so
    the suite exercises the implementation users get; older Pythons use the reference."""
    want = "crc32c_rs" if sys.version_info >= (3, 11) else "crc32c"
    assert checksum.IMPLEMENTATION == want
    monkeypatch.delenv(checksum.IMPLEMENTATION_ENV, raising=False)
    assert checksum._fastest()[1] == want


def test_the_environment_can_force_the_reference_in_a_new_process():
    import subprocess

    code = "import objckpt.checksum as c; print(c.IMPLEMENTATION)"
    for value, want in (("crc32c", "crc32c"), ("CRC32C", "crc32c"), ("auto", checksum.IMPLEMENTATION)):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OBJCKPT_CRC32C": value},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == want, value
    bad = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OBJCKPT_CRC32C": "fastest"},
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "OBJCKPT_CRC32C='fastest'" in bad.stderr


@pytest.mark.parametrize("seed", range(4))
def test_parity_with_the_reference_on_random_buffers(seed):
    rng = random.Random(seed)
    data = memoryview(rng.randbytes(3 << 20))
    for _ in range(200):
        at = rng.randrange(0, 4096)
        n = rng.choice([rng.randrange(0, 64), rng.randrange(0, 70_000), rng.randrange(0, 3 << 20)])
        view = data[at:at + n]
        start = rng.choice([0, rng.getrandbits(32)])
        assert crc32c(view, start) == REFERENCE(view, start), (at, n, start)


def test_continuation_matches_one_pass():
    data = random.Random(9).randbytes(1 << 20)
    whole = REFERENCE(data)
    for cut in (0, 1, 63, 4096, 65_537, len(data)):
        assert crc32c(data[cut:], crc32c(data[:cut])) == whole


def test_typed_views_and_mappings_hash_as_their_bytes():
    """Chunks are hashed through views of tensors of any dtype and of mmaps."""
    import mmap

    t = torch.randn(12_345, dtype=torch.float32)
    mv = memoryview(t.numpy())
    assert mv.format == "f"
    assert crc32c(mv) == REFERENCE(t.numpy().tobytes())
    b = torch.randn(999).to(torch.bfloat16).view(torch.int16)
    assert crc32c(memoryview(b.numpy())) == REFERENCE(b.numpy().tobytes())
    m = mmap.mmap(-1, 8192)
    m[:5] = b"hello"
    assert crc32c(m) == REFERENCE(bytes(m))


def test_threads_hash_in_parallel_and_agree():
    """Readers hash on several threads at once (the GIL is released): every thread's result is exact."""
    bufs = [random.Random(i).randbytes(2 << 20) for i in range(4)]
    out: dict[int, int] = {}

    def run(i: int) -> None:
        for _ in range(5):
            out[i] = crc32c(memoryview(bufs[i]))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == {i: REFERENCE(bufs[i]) for i in range(4)}


def test_a_disagreeing_build_is_refused(monkeypatch, caplog):
    """A ``crc32c_rs`` that miscomputes (a broken wheel, a CPU path with a bug) is not used:
    the reference is, and a warning says so."""
    fake = types.ModuleType("crc32c_rs")
    fake.__version__ = "9.9.9"  # type: ignore[attr-defined]
    fake.crc32c = lambda data, value=0: REFERENCE(data, value) ^ (1 if len(data) == 257 else 0)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "crc32c_rs", fake)
    with caplog.at_level(logging.WARNING, logger="objckpt.checksum"):
        fn, name = checksum._fastest()
    assert (fn, name) == (REFERENCE, "crc32c")
    assert "crc32c_rs 9.9.9 disagrees" in caplog.text


def test_a_build_that_cannot_run_is_refused(monkeypatch):
    fake = types.ModuleType("crc32c_rs")

    def boom(data, value=0):
        raise RuntimeError("required CPU feature missing")

    fake.crc32c = boom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "crc32c_rs", fake)
    assert checksum._fastest() == (REFERENCE, "crc32c")


def test_absent_fast_build_uses_the_reference(monkeypatch):
    monkeypatch.setitem(sys.modules, "crc32c_rs", None)  # import raises ImportError
    assert checksum._fastest() == (REFERENCE, "crc32c")
