"""Fresh load destinations: huge-page advice by default (not on a guest whose balloon
reports free pages to its host, ``OBJCKPT_HUGE_PAGES`` overriding), pre-faulting when
asked (``prefault.POPULATE``); neither changes a byte nor is needed for correctness.

``MADV_POPULATE_WRITE`` maps pages without writing them, so populating memory that
already holds data (or receives it at the same time) must leave it as it is.  The
loads here run with the size threshold lowered, so small tensors take the path a
1 GiB restore takes, and with populating on unless a test says otherwise.
"""
from __future__ import annotations

import concurrent.futures
import sys

import pytest
import torch

import objckpt
from objckpt.load import prefault
from objckpt.runtime.memory import host_bytes


@pytest.fixture
def small_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "MIN_BYTES", 0)
    monkeypatch.setattr(prefault, "STEP", 64 << 10)  # many pieces, several threads at once
    monkeypatch.setattr(prefault, "POPULATE", True)


def test_populate_keeps_contents(small_threshold: None) -> None:
    t = torch.arange(1 << 20, dtype=torch.int64)  # 8 MiB, written
    before = t.clone()
    job = prefault.start([host_bytes(t)])
    if job is not None:
        job.close()
    assert torch.equal(t, before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice of Linux")
def test_populate_unaligned_slices(small_threshold: None) -> None:
    t = torch.full((3 << 20,), 7, dtype=torch.uint8)
    view = host_bytes(t)
    job = prefault.start([view[1:5000], view[4097:(2 << 20) + 3], view[-1:]])
    if job is not None:
        job.close()
    assert bool((t == 7).all())


def test_disabled_and_tiny_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.empty(1 << 20)
    assert prefault.start([host_bytes(t)]) is None  # below MIN_BYTES
    monkeypatch.setattr(prefault, "MIN_BYTES", 0)
    monkeypatch.setattr(prefault, "ENABLED", False)
    assert prefault.start([host_bytes(t)]) is None


def test_tensor_memory_skips_what_is_not_plain_host() -> None:
    plain, strided, empty = torch.zeros(4, 4), torch.zeros(4, 4).t(), torch.zeros(0)
    got = list(prefault.tensor_memory([plain, strided, empty, torch.empty(3, device="meta"), "value"]))
    assert len(got) == 1 and len(got[0]) == plain.numel() * 4


def test_only_destinations_the_advice_can_use_are_viewed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With populating off (the default) only tensors of HUGE_MIN bytes or more can be
    advised, so a load hands start() only those: thousands of small tensors cost no views."""
    small, large = torch.zeros(1024), torch.zeros(prefault.HUGE_MIN // 4)
    assert prefault.POPULATE is False and prefault.smallest_used() == prefault.HUGE_MIN
    got = list(prefault.tensor_memory([small, large, small], prefault.smallest_used()))
    assert [len(v) for v in got] == [prefault.HUGE_MIN]
    monkeypatch.setattr(prefault, "POPULATE", True)  # populating touches every destination: all of them
    assert prefault.smallest_used() == 0
    assert len(list(prefault.tensor_memory([small, large, small], prefault.smallest_used()))) == 3


@pytest.mark.parametrize("fresh", [True, False])
def test_load_with_prefault_round_trips(small_threshold: None, tmp_path, fresh: bool) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(300, 257, generator=g), "b": torch.randn(64, generator=g),
             "t": torch.randn(40, 30, generator=g).t(), "i": torch.randint(0, 9, (1000,), generator=g)}
    uri = str(tmp_path / "ck")
    objckpt.save(state, uri)
    if fresh:
        dest = {k: torch.empty_like(v) for k, v in state.items()}
    else:
        dest = {k: torch.full_like(v, 3) for k, v in state.items()}
    objckpt.load(dest, uri)
    for k, v in state.items():
        assert torch.equal(dest[k], v), k
    assert torch.equal(objckpt.read(uri, keys=["a"])["a"], state["a"])


def test_odd_buffers_never_fail_a_load(small_threshold: None) -> None:
    def views():
        yield host_bytes(torch.zeros(8))
        raise RuntimeError("a template walk that fails")

    assert prefault.start(views()) is None


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0] if "[" in text else "absent"


def _huge_kib(addr: int, length: int) -> int:
    """AnonHugePages (KiB) of the mappings overlapping [addr, addr + length)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + length and hi > addr
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_fresh_large_destination_is_backed_by_huge_pages(small_threshold: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh 64 MiB destination advised MADV_HUGEPAGE is mapped 2 MiB at a time
    (where THP is on "madvise" or "always"), and keeps the bytes written after."""
    import mmap

    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "on")
    mm = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # fresh pages for sure (torch.empty may reuse freed, mapped heap)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    view = host_bytes(t)
    addr = prefault.address(view)
    job = prefault.start([view])
    assert job is not None
    concurrent.futures.wait(job.futures)  # every piece populated (close() would cancel the rest)
    job.close()
    if _thp_mode() in ("madvise", "always"):
        assert _huge_kib(addr, len(view)) >= 32 << 10  # at least half of it
    t.fill_(3)
    assert int(t.sum()) == 3 * (64 << 20)
    del t, view


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_by_default_only_huge_pages_are_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default starts no thread and maps nothing; the advice (here on a host that
    takes no free pages back) makes the first writes map the fresh destination 2 MiB at
    a time."""
    import mmap

    monkeypatch.setattr(prefault, "MIN_BYTES", 0)
    monkeypatch.delenv(prefault.HUGE_PAGES_ENV, raising=False)
    monkeypatch.setattr(prefault, "host_takes_free_pages", lambda sysfs="/sys": False)
    assert prefault.POPULATE is False
    mm = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    view = host_bytes(t)
    addr = prefault.address(view)
    assert prefault.start([view]) is None
    assert _huge_kib(addr, len(view)) == 0  # nothing mapped yet
    t.fill_(5)
    if _thp_mode() in ("madvise", "always"):
        assert _huge_kib(addr, len(view)) >= 32 << 10
    assert int(t.sum()) == 5 * (64 << 20)
    del t, view


def _fake_virtio(root, devices: dict[str, tuple[str, str]]) -> str:
    """A sysfs tree with virtio devices ``name: (device id, features bits)``."""
    for name, (device, features) in devices.items():
        d = root / "bus" / "virtio" / "devices" / name
        d.mkdir(parents=True)
        (d / "device").write_text(device + "\n")
        (d / "features").write_text(features + "\n")
    return str(root)


def test_balloon_with_free_page_reporting_is_found(tmp_path) -> None:
    """Only a balloon (device 0x0005) with feature bit 5 (free page reporting) counts;
    another device with that bit, or a balloon without it, does not."""
    bits = "0110010100000000000000000000000010000000"
    no_report = bits[:5] + "0" + bits[6:]
    assert prefault.host_takes_free_pages(_fake_virtio(tmp_path / "a", {"virtio0": ("0x0005", bits)}))
    assert not prefault.host_takes_free_pages(_fake_virtio(tmp_path / "b", {"virtio0": ("0x0005", no_report)}))
    assert not prefault.host_takes_free_pages(_fake_virtio(tmp_path / "c", {"virtio0": ("0x0001", bits),
                                                                            "virtio1": ("0x0002", bits)}))
    assert prefault.host_takes_free_pages(_fake_virtio(tmp_path / "d", {"virtio0": ("0x0001", no_report),
                                                                        "virtio3": ("0x0005", bits)}))
    assert not prefault.host_takes_free_pages(str(tmp_path / "no-sysfs"))
    broken = tmp_path / "e" / "bus" / "virtio" / "devices" / "virtio0"
    broken.mkdir(parents=True)
    (broken / "device").write_text("not hex")
    assert not prefault.host_takes_free_pages(str(tmp_path / "e"))


def test_huge_pages_setting_is_read_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    reports = [True]
    monkeypatch.setattr(prefault, "host_takes_free_pages", lambda sysfs="/sys": reports[0])
    monkeypatch.delenv(prefault.HUGE_PAGES_ENV, raising=False)
    assert prefault.huge_pages_wanted() is False  # auto, on a reporting guest
    reports[0] = False
    assert prefault.huge_pages_wanted() is True  # auto elsewhere
    for value, want in (("on", True), ("1", True), (" YES ", True), ("off", False), ("0", False), ("auto", True)):
        monkeypatch.setenv(prefault.HUGE_PAGES_ENV, value)
        assert prefault.huge_pages_wanted() is want, value
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "sometimes")
    with pytest.raises(ValueError, match="OBJCKPT_HUGE_PAGES='sometimes'"):
        prefault.huge_pages_wanted()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_huge_pages_off_leaves_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the advice off a fresh destination is mapped 4 KiB at a time (where THP is
    on "madvise": under "always" the kernel maps huge pages without being asked)."""
    import mmap

    monkeypatch.setattr(prefault, "MIN_BYTES", 0)
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "off")
    mm = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    view = host_bytes(t)
    addr = prefault.address(view)
    assert prefault.start([view]) is None
    t.fill_(9)
    if _thp_mode() == "madvise":
        assert _huge_kib(addr, len(view)) == 0
    assert int(t.sum()) == 9 * (64 << 20)
    del t, view


def test_misspelt_huge_pages_setting_fails_a_load_before_it_reads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small load too (below the size where advice is given) names the variable, and
    the template is left as it was."""
    state = {"w": torch.arange(12.0).reshape(3, 4)}
    objckpt.save(state, str(tmp_path / "ck"))
    template = {"w": torch.full((3, 4), -1.0)}
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "maybe")
    with pytest.raises(ValueError, match="OBJCKPT_HUGE_PAGES"):
        objckpt.load(template, str(tmp_path / "ck"))
    assert bool((template["w"] == -1).all())
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "off")
    objckpt.load(template, str(tmp_path / "ck"))
    assert torch.equal(template["w"], state["w"])
