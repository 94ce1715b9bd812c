"""The local tier's pieces: the O_DIRECT writer, a node folder's metadata, the restore choice, the drain cap."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import objckpt
from mp import run_multiprocess
from objckpt.storage import local as local_store
from objckpt.storage.local import DIRECT_ALIGN, LocalStore
from objckpt.tier import local as tier_local
from objckpt.tier.local import LocalStep
from objckpt.tier.restore import Holding, plan_restore

#: sizes around the alignment: an element, a page minus/plus one, several pages and a tail
SIZES = [1, 1023, 1025, 4097, 100_003, 1_500_007]


def _on_tmpfs(path: str) -> bool:
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if path.startswith(m[1].rstrip("/") + "/") or path == m[1]),
               key=lambda m: len(m[1]), default=None)
    return best is not None and best[2] in ("tmpfs", "ramfs")


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A directory on a real disk (O_DIRECT works there; /tmp may be tmpfs)."""
    for base in ("/var/tmp", os.path.expanduser("~"), os.getcwd()):
        if os.path.isdir(base) and os.access(base, os.W_OK) and not _on_tmpfs(os.path.realpath(base)):
            with tempfile.TemporaryDirectory(dir=base, prefix="objckpt-direct-") as d:
                yield Path(d)
            return
    pytest.fail("no writable directory on a disk for the O_DIRECT test")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    st = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(SIZES)}
    st["u8"] = torch.arange(7, dtype=torch.uint8)
    return st


def _direct_writer_used(root: Path) -> bool:
    w = LocalStore(str(root), direct=True).open_writer("probe.bin", 3 * DIRECT_ALIGN)
    try:
        return w.direct  # type: ignore[attr-defined]
    finally:
        import asyncio

        asyncio.run(w.abort())


def test_o_direct_round_trips_unaligned_tensor_sizes(disk_dir: Path) -> None:
    assert _direct_writer_used(disk_dir), "O_DIRECT refused on a disk directory"
    made = local_store.DIRECT_BUFFERS.made
    st = _state()
    # small blobs and parts: parts start and end mid-page, the blobs' ends are unaligned
    objckpt.save(st, str(disk_dir / "c"), store=LocalStore("/", direct=True), blob_size=3_000_001,
                 part_size=1_000_003)
    back = objckpt.read(str(disk_dir / "c"))
    assert set(back) == set(st) and all(torch.equal(back[k], v) for k, v in st.items())
    m = objckpt.inspect(str(disk_dir / "c"))
    for b in m.blobs:  # truncated back to the true size, not the padded one
        assert os.path.getsize(disk_dir / "c" / b.name) == b.size
    objckpt.save(st, str(disk_dir / "d"), store=LocalStore("/", direct=True))
    assert local_store.DIRECT_BUFFERS.made - made <= 8  # reused across writes and saves, not one per write


def test_dev_shm_round_trips_whether_or_not_its_tmpfs_takes_o_direct() -> None:
    """tmpfs refused O_DIRECT (EINVAL) before Linux 6.6 and takes it since: either way the save is whole."""
    if not os.path.isdir("/dev/shm") or not _on_tmpfs("/dev/shm"):
        pytest.fail("/dev/shm is not a tmpfs here")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="objckpt-direct-") as d:
        st = _state()
        objckpt.save(st, os.path.join(d, "c"), store=LocalStore("/", direct=True), blob_size=3_000_001)
        back = objckpt.read(os.path.join(d, "c"))
        assert all(torch.equal(back[k], v) for k, v in st.items())


