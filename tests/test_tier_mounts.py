"""Which filesystem a node folder is on: memory or not, and in 4 KiB or huge pages."""
from __future__ import annotations

import logging
import os
import pathlib
import subprocess

import pytest

from objckpt.tier.mounts import mount_of, parse_mounts, small_pages_hint, volatile

MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
/dev/nvme0n1p1 / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=24684092k 0 0
tmpfs /mnt/huge tmpfs rw,relatime,size=2097152k,huge=within_size 0 0
tmpfs /mnt/never tmpfs rw,relatime,huge=never 0 0
tmpfs /mnt/my\\040ckpt tmpfs rw,relatime,huge=always 0 0
/dev/nvme1n1 /mnt/nvme xfs rw,noatime 0 0
"""


def test_the_longest_mount_point_containing_the_path_wins():
    mounts = parse_mounts(MOUNTS)
    assert mount_of("/dev/shm/ckpt/node0", mounts).point == "/dev/shm"
    assert mount_of("/mnt/huge/x", mounts).option("huge") == "within_size"
    assert mount_of("/mnt/my ckpt/a", mounts).fstype == "tmpfs"  # \\040 is a space
    assert mount_of("/mnt/nvme/ckpt", mounts).fstype == "xfs"
    assert mount_of("/mnt/hugepages", mounts).point == "/"  # a prefix of the name is not the mount


@pytest.mark.parametrize("path,hinted", [("/dev/shm/ckpt", True), ("/mnt/never/c", True), ("/mnt/huge/c", False),
                                         ("/mnt/my ckpt/c", False), ("/mnt/nvme/c", False), ("/var/tmp/c", False)])
def test_the_hint_is_for_tmpfs_in_small_pages_only(path, hinted):
    hint = small_pages_hint(path, parse_mounts(MOUNTS))
    assert (hint is not None) == hinted
    if hinted:
        assert repr(path) in hint and "huge=within_size" in hint


def _shm_is_small_pages() -> bool:
    return small_pages_hint("/dev/shm") is not None


def test_this_machines_mounts_are_read():
    """The real /proc/self/mounts: /proc is no memory filesystem; /dev/shm, where it is a
    tmpfs (the local tier's usual place), is."""
    assert volatile(pathlib.Path("/proc")) is False
    shm = mount_of("/dev/shm")
    assert shm is not None
    assert volatile(pathlib.Path("/dev/shm")) == (shm.fstype in ("tmpfs", "ramfs"))


def _mount_huge(path: pathlib.Path) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,huge=within_size", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_the_manager_says_so_once_for_small_pages_and_not_for_huge(tmp_path, caplog):
    """A manager whose local tier is on /dev/shm logs the hint; one on a tmpfs mounted
    huge=within_size (a real mount where the test may mount) does not."""
    if not _shm_is_small_pages():
        pytest.skip("/dev/shm is not a tmpfs in 4 KiB pages here (the hint's rule is tested on sample mounts above)")
    shm = pathlib.Path("/dev/shm") / f"objckpt-mounts-{os.getpid()}"
    try:
        _small_then_huge(tmp_path, shm, caplog)
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def _small_then_huge(tmp_path, shm, caplog):
    import objckpt

    with caplog.at_level(logging.INFO, logger="objckpt.manager"):
        m = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(shm), replicas=0, no_dist=True)
        m.close()
    assert sum("4 KiB pages" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    huge = tmp_path / "huge"
    if not _mount_huge(huge):
        pytest.skip("this machine does not let the tests mount a tmpfs (the parsing is tested above)")
    try:
        with caplog.at_level(logging.INFO, logger="objckpt.manager"):
            m = objckpt.CheckpointManager(str(tmp_path / "root2"), local_dir=str(huge / "ckpt"), replicas=0,
                                          no_dist=True)
            m.close()
        assert not any("4 KiB pages" in r.getMessage() for r in caplog.records)
    finally:
        subprocess.run(["umount", str(huge)], capture_output=True)
