"""A drain never commits a bad or incomplete step: bytes checked against the manifest on the way
(a bad local copy replaced by a peer's intact replica, or the drain refused), and every file the
step's manifest names uploaded, from whichever node holds it, also after a restart at another
world size.  Real moto S3 over HTTP (down behind a resetting proxy), real gloo ranks, real files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import objckpt
from mp import run_multiprocess
from objckpt.format import manifest as _manifest
from objckpt.tier.errors import DrainError
from test_tier_manager import _check, _manager, _state, _zeros

STEP_DIR = "step-{:010d}"


def _flip_rank0_blob(step_dir: Path) -> str:
    """One byte in the middle of the blob rank 0 wrote, in this folder's copy; its name."""
    m = _manifest.decode((step_dir / "manifest.json").read_bytes(), str(step_dir))
    blob = next(b for b in m.blobs if b.rank == 0 and b.size)
    with open(step_dir / blob.name, "r+b") as f:
        f.seek(blob.size // 2)
        byte = f.read(1)
        f.seek(blob.size // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    return blob.name


def _down_then_up(rank: int, world: int, root: str, local: str, opts: dict[str, Any], flip: list[str]) -> Any:
    """Step 1 saved while object storage is down; rank 0's blob flipped in the folders of the
    nodes ``flip`` meanwhile; object storage back; the drain retried.  Then step 2 saved."""
    import torch.distributed as dist

    from testkit.campaign_io import FaultProxy

    proxy = FaultProxy(opts["endpoint_url"], kind="reset", probability=1.0, max_offset=0, direction="up") \
        if rank == 0 else None
    url = [proxy.url if proxy is not None else None]
    dist.broadcast_object_list(url, 0)
    folder = Path(local.replace("{node}", f"n{rank}"))
    out: dict[str, Any] = {}
    m = _manager(rank, root, local, {**opts, "endpoint_url": url[0]}, persist_every=1, local_keep=1,
                 drain_retry_s=None)
    try:
        m.save(1, _state(rank, world, 1))
        with pytest.raises(DrainError):  # object storage is down: step 1 waits in the local tier
            m.wait()
        dist.barrier()
        if rank == 0:
            for node in flip:  # bit rot while the drain waits
                _flip_rank0_blob(Path(local.replace("{node}", node)) / STEP_DIR.format(1))
            proxy.probability = 0.0  # type: ignore[union-attr]
        dist.barrier()
        try:
            m.wait()
            out["wait"] = "drained"
        except DrainError as e:
            out["wait"] = f"{type(e).__name__} retryable={e.retryable}: {e}"
        out["steps"] = m.steps()
        out["kept"] = sorted(os.listdir(folder / STEP_DIR.format(1)))
        m.save(2, _state(rank, world, 2))  # retention after a drain that worked
        m.wait()
        out["after"] = sorted(n for n in os.listdir(folder) if n.startswith("step-"))
        out["steps2"] = m.steps()
    finally:
        m.close()
        if proxy is not None:
            proxy.close()
    return out


def _no_manifest(root: str, opts: dict[str, Any], step: int) -> bool:
    try:
        objckpt.inspect(f"{root}/{STEP_DIR.format(step)}", storage_options=opts)
    except objckpt.NotFoundError:
        return True
    return False


def test_a_byte_flipped_while_the_store_is_down_is_drained_from_the_peers_intact_replica(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    got = run_multiprocess(2, _down_then_up, root, local, opts, ["n0"], timeout=120)
    for out in got:
        assert out["wait"] == "drained", out["wait"]
        assert out["steps"] == [1]
    st = _zeros(0, 1)
    objckpt.load(st, f"{root}/{STEP_DIR.format(1)}", storage_options=opts)  # crc-checked on read
    _check(st, 0, 1, 1)


def test_a_byte_flipped_in_every_copy_fails_the_drain_loudly_and_keeps_the_local_copies(
        tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run", str(tmp_path / "{node}" / "ckpt")
    got = run_multiprocess(2, _down_then_up, root, local, opts, ["n0", "n1"], timeout=120)
    for rank, out in enumerate(got):
        assert out["wait"].startswith("DrainError retryable=False"), out["wait"]
        assert "no node holds an intact copy" in out["wait"] and "n0" in out["wait"] and "n1" in out["wait"]
        assert out["steps"] == [] and out["steps2"] == [2]
        assert "manifest.json" in out["kept"]
        # local_keep=1, yet the step whose drain was given up is not deleted by the next retention
        assert out["after"] == [STEP_DIR.format(1), STEP_DIR.format(2)], (rank, out["after"])
    assert _no_manifest(root, opts, 1)  # nothing committed in object storage


def _first_run_cannot_drain(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> str:
    """2 ranks (n0, n1; replicas=1): step 2 is due while object storage is down, then the job ends."""
    import torch.distributed as dist

    from testkit.campaign_io import FaultProxy

    proxy = FaultProxy(opts["endpoint_url"], kind="reset", probability=1.0, max_offset=0, direction="up") \
        if rank == 0 else None
    url = [proxy.url if proxy is not None else None]
    dist.broadcast_object_list(url, 0)
    why = "drained?"
    try:
        with _manager(rank, root, local, {**opts, "endpoint_url": url[0]}, persist_every=1,
                      drain_retry_s=None) as m:
            m.save(2, _state(rank, world, 2))
            m.wait()
    except DrainError as e:
        why = str(e)
    dist.barrier()
    if proxy is not None:
        proxy.close()
    return why


def _restart(rank: int, world: int, root: str, local: str, opts: dict[str, Any]) -> Any:
    """The job restarted at ``world`` ranks on nodes n0..: it adopts the recorded due step."""
    try:
        with _manager(rank, root, local, opts, persist_every=1, replicas=min(1, world - 1),
                      drain_retry_s=None) as m:
            m.wait()
            return "ok", m.steps()
    except objckpt.ObjckptError as e:
        return f"{type(e).__name__}: {e}", None


@pytest.mark.parametrize("world", [1, 3])
def test_a_drain_pending_across_a_world_size_change_reaches_the_store_whole(
        world: int, tmp_path: Path, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root, local = f"s3://{bucket}/run-w{world}", str(tmp_path / "{node}" / "ckpt")
    for why in run_multiprocess(2, _first_run_cannot_drain, root, local, opts, timeout=120):
        assert "not in object storage yet" in why, why
    got = run_multiprocess(world, _restart, root, local, opts, timeout=120)
    for outcome, steps in got:
        assert outcome == "ok", outcome  # never a silent drop: step 2 is drained, or an error says why
        assert steps == [2]
    st = _zeros(0, 1)  # whole, bit for bit: every blob the manifest names, the old rank 1's too
    objckpt.load(st, f"{root}/{STEP_DIR.format(2)}", storage_options=opts)
    _check(st, 0, 1, 2)


def test_copy_and_the_drain_check_bytes_with_the_same_mover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from objckpt.distributed.comm import LocalComm
    from objckpt.ops import mover
    from objckpt.storage.local import LocalStore
    from objckpt.tier import drain

    objckpt.save({"x": torch.arange(1000, dtype=torch.float32)}, str(tmp_path / "src"), store=LocalStore("/"))
    calls: list[str] = []
    real = mover.BlobCheck.record

    def record(self: mover.BlobCheck, found: Any) -> int:
        calls.append(self.where)
        return real(self, found)

    monkeypatch.setattr(mover.BlobCheck, "record", record)
    objckpt.copy(str(tmp_path / "src"), str(tmp_path / "copied"))
    copied = len(calls)
    assert copied >= 1
    drain.drain(LocalComm(), 1, tmp_path / "src", LocalStore(str(tmp_path / "root")), "step-1", "root/step-1")
    assert len(calls) > copied  # the drain's blob went through the same check
    # and the same check refuses a flipped byte in both
    m = objckpt.inspect(str(tmp_path / "src"))
    blob = tmp_path / "src" / m.blobs[0].name
    data = bytearray(blob.read_bytes())
    data[100] ^= 0x10
    blob.write_bytes(bytes(data))
    with pytest.raises(objckpt.CorruptCheckpointError, match="crc32c mismatch"):
        objckpt.copy(str(tmp_path / "src"), str(tmp_path / "copied2"))
    with pytest.raises(DrainError, match="no node holds an intact copy") as err:
        drain.drain(LocalComm(), 2, tmp_path / "src", LocalStore(str(tmp_path / "root")), "step-2", "root/step-2")
    assert not err.value.retryable
    assert not (tmp_path / "root" / "step-2" / "manifest.json").exists()