@pytest.mark.parametrize("where", ["open", "write"])
def test_o_direct_refused_falls_back_to_buffered_writes(disk_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                        where: str) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL, as tmpfs before Linux 6.6, some FUSE and network
    filesystems) at open, or accepts the open and refuses the aligned write: buffered, whole."""
    import errno

    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()

    def fake_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if flags & local_store._O_DIRECT:
            if where == "open":
                raise OSError(errno.EINVAL, "Invalid argument", path)
            fd = real_open(path, flags & ~local_store._O_DIRECT, *a, **k)
            direct_fds.add(fd)
            return fd
        return real_open(path, flags, *a, **k)

    def fake_pwrite(fd: int, data: Any, offset: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local_store.os, "open", fake_open)
    monkeypatch.setattr(local_store.os, "pwrite", fake_pwrite)
    st = _state()
    objckpt.save(st, str(disk_dir / "c"), store=LocalStore("/", direct=True), blob_size=3_000_001,
                 part_size=1_000_003)
    monkeypatch.undo()
    back = objckpt.read(str(disk_dir / "c"))
    assert all(torch.equal(back[k], v) for k, v in st.items())
    if where == "write":
        assert direct_fds  # the direct descriptor was opened, then given up


def test_restore_choice_prefers_newest_step_every_rank_can_get() -> None:
    need = ["manifest.json", "a.bin", "b.bin"]
    full = LocalStep(7, need, need)
    half = LocalStep(7, need, ["manifest.json", "a.bin"])
    other = LocalStep(7, need, ["manifest.json", "b.bin"])
    # node n0 whole, n1 lost: n1 repairs from peers
    p = plan_restore([Holding("n0", {7: full}), Holding("n1", {})], [5], peers=True)
    assert (p.step, p.sources) == (7, ["local", "peer"])
    # each node holds half: together whole
    p = plan_restore([Holding("n0", {7: half}), Holding("n1", {7: other})], [], peers=True)
    assert (p.step, p.sources) == (7, ["peer", "peer"])
    # a file nobody holds: the newest drained step instead, never a mix
    p = plan_restore([Holding("n0", {7: half}), Holding("n1", {7: half})], [5], peers=True)
    assert (p.step, p.sources) == (5, ["object", "object"]) and "7" in p.why
    p = plan_restore([Holding("n0", {}), Holding("n1", {})], [], peers=True)
    assert p.step is None


def _spread(rank: int, world: int, base: str) -> list[str]:
    from objckpt.distributed.comm import get_comm

    d = Path(base) / f"n{rank}" / "s"
    st = {"w": objckpt.Shard(torch.full((2, 3), float(rank)), (2 * world, 3), (2 * rank, 0))}
    objckpt.save(st, str(d), store=LocalStore("/"))
    tier_local.spread_metadata(get_comm(None), d, [f"n{r}" for r in range(world)], rank)
    return sorted(os.listdir(d))


def test_every_node_folder_gets_the_manifest(tmp_path: Path) -> None:
    got = run_multiprocess(2, _spread, str(tmp_path))
    assert all("manifest.json" in g for g in got)
    m = objckpt.inspect(str(tmp_path / "n1" / "s"))  # n1's folder is a checkpoint: rank 1's rows read from it
    assert [b.rank for b in m.blobs] == [0, 1]
    mine = {"w": objckpt.Shard(torch.zeros(2, 3), (4, 3), (2, 0))}
    objckpt.load(mine, str(tmp_path / "n1" / "s"), no_dist=True)
    assert torch.equal(mine["w"].local, torch.ones(2, 3))
    with pytest.raises(objckpt.BlobMissingError, match="r00000"):  # rank 0's rows live on n0 (or a replica)
        objckpt.read(str(tmp_path / "n1" / "s"), "w")


def test_a_drained_file_larger_than_a_part_goes_up_whole_in_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    moto_s3: tuple[str, dict[str, Any]]) -> None:
    from objckpt.storage import open_store
    from objckpt.tier import drain

    bucket, opts = moto_s3
    monkeypatch.setattr(drain, "DRAIN_PART", 5 << 20)  # S3's smallest part
    data = os.urandom((11 << 20) + 3)  # two whole parts and an unaligned last one
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    store, prefix = open_store(f"s3://{bucket}/run/step", opts)
    throttle = drain.Throttle(None)
    assert drain.upload_file(src, store, prefix + "/blobs/a/r00000-0000.bin", throttle) == len(data)
    assert throttle.sent == len(data)
    import boto3

    from conftest import s3_options

    got = boto3.client("s3", **s3_options(opts["endpoint_url"])).get_object(
        Bucket=bucket, Key="run/step/blobs/a/r00000-0000.bin")
    assert got["Body"].read() == data


def test_the_error_class_of_gathered_problems_comes_from_their_kinds() -> None:
    from objckpt.tier.errors import (LocalTierError, TierSettingsError, exists_problem, local_problem,
                                     raise_problems, settings_problem)

    exists = exists_problem("step 3 is already committed in the local tier")
    full = local_problem("local_dir '/x/already committed' has 0 bytes free")
    raise_problems("nothing", [None, None])  # no problem: no error
    with pytest.raises(objckpt.CheckpointExistsError, match=r"rank 1: step 3"):
        raise_problems("step 3 not saved", [None, exists])
    with pytest.raises(LocalTierError, match=r"rank 0: step 3 .*; rank 1: local_dir"):  # any local problem
        raise_problems("step 3 not saved", [exists, full])
    with pytest.raises(LocalTierError, match="already committed"):  # the words in a path do not matter
        raise_problems("step 3 not saved", [full])
    with pytest.raises(TierSettingsError, match=r"and 1 more rank"):
        raise_problems("settings", [settings_problem("blank node name")] * 5)


def test_gathered_problems_are_rank_errors_whose_kind_is_the_class_to_raise() -> None:
    """The tier's refusals cross ranks in the one shape every error does (RankError: the
    registered class name, the text): a rank's error made by RankError.of elsewhere, or
    read back from a pickle as the all-gather does, picks the same class."""
    import pickle

    from objckpt.distributed.comm import RankError
    from objckpt.errors import CorruptCheckpointError, ObjckptError
    from objckpt.tier.errors import (LocalTierError, TierSettingsError, exists_problem, local_problem,
                                     raise_problems, settings_problem, state_problem)

    made = [settings_problem("s"), local_problem("l"), exists_problem("e"),
            state_problem(CorruptCheckpointError("x"), "its state could not be read")]
    assert all(type(p) is RankError for p in made)
    assert [p.kind for p in made] == ["TierSettingsError", "LocalTierError", "CheckpointExistsError",
                                      "CorruptCheckpointError"]
    crossed = pickle.loads(pickle.dumps(made))
    # a state's error class wins over a settings problem on an earlier rank, and over an existing step
    with pytest.raises(CorruptCheckpointError, match=r"rank 0: s; rank 2: e; rank 3: its state"):
        raise_problems("step 1 not saved", crossed[:1] + [None] + crossed[2:])
    # any local problem still wins; a RankError made elsewhere is read the same way
    with pytest.raises(LocalTierError):
        raise_problems("step 1 not saved", [RankError.of(CorruptCheckpointError("x")), crossed[1]])
    with pytest.raises(objckpt.CheckpointExistsError):
        raise_problems("step 1 not saved", [RankError.of(objckpt.CheckpointExistsError("x"))] * 2)
    # a kind that names no objckpt class: ObjckptError itself, never the builtin
    with pytest.raises(ObjckptError) as info:
        raise_problems("step 1 not saved", [state_problem(KeyError("k"), "no key"), settings_problem("s")])
    assert type(info.value) is ObjckptError and not isinstance(info.value, (KeyError, TierSettingsError))


def test_the_drain_queue_retries_oldest_first_stops_at_an_outage_and_gives_up_past_its_bound() -> None:
    from objckpt.tier.backlog import DrainQueue, Undrained
    from objckpt.tier.errors import DrainError

    tried: list[int] = []
    down = {"on": True}

    def attempt(u: Undrained) -> None:
        tried.append(u.step)
        if u.step == 13:
            raise DrainError("another checkpoint is committed there", step=13, retryable=False)
        if down["on"]:
            raise DrainError(f"draining step {u.step}: refused", step=u.step)

    q = DrainQueue(limit=3)
    for s in (10, 11, 12):
        q.run(Undrained(s, {}, 0.0), attempt)
    assert tried == [10, 10, 10] and q.steps == {10, 11, 12}  # one failed attempt per round, the oldest
    tried.clear()
    q.run(Undrained(14, {}, 0.0), attempt)  # a fourth waiting step: the oldest (10) is given up
    assert q.steps == {11, 12, 14}
    err = q.take_errors()
    assert err is not None and "step 10 was not drained" in str(err) and "[11, 12, 14]" in str(err)
    down["on"] = False
    assert q.run(Undrained(13, {}, 0.0), attempt) == [11, 12, 14]  # back: oldest first; 13 can never drain
    assert not q.waiting and tried[-4:] == [11, 12, 14, 13]
    err = q.take_errors()
    assert err is not None and not err.retryable and "another checkpoint" in str(err)
    assert q.take_errors() is None


def _spread_by_node(rank: int, world: int, base: str) -> Any:
    import resource
    import signal

    from objckpt.distributed.comm import get_comm

    comm = get_comm(None)
    nodes = [f"n{r // 2}" for r in range(world)]  # two ranks a node
    leaders = tier_local.node_leaders(comm, nodes, 60.0)
    assert leaders is not None and (leaders.comm is not None) == (rank % 2 == 0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    out: list[Any] = []
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(2 * world * 3, dtype=torch.float32).reshape(2 * world, 3)
    for step in ("s1", "s2"):
        d = Path(base) / nodes[rank] / step
        st = {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)])}  # format v2: rank indexes
        objckpt.save(st, str(d), store=LocalStore("/"))
        before = resource.getrlimit(resource.RLIMIT_FSIZE)
        if step == "s2" and rank == 2:  # n1's first rank: its disk takes no more bytes
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, before[1]))
        try:
            tier_local.spread_metadata(comm, d, nodes, rank, leaders)
            out.append("spread")
        except tier_local.LocalTierError as e:
            out.append(str(e))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, before)
    return out


def test_the_nodes_first_ranks_spread_the_metadata_and_one_nodes_write_error_fails_every_rank(
        tmp_path: Path) -> None:
    got = run_multiprocess(4, _spread_by_node, str(tmp_path), timeout=90)
    for first, second in got:
        assert first == "spread"
        assert "rank 2 on node 'n1'" in second and "File too large" in second, second
    for node in ("n0", "n1"):
        m = objckpt.inspect(str(tmp_path / node / "s1"))  # every node's folder is the whole checkpoint's metadata
        assert sorted({b.rank for b in m.blobs}) == [0, 1, 2, 3] and len(m.rank_indexes) == 4
        assert all((tmp_path / node / "s1" / r.name).is_file() for r in m.rank_indexes)
        assert not (tmp_path / node / "s2").exists()  # the failed step is on no node
    mine = {"w": objckpt.Shard(torch.zeros(2, 3), (8, 3), (6, 0))}
    objckpt.load(mine, str(tmp_path / "n1" / "s1"), no_dist=True)  # rank 3's rows, from n1's folder
    assert torch.equal(mine["w"].local, torch.arange(18, 24, dtype=torch.float32).reshape(2, 3))


def test_retention_counts_the_step_folders_that_hold_a_manifest_without_decoding_them(tmp_path: Path) -> None:
    from objckpt.manager.naming import StepNaming

    naming = StepNaming()
    for step, manifest in ((3, b"{}"), (1, b"not json: still a commit to count and delete"), (2, None)):
        d = tmp_path / naming.name(step)
        (d / "blobs").mkdir(parents=True)
        if manifest is not None:
            (d / "manifest.json").write_bytes(manifest)
    (tmp_path / "notes").mkdir()
    assert tier_local.committed_steps(tmp_path, naming.parse) == [1, 3]  # 2: no manifest, no step
    assert sorted(tier_local.scan(tmp_path, naming.parse)) == []  # scan decodes: neither manifest is one
    assert tier_local.committed_steps(tmp_path / "gone", naming.parse) == []


def test_a_drain_tried_again_after_its_commit_succeeds_and_another_checkpoint_there_is_final(tmp_path: Path) -> None:
    from objckpt.distributed.comm import LocalComm
    from objckpt.tier import drain
    from objckpt.tier.errors import DrainError

    for name, value in (("a", 1.0), ("b", 2.0)):
        objckpt.save({"x": torch.full((5,), value)}, str(tmp_path / name), store=LocalStore("/"))
    store = LocalStore(str(tmp_path / "root"))
    for _ in range(2):  # the second attempt finds its own manifest there: committed, as an answer lost would leave
        rep = drain.drain(LocalComm(), 7, tmp_path / "a", store, "step-7", "root/step-7")
        assert rep.committed and rep.files == 1
    assert torch.equal(objckpt.read(str(tmp_path / "root" / "step-7"))["x"], torch.full((5,), 1.0))
    with pytest.raises(DrainError, match="another manifest") as err:  # another checkpoint: never replaced
        drain.drain(LocalComm(), 7, tmp_path / "b", store, "step-7", "root/step-7")
    assert not err.value.retryable and err.value.step == 7
    with pytest.raises(DrainError, match="no readable manifest") as err:  # the local step is gone
        drain.drain(LocalComm(), 8, tmp_path / "gone", store, "step-8", "root/step-8")
    assert not err.value.retryable
    assert torch.equal(objckpt.read(str(tmp_path / "root" / "step-7"))["x"], torch.full((5,), 1.0))
