"""A tiered save is refused before anything is written when a node's filesystem cannot hold
what the save lands on it: the shares of all its ranks and the replicas it receives
(objckpt.tier.space), not only each rank's own share.

Node folders are real small tmpfs mounts where this process may mount (root in a
container); elsewhere the ranks see a simulated filesystem of the same size (its free
space is the size less the files under the folder, rounded to 4 KiB pages).  Ranks are
real gloo processes (tests/mp.py); ``node_override`` names their nodes.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

import objckpt
from fs_faults import mounted_tmpfs
from mp import run_multiprocess
from objckpt.distributed.comm import RankError
from objckpt.errors import error_name
from objckpt.tier import space
from objckpt.tier.errors import LocalTierError, local_problem
from objckpt.tier.space import Place, Room, Share
from objckpt.tier.topology import Topology

KiB, MiB = 1 << 10, 1 << 20
FS_SIZE = 4 * MiB


@contextlib.contextmanager
def _small_fs(path: Path, size: int) -> Iterator[Optional[int]]:
    """A filesystem of ``size`` bytes at ``path``: a real tmpfs (yields None), or a folder whose
    filesystem the ranks simulate (yields ``size``: pass it to :func:`_simulate`)."""
    with mounted_tmpfs(str(path), size) as mnt:
        yield None if mnt is not None else size


def _simulate(small: dict[str, Optional[int]]) -> None:
    """In a rank: the folders of ``small`` with a size (no tmpfs here) report that size less
    their files as free space, each its own filesystem."""
    fake = {os.path.abspath(p): n for p, n in small.items() if n is not None}
    if not fake:
        return
    real = space.place_of

    def place_of(root: Path) -> Place:
        for top, size in fake.items():
            if os.path.abspath(root).startswith(top):
                used = sum(-(-os.path.getsize(os.path.join(d, f)) // 4096) * 4096
                           for d, _, fs in os.walk(top) for f in fs)
                return Place("simulated", hash(top), max(size - used, 0))
        return real(root)

    space.place_of = place_of  # type: ignore[assignment]


def _state(rank: int, world: int, step: int, shard: int, plain: int) -> dict[str, Any]:
    """``shard`` bytes of this rank's own rows, ``plain`` bytes of a tensor every rank holds alike."""
    n = shard // 4
    return {"w": objckpt.Shard(torch.arange(n, dtype=torch.float32) + rank * n + step, (world * n,), (rank * n,)),
            "p": torch.full((plain // 4,), float(step)), "step": step}


def _manager(rank: int, base: str, node: str, **kw: Any) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(os.path.join(base, "root"), local_dir=os.path.join(base, "{node}"),
                                     node_override=node, persist_every=None, local_keep=2, **kw)


def _saved_and_refused(rank: int, world: int, base: str, small: dict[str, Optional[int]], nodes: list[str],
                       first: tuple[int, int], second: tuple[int, int], replicas: int) -> dict[str, Any]:
    """Save step 1 (``first``: shard and plain bytes), then try step 2 (``second``); then load."""
    from objckpt.tier.errors import LocalTierError

    _simulate(small)
    out: dict[str, Any] = {}
    with _manager(rank, base, nodes[rank], replicas=replicas) as m:
        m.save(1, _state(rank, world, 1, *first))
        m.wait()  # step 1's replicas are written
        try:
            m.save(2, _state(rank, world, 2, *second))
            out["second"] = "saved"
        except LocalTierError as e:
            out["second"] = str(e)
        m.wait()
        torch.distributed.barrier()  # every rank returned from its save (each node's folder is its own ranks')
        out["folders"] = {n: sorted(os.listdir(os.path.join(base, n))) for n in set(nodes)}
        back = _state(rank, world, 0, *first)
        res = m.load(back)
        want = _state(rank, world, 1, *first)
        out["loaded"] = (res.step, torch.equal(back["w"].local, want["w"].local) and torch.equal(back["p"], want["p"]))
    return out


def test_two_ranks_on_one_node_are_refused_when_their_shares_only_fit_alone(tmp_path: Path) -> None:
    with _small_fs(tmp_path / "n0", FS_SIZE) as sim:
        # step 1: 2 x 512 KiB of rows and 2 MiB of a plain tensor, written once: 3 MiB fit in 4 MiB
        # (counting the plain tensor once per rank, 5 MiB, would refuse it); step 2: 640 KiB of rows
        # each, each alone within the ~1 MiB left, not both
        got = run_multiprocess(2, _saved_and_refused, str(tmp_path), {str(tmp_path / "n0"): sim}, ["n0", "n0"],
                               (512 * KiB, 2 * MiB), (640 * KiB, 4), 0)
    need = 2 * 640 * KiB + 4
    for g in got:
        msg = g["second"]
        assert msg.startswith("step 2 not saved, nothing written"), msg
        assert f"local_dir {str(tmp_path / 'n0')!r} (node 'n0')" in msg and "bytes free" in msg, msg
        assert f"needs up to {need} bytes" in msg and "replica" not in msg, msg
        free = int(msg.split(" has ")[1].split(" bytes free")[0])
        assert 640 * KiB < free < need, msg  # each rank's share fits alone
        assert g["folders"]["n0"] == ["step-0000000001"]  # nothing of step 2
        assert g["loaded"] == (1, True)
    assert got[0]["second"] == got[1]["second"]  # the same error on every rank


def test_a_node_whose_shares_fit_but_not_with_the_replicas_it_receives_is_refused(tmp_path: Path) -> None:
    (tmp_path / "n0").mkdir()  # n0: the ordinary disk; n1: 4 MiB
    with _small_fs(tmp_path / "n1", FS_SIZE) as sim:
        # step 1: n1 holds its 1 MiB + 512 KiB and n0's replica alike, 3 MiB at most: saved and
        # replicated; step 2: n1's own 1 MiB fits in the ~1.5 MiB left, not with n0's replica
        got = run_multiprocess(2, _saved_and_refused, str(tmp_path), {str(tmp_path / "n1"): sim}, ["n0", "n1"],
                               (1 * MiB, 512 * KiB), (1 * MiB, 4), 1)
    for g in got:
        msg = g["second"]
        assert msg.startswith("step 2 not saved, nothing written") and "(node 'n1')" in msg, msg
        own = 1 * MiB + 4
        assert (f"node 'n1': {own} bytes for the shares of its rank(s) + {own} bytes for the replicas "
                f"(replicas=1) it receives from node 'n0' ({own} bytes)") in msg, msg
        assert f"needs up to {2 * own} bytes" in msg, msg
        free = int(msg.split(" has ")[1].split(" bytes free")[0])
        assert own < free < 2 * own, msg  # its own share fits
        assert g["folders"] == {"n0": ["step-0000000001"], "n1": ["step-0000000001"]}
        assert g["loaded"] == (1, True)
    assert got[0]["second"] == got[1]["second"]


def _room(share: Share, free: int, device: int, folder: str = "/f") -> Room:
    return Room(folder, share, Place("m", device, free))


def test_node_needs_count_plain_tensors_once_per_node_and_the_replicas_received() -> None:
    """Two nodes of two ranks, replicas=1: each node writes its ranks' rows and the plain
    tensors once (not once per rank), and receives the other node's alike."""
    topo = Topology(("a", "a", "b", "b"))
    s = Share(own=100, shared=1000, shared_whole=1000)  # 100 bytes of rows, a 1000-byte plain tensor
    rooms = [_room(s, 10_000, d) for d in (1, 1, 2, 2)]
    needs = space.node_needs(rooms, topo, 1)
    assert [(n.node, n.writes, n.receives) for n in needs] == [("a", 1200, {"b": 1200}), ("b", 1200, {"a": 1200})]
    assert space.node_problems(rooms, topo, 1) == [None] * 4
    assert space.node_needs(rooms, topo, 0)[0].receives == {}
    # a DTensor replicated on part of its mesh: the node writes what its ranks hold, at most the whole
    part = Share(own=0, shared=300, shared_whole=1000)
    assert space.node_needs([_room(part, 10_000, 1)] * 4, topo, 0)[0].writes == 600

    # 2400 bytes land on each filesystem: 2399 free is refused, on the first rank of the node
    tight = [_room(s, 2399, d) for d in (1, 1, 2, 2)]
    got = space.node_problems(tight, topo, 1)
    assert got[1] is None and got[3] is None and got[0] is not None and got[2] is not None
    assert got[0].kind == error_name(LocalTierError) and "(node 'a') has 2399 bytes free" in got[0].text
    assert "needs up to 2400 bytes" in got[0].text and "from node 'b' (1200 bytes)" in got[0].text

    # both nodes' folders on one filesystem: their needs add up against its free space
    shared_fs = [_room(s, 4000, 7, f"/disk/{n}") for n in "aabb"]
    got = space.node_problems(shared_fs, topo, 1)
    assert got[1:] == [None, None, None] and got[0] is not None
    assert "needs up to 4800 bytes" in got[0].text and "on one filesystem" in got[0].text


def test_senders_are_the_nodes_whose_every_rank_sends_to_the_node() -> None:
    """Topology.senders (per node) agrees with peers_for (per rank), uneven nodes included."""
    topo = Topology(("a", "a", "a", "b", "c", "c", "d"))
    for k in (1, 2, 3):
        senders = topo.senders(k)
        for node in topo.node_names:
            got = {topo.nodes[s] for s in range(topo.world_size)
                   if any(topo.nodes[p] == node for p in topo.peers_for(s, k))}
            assert set(senders[node]) == got and len(senders[node]) == k
            for src in senders[node]:  # every rank of a sending node sends to exactly one rank of this one
                assert all(sum(topo.nodes[p] == node for p in topo.peers_for(s, k)) == 1 for s in topo.ranks_on(src))
    assert topo.senders(1)["a"] == ("d",) and topo.senders(2)["c"] == ("b", "a")


def test_a_folder_whose_free_space_cannot_be_read_is_named(tmp_path: Path) -> None:
    room = space.measure(tmp_path / "missing", Share(own=1))
    assert room.place is None and room.error is not None and "missing" in room.error
    got = space.node_problems([room], Topology(("a",)), 0)
    assert got == [local_problem(room.error)] and isinstance(got[0], RankError)
    assert space.measure(tmp_path, Share()).place is not None


def test_share_of_separates_own_rows_from_tensors_every_rank_holds() -> None:
    st = {"w": objckpt.Shard(torch.zeros(10), (20,), (0,)), "p": torch.zeros(5, dtype=torch.float64),
          "nested": [torch.zeros(3, dtype=torch.uint8)], "n": 3}
    st["again"] = st["p"]  # the same tensor twice is counted once
    assert space.share_of(st) == Share(own=40, shared=43, shared_whole=43)
    assert space.share_of(st).total == 83


def _dtensor_shares(rank: int, world: int) -> list[Share]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard as DShard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    t = torch.zeros(8, 4)
    return [space.share_of({"d": distribute_tensor(t, mesh, [DShard(0)])}),
            space.share_of({"d": distribute_tensor(t, mesh, [Replicate()])})]


def test_share_of_dtensors_counts_sharded_as_own_and_replicated_as_shared() -> None:
    for sharded, replicated in run_multiprocess(2, _dtensor_shares):
        assert sharded == Share(own=64)
        assert replicated == Share(shared=128, shared_whole=128)


def test_a_tiered_save_asks_each_stateful_value_for_its_state_dict_once(tmp_path: Path) -> None:
    """The space check counts the state the save writes: one ``state_dict()`` per save, not one
    for the check and another for the save (an optimizer's can be costly)."""
    class Counted:
        calls = 0

        def state_dict(self) -> dict[str, Any]:
            Counted.calls += 1
            return {"w": torch.ones(16)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    m = objckpt.CheckpointManager(str(tmp_path / "root"), local_dir=str(tmp_path / "local"), replicas=0,
                                  persist_every=None, drain_retry_s=None)
    with m:
        m.save(1, {"opt": Counted()})
    assert Counted.calls == 1
    assert torch.equal(objckpt.read(str(tmp_path / "local" / "step-0000000001"))["opt"]["w"], torch.ones(16))
