"""Peer replication and repair of the local tier (objckpt.tier.topology, objckpt.tier.peers).

Real gloo ranks (tests/mp.py), temporary directories standing for nodes
(``OBJCKPT_NODE`` per rank), real files; a real SIGKILL for the dying rank.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import time
from typing import Any, Callable

import pytest

import mp
from objckpt.tier.peers import PeerCopyError, RepairReport, plan_repair
from objckpt.tier.topology import NODE_ENV, Topology, TopologyError
from objckpt.tier.transfer import TEMP_MARK

PIECE = 64 << 10  # small pieces: the bigger files take several rounds


# --------------------------------------------------------------------------- placement (no processes)


@pytest.mark.parametrize("nodes", [
    ("a", "a", "b", "b"),
    ("a", "a", "a", "b", "b", "b", "c", "c", "c"),
    ("x", "y", "x", "y", "z", "z"),  # ranks interleaved over nodes
    ("a", "a", "a", "a", "b", "b", "c"),  # uneven nodes
])
def test_peers_are_on_other_nodes_and_one_node_loss_keeps_a_copy(nodes: tuple[str, ...]) -> None:
    topo = Topology(nodes)
    n_nodes = len(set(nodes))
    for k in range(n_nodes):
        received = [0] * len(nodes)
        for r in range(len(nodes)):
            peers = topo.peers_for(r, k)
            assert len(peers) == k
            homes = [topo.node_of(p) for p in peers]
            assert topo.node_of(r) not in homes, (r, peers)
            assert len(set(homes)) == k, f"two copies of rank {r} on one node: {peers}"
            # k+1 copies on k+1 distinct nodes: losing any k nodes leaves one
            assert len(set([topo.node_of(r)] + homes)) == k + 1
            for p in peers:
                received[p] += 1
        if len({len(topo.ranks_on(n)) for n in topo.node_names}) == 1:
            assert received == [k] * len(nodes), "equal nodes: every rank holds exactly k copies"
        assert sorted(topo.sources_for(0, k)) == sorted(s for s in range(len(nodes)) if 0 in topo.peers_for(s, k))


def test_replicas_that_cannot_fit_are_refused_naming_the_values() -> None:
    topo = Topology(("a", "a", "b", "b"))
    with pytest.raises(TopologyError, match=r"replicas=2 needs 3 nodes.*4 ranks run on 2 node"):
        topo.peers_for(0, 2)
    with pytest.raises(ValueError, match=r"replicas=1 needs more than 1 ranks.*world size 1"):
        Topology(("solo",)).peers_for(0, 1)
    with pytest.raises(TopologyError, match=r"non-negative"):
        topo.peers_for(0, -1)
    with pytest.raises(TopologyError, match=r"rank 4 is not a rank"):
        topo.peers_for(4, 1)


def test_node_name_comes_from_override_then_env_then_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from objckpt.distributed.comm import LocalComm

    monkeypatch.delenv(NODE_ENV, raising=False)
    assert Topology.build(LocalComm()).nodes == (socket.gethostname(),)
    monkeypatch.setenv(NODE_ENV, "n7")
    assert Topology.build(LocalComm()).nodes == ("n7",)
    assert Topology.build(LocalComm(), node_override="n9").nodes == ("n9",)
    monkeypatch.setenv(NODE_ENV, "  ")
    with pytest.raises(TopologyError, match=NODE_ENV):
        Topology.build(LocalComm())


def test_repair_plan_sends_each_file_once_spread_over_holders() -> None:
    a, b, c = ("n0", "/d0"), ("n1", "/d1"), ("n2", "/d2")
    holdings = [
        (a, ["f1", "f2", "meta"], {"f1": 10, "f2": 20, "meta": 1}),
        (b, ["f3", "meta"], {"f3": 5, "meta": 1, "f5": 50, "f6": 60}),
        (c, ["f5", "f6", "meta", "lost"], {}),  # a replaced node: holds nothing
        (c, ["f6", "meta", "gone"], {}),  # shares that node's folder
    ]
    plan, missing = plan_repair(holdings)
    assert missing == {2: ("lost",), 3: ("gone",)}
    got = {(t.dst, t.rel): t.src for t in plan}
    # meta and f6 are written once into the shared folder, by its lowest rank
    assert set(got) == {(2, "f5"), (2, "f6"), (2, "meta")}
    assert got[(2, "f5")] == 1 and got[(2, "f6")] == 1
    assert got[(2, "meta")] == 0, "the second file goes to the holder with less load"
    # a holder whose size disagrees with the others' is not used
    odd = [(a, [], {"f": 10}), (b, [], {"f": 11}), (("n3", "/d3"), [], {"f": 10}), (c, ["f"], {})]
    plan, missing = plan_repair(odd)
    assert [(t.src, t.size) for t in plan] == [(0, 10)] and missing == {}


def test_files_of_rank_lists_what_each_rank_wrote(tmp_path: pathlib.Path) -> None:
    import torch

    import objckpt
    from objckpt.errors import NotFoundError
    from objckpt.format.manifest import Blob, Manifest, RankIndexRef
    from objckpt.tier.peers import files_of_rank

    step = tmp_path / "step-1"
    objckpt.save({"w": torch.arange(1000.0), "b": torch.ones(3)}, str(step))
    mine = files_of_rank(step, 0)
    assert mine and sorted(mine + ["manifest.json"]) == _listing(step), "every file but the manifest is rank 0's"
    assert files_of_rank(step, 0, with_manifest=True)[-1] == "manifest.json"
    assert files_of_rank(step, 1) == []
    two = Manifest(tensors={}, blobs=[Blob("blobs/a/r00000-0000.bin", 4, 0), Blob("blobs/a/r00001-0000.bin", 4, 1),
                                      Blob("spread/a/r00001-0001.bin", 4, 1, spread="0f")], tree=None,
                   rank_indexes=[RankIndexRef("blobs/a/r00000.index.json", 1, 0),
                                 RankIndexRef("blobs/a/r00001.index.json", 1, 0)])
    assert files_of_rank(step, 1, manifest=two) == ["blobs/a/r00001-0000.bin", "blobs/a/r00001.index.json"]
    with pytest.raises(NotFoundError, match="step-2"):
        files_of_rank(tmp_path / "step-2", 0)


# --------------------------------------------------------------------------- real ranks


def _content(rank: int, i: int, size: int) -> bytes:
    import random

    return random.Random(rank * 1000 + i).randbytes(size)


def _files(rank: int) -> dict[str, bytes]:
    sizes = [0, 1000 + rank, 3 * PIECE + 7 * rank + 1]  # empty, small, several pieces (unaligned)
    return {f"blobs/att/r{rank:05d}-{i:04d}.bin": _content(rank, i, s) for i, s in enumerate(sizes)}


def _listing(root: pathlib.Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _replicate_lose_repair(rank: int, world: int, base: str) -> dict[str, Any]:
    from objckpt.distributed.comm import get_comm
    from objckpt.tier.peers import repair, replicate

    os.environ[NODE_ENV] = f"node{rank // 2}"
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "60"
    comm = get_comm()
    topo = Topology.build(comm)
    root = pathlib.Path(base)
    step = root / f"node{rank // 2}" / "step-7"
    mine = _files(rank)
    for rel, data in mine.items():
        (step / rel).parent.mkdir(parents=True, exist_ok=True)
        (step / rel).write_bytes(data)
    if rank % 2 == 0:
        (step / "meta.json").write_bytes(b'{"step": 7}')  # every node folder holds the metadata
    comm.barrier()
    before = {n: _listing(root / n) for n in ("node0", "node1")}
    out: dict[str, Any] = {}
    try:
        replicate(comm, topo, step, list(mine), 2)
    except TopologyError as e:
        out["k2"] = str(e)
    comm.barrier()
    out["untouched"] = before == {n: _listing(root / n) for n in ("node0", "node1")}
    rep = replicate(comm, topo, step, list(mine), 1, piece_bytes=PIECE)
    comm.barrier()
    out["replica"] = rep
    other = root / f"node{1 - rank // 2}" / "step-7"
    out["copied"] = all((other / rel).read_bytes() == data for rel, data in mine.items())
    comm.barrier()
    if rank == 2:
        shutil.rmtree(root / "node1")  # node1 is replaced: its folder is gone
    comm.barrier()
    needed = list(mine) + ["meta.json"]
    out["repair"] = repair(comm, topo, step, needed, piece_bytes=PIECE)
    out["restored"] = all((step / rel).read_bytes() == data for rel, data in mine.items())
    out["meta"] = (step / "meta.json").read_bytes()
    comm.barrier()
    out["temps"] = [n for n in _listing(root) if TEMP_MARK in n]
    comm.barrier()
    if rank == 0:
        shutil.rmtree(root / "node0")
        shutil.rmtree(root / "node1")
    comm.barrier()
    out["nothing"] = repair(comm, topo, step, needed)
    return out


def test_replicate_then_repair_a_lost_node_bit_identically(tmp_path: pathlib.Path) -> None:
    res = run_ranks(4, _replicate_lose_repair, str(tmp_path))
    for r, out in enumerate(res):
        assert "replicas=2 needs 3 nodes" in out["k2"] and "2 node(s)" in out["k2"], out["k2"]
        assert out["untouched"], "a refused replication wrote nothing"
        assert out["copied"] and out["restored"] and out["meta"] == b'{"step": 7}'
        assert out["temps"] == []
        assert out["replica"].peers == {0: (2,), 1: (3,), 2: (0,), 3: (1,)}
    # every rank returns the same outcome
    assert all(out["repair"].restored == res[0]["repair"].restored for out in res)
    assert all(out["nothing"].missing == res[0]["nothing"].missing for out in res)
    rep: RepairReport = res[0]["repair"]
    assert rep.complete
    files2, files3 = _files(2), _files(3)
    assert {(x.rank, x.file) for x in rep.restored} == (
        {(2, f) for f in files2} | {(3, f) for f in files3} | {(2, "meta.json"), (3, "meta.json")})
    for x in rep.restored:  # each came from a holder on the surviving node
        assert x.source in (0, 1), x
    assert {rep.source_of(2, f) for f in files2} | {rep.source_of(3, f) for f in files3} == {0, 1}, \
        "both holders on the surviving node send a part"
    nothing: RepairReport = res[0]["nothing"]
    assert nothing.restored == () and not nothing.complete
    for r in range(4):
        assert sorted(nothing.missing_for(r)) == sorted(list(_files(r)) + ["meta.json"])


def _refusals_and_peer_dir(rank: int, world: int, base: str) -> dict[str, str]:
    from objckpt.distributed.comm import get_comm
    from objckpt.tier.peers import replicate

    os.environ[NODE_ENV] = f"node{rank}"
    comm = get_comm()
    topo = Topology.build(comm)
    root = pathlib.Path(base)
    step = root / f"node{rank}"
    step.mkdir(parents=True, exist_ok=True)
    (step / "mine.bin").write_bytes(_content(rank, 5, 3 * PIECE + 5))
    (step / "a-file").write_bytes(b"")
    out: dict[str, str] = {}
    files = ["mine.bin"] if rank == 0 else ["mine.bin", "not-there.bin"]
    for case, listed, where in [
        ("lacking", files, None),
        # rank 1 cannot write what it receives (its replica folder would be under a file)
        ("unwritable", ["mine.bin"], (lambda src: step / "a-file" / "x") if rank == 1 else None),
        ("peer_dir", ["mine.bin"], lambda src: root / f"node{rank}" / "replicas" / f"from-{src}"),
    ]:
        try:
            replicate(comm, topo, step, listed, 1, peer_dir=where, piece_bytes=PIECE)
            out[case] = "no error"
        except PeerCopyError as e:
            out[case] = f"{type(e).__name__} {sorted(e.failures)}: {e}"
        comm.barrier()
        out[case + " files"] = " ".join(_listing(root))
        comm.barrier()
    return out


def test_local_failures_are_refused_on_every_rank_and_replicas_go_to_peer_dir(tmp_path: pathlib.Path) -> None:
    res = run_ranks(2, _refusals_and_peer_dir, str(tmp_path))
    assert res[0] == res[1], res
    out = res[0]
    # a listed file one rank lacks: refused before anything is sent
    assert out["lacking"].startswith("PeerCopyError [1]: replicate: nothing was sent") and "not-there.bin" in out[
        "lacking"], out
    assert out["lacking files"] == "node0/a-file node0/mine.bin node1/a-file node1/mine.bin"
    # rank 1 cannot write: both ranks raise, and rank 0's received copy is not renamed into place either
    assert out["unwritable"].startswith("PeerCopyError [1]: replicate failed; nothing was renamed") and \
        "rank 1: writing 'mine.bin' from rank 0" in out["unwritable"], out
    assert out["unwritable files"] == out["lacking files"], "no file (nor temp file) was left behind"
    assert out["peer_dir"] == "no error"
    assert out["peer_dir files"].split() == ["node0/a-file", "node0/mine.bin", "node0/replicas/from-1/mine.bin",
                                             "node1/a-file", "node1/mine.bin", "node1/replicas/from-0/mine.bin"]
    for r in (0, 1):
        copy = tmp_path / f"node{1 - r}" / "replicas" / f"from-{r}" / "mine.bin"
        assert copy.read_bytes() == _content(r, 5, 3 * PIECE + 5)


# --------------------------------------------------------------------------- a rank killed mid-copy


def _replicate_with_rank1_hooked(rank: int, base: str, folder: str, name: str, pieces: int, timeout: str,
                                  on_fourth_read: Callable[[], None]) -> dict[str, Any]:
    """Both ranks replicate one file of ``pieces`` pieces; rank 1 calls ``on_fourth_read``
    at its fourth piece read (dies, stalls).  The outcome each rank saw, and its folder."""
    from objckpt.distributed.comm import get_comm
    from objckpt.tier import transfer
    from objckpt.tier.peers import replicate

    os.environ[NODE_ENV] = f"node{rank}"
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = timeout
    comm = get_comm()
    topo = Topology.build(comm)
    step = pathlib.Path(base) / f"node{rank}" / folder
    step.mkdir(parents=True)
    file = name.format(rank=rank)
    (step / file).write_bytes(_content(rank, 0, pieces * PIECE))
    if rank == 1:
        real, calls = transfer._read_piece, [0]

        def hooked(*a: Any) -> Any:
            calls[0] += 1
            if calls[0] == 4:
                on_fourth_read()
            return real(*a)

        transfer._read_piece = hooked
    t0 = time.monotonic()
    try:
        replicate(comm, topo, step, [file], 1, piece_bytes=PIECE)
        err = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = f"{type(e).__module__}.{type(e).__name__}: {e}"
    return {"error": err, "seconds": time.monotonic() - t0, "files": _listing(step)}


def _die_while_replicating(rank: int, world: int, base: str) -> dict[str, Any]:
    # three pieces are on their way when rank 1 dies
    return _replicate_with_rank1_hooked(rank, base, "step-3", "r{rank:05d}.bin", 40, "30",
                                        lambda: os.kill(os.getpid(), signal.SIGKILL))


def test_a_rank_killed_while_replicating_leaves_no_partial_file_and_a_clear_error(tmp_path: pathlib.Path) -> None:
    results, exitcodes = mp.run_allowing_death(2, _die_while_replicating, str(tmp_path), timeout=90)
    assert exitcodes[1] == -signal.SIGKILL
    out = results[0]
    assert out["error"].startswith("objckpt.errors.CollectiveError: replicate: rank 0 of 2"), out
    assert "rank 1" in out["error"]
    assert out["files"] == ["r00000.bin"], "rank 1's file is not under its final name, nor left as a temp"


def _stall_while_replicating(rank: int, world: int, base: str) -> dict[str, Any]:
    # rank 1 is alive but stuck (a swapping host, a stopped process): it stops answering
    return _replicate_with_rank1_hooked(rank, base, ".", "share.bin", 20, "1.5", lambda: time.sleep(3.5))


def test_a_rank_that_stops_answering_is_an_error_after_the_collective_timeout(tmp_path: pathlib.Path) -> None:
    results, _codes = mp.run_allowing_death(2, _stall_while_replicating, str(tmp_path), timeout=90)
    waiting, stuck = results[0], results[1]
    assert waiting["error"].startswith("objckpt.errors.CollectiveError: replicate: rank 0 of 2"), waiting
    assert "Timed out" in waiting["error"], waiting  # gloo's timeout, set from OBJCKPT_COLLECTIVE_TIMEOUT
    # the stuck rank, once it goes on, finds its peer gone: the same error class, not a bare RuntimeError
    assert stuck["error"].startswith("objckpt.errors.CollectiveError: replicate: rank 1 of 2"), stuck
    assert waiting["files"] == stuck["files"] == ["share.bin"]


# --------------------------------------------------------------------------- runners


def run_ranks(nproc: int, fn: Any, *args: Any) -> list[Any]:
    return mp.run_multiprocess(nproc, fn, *args, timeout=120)




# --------------------------------------------------------------------------- restores that move only what is read

ROWS, COLS = 6, 1001  # unaligned rows


def _rows(rank: int, world: int, step: int, dtensor: bool = False, shared: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s rows of one tensor (nothing replicated: each rank reads only its own share):
    an ``objckpt.Shard`` (format v1: chunks in the manifest) or a DTensor (v2: rank indexes)."""
    import math

    import torch

    import objckpt

    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step
    if shared:  # a plain tensor every rank holds whole (one rank writes it, every rank reads it)
        return {**_rows(rank, world, step, dtensor), "b": torch.arange(37, dtype=torch.float64) + step}
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        return {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)]), "step": step}
    per = math.ceil(ROWS / world)
    lo, hi = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    return {"w": objckpt.Shard(full[lo:hi].clone(), (ROWS, COLS), (lo, 0)), "step": step}


def _tier_manager(rank: int, base: str, node: str) -> Any:
    import objckpt

    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "60"
    return objckpt.CheckpointManager(str(pathlib.Path(base) / "root"), local_dir=str(pathlib.Path(base) / "{node}"),
                                     replicas=1, persist_every=None, local_keep=2, node_override=node)


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t.local


def _save_tiered(rank: int, world: int, base: str, dtensor: bool = False, shared: bool = False) -> list[str]:
    with _tier_manager(rank, base, f"n{rank}") as m:
        for s in (1, 2):
            m.save(s, _rows(rank, world, s, dtensor, shared))
        m.wait()
    step = pathlib.Path(base) / f"n{rank}" / "step-0000000002"
    return _listing(step)


def _restore_tiered(rank: int, world: int, base: str, nodes: tuple[str, ...], dtensor: bool = False,
                    shared: bool = False) -> dict[str, Any]:
    import torch

    with _tier_manager(rank, base, nodes[rank]) as m:
        st = _rows(rank, world, 0, dtensor, shared)
        _local(st["w"]).zero_()
        if shared:
            st["b"].zero_()
        res = m.load(st)
        want = _rows(rank, world, res.step, dtensor, shared)
        report = m._tiers.last_restore
        same = not shared or torch.equal(st["b"], want["b"])
        return {"step": res.step, "tiers": res.tiers, "report": report, "received_bytes": res.received_bytes,
                "equal": torch.equal(_local(st["w"]), _local(want["w"])) and st["step"] == res.step and same,
                "folder": _listing(pathlib.Path(base) / nodes[rank] / "step-0000000002")}


def test_restore_plan_counts_a_rank_local_when_its_folder_holds_what_its_load_reads() -> None:
    from objckpt.tier.local import LocalStep
    from objckpt.tier.restore import Holding, plan_restore

    meta = ["manifest.json", "i0", "i1", "i2"]
    every = meta + ["b0", "b1", "b2"]
    # three nodes, replicas=1: each folder holds its own blob and its ring neighbour's copy, never all three
    held = {0: ["b0", "b2"], 1: ["b1", "b0"], 2: ["b2", "b1"]}
    steps = {r: {5: LocalStep(5, every, meta + held[r])} for r in range(3)}
    reads = [Holding(f"n{r}", steps[r], {5: ("manifest.json", f"i{r}", f"b{r}")}) for r in range(3)]
    plan = plan_restore(reads, [], peers=True)
    assert plan.step == 5 and plan.sources == ["local"] * 3 and plan.wants == [(), (), ()]
    # unknown reads (no template): the whole step is needed, as before
    assert plan_restore([Holding(f"n{r}", steps[r]) for r in range(3)], [], peers=True).sources == ["peer"] * 3
    # rank 1 reads rank 0's blob too (resharding) and its folder lost it: only that blob is wanted
    steps[1] = {5: LocalStep(5, every, meta + ["b1"])}
    reads[1] = Holding("n1", steps[1], {5: ("manifest.json", "i0", "i1", "b0", "b1")})
    plan = plan_restore(reads, [], peers=True)
    assert plan.sources == ["local", "peer", "local"] and plan.wants[1] == ("b0",)
    # a replaced node's rank does not know its reads yet (no manifest): it learns them from its peers
    reads[1] = Holding("n1", {})
    plan = plan_restore(reads, [], peers=True)
    assert plan.sources == ["local", "peer", "local"] and plan.wants[1] is None


@pytest.mark.parametrize("dtensor", [False, True], ids=["shard-v1", "dtensor-v2"])
def test_three_nodes_restore_locally_then_a_lost_node_receives_only_its_share_into_memory(
        tmp_path: pathlib.Path, dtensor: bool) -> None:
    base = str(tmp_path)
    listings = run_ranks(3, _save_tiered, base, dtensor)
    for r, names in enumerate(listings):  # replicas=1 on 3 nodes: no folder holds the whole step
        assert sum(1 for n in names if n.endswith(".bin")) == 2, names
    nodes = ("n0", "n1", "n2")

    healthy = run_ranks(3, _restore_tiered, base, nodes, dtensor)
    for r, out in enumerate(healthy):
        assert out["equal"] and out["step"] == 2
        assert out["tiers"] == {0: "local", 1: "local", 2: "local"}, out["tiers"]
        rep = out["report"]
        assert rep.bytes_moved == 0 and rep.rounds == 0 and rep.received == {} and out["received_bytes"] == 0
        assert out["folder"] == listings[r], "a healthy restore writes nothing"

    shutil.rmtree(tmp_path / "n1")  # node n1 replaced: its folder is gone
    lost = run_ranks(3, _restore_tiered, base, nodes, dtensor)
    for r, out in enumerate(lost):
        assert out["equal"] and out["step"] == 2, f"rank {r} not bit-identical"
        assert out["tiers"] == {0: "local", 1: "peer", 2: "local"}, out["tiers"]
        rep = out["report"]
        assert set(rep.bytes_by_rank) == {1}, "only the lost node's rank received anything"
        assert not rep.written
    rep1 = lost[1]["report"]
    import objckpt
    from objckpt.tier.local import files_of

    m = objckpt.inspect(str(tmp_path / "n0" / "step-0000000002"))
    want = sorted(["manifest.json"] + files_of(m, 1))  # the manifest, its own index and blob: its share
    assert sorted(rep1.received) == want, rep1.received
    # the manifest, then (format v2) the rank indexes its template needs, then its blob
    assert rep1.rounds == (3 if dtensor else 2) and any(n.endswith(".index.json") for n in want) == dtensor
    blob = next(n for n in want if n.endswith(".bin"))
    # from n2, which holds n1's replica (the ring n0 -> n1 -> n2 -> n0), at the size the manifest gives
    assert rep1.received[blob] == (2, next(b.size for b in m.blobs if b.name == blob))
    # its rows are read whole into host memory: received straight into the template's tensor
    assert rep1.in_place_bytes == ROWS // 3 * COLS * 4, rep1
    assert lost[1]["received_bytes"] == rep1.bytes_moved == sum(size for _src, size in rep1.received.values())
    assert lost[1]["folder"] == [], "the received files were held in memory, never written to the folder"


def test_a_local_tier_on_two_nodes_reshards_to_three_ranks_on_three_nodes(tmp_path: pathlib.Path) -> None:
    base = str(tmp_path)
    run_ranks(2, _save_tiered, base)
    # world 2 -> 3: rank 2 runs on a new node (no folder); its rows were written by rank 1
    got = run_ranks(3, _restore_tiered, base, ("n0", "n1", "n2"))
    assert all(out["equal"] and out["step"] == 2 for out in got)
    assert got[0]["tiers"] == {0: "local", 1: "local", 2: "peer"}
    rep = got[2]["report"]
    assert set(rep.bytes_by_rank) == {2} and all(out["folder"] == _listing(tmp_path / n / "step-0000000002")
                                                 for out, n in zip(got, ("n0", "n1", "n2")))
    blobs = sorted(n for n in rep.received if n.endswith(".bin"))
    assert len(blobs) == 1 and "r00001-" in blobs[0], f"rank 2's rows 4-5 are in rank 1's blob only: {blobs}"


def _restore_expect_error(rank: int, world: int, base: str, nodes: tuple[str, ...]) -> str:
    import objckpt

    try:
        _restore_tiered(rank, world, base, nodes)
    except objckpt.ObjckptError as e:
        return f"{type(e).__name__}: {e}"
    return "restored"


def test_bytes_received_in_place_are_still_checked_against_their_crc32c(tmp_path: pathlib.Path) -> None:
    base = str(tmp_path)
    run_ranks(2, _save_tiered, base)
    copy = next((tmp_path / "n0" / "step-0000000002" / "blobs").rglob("r00001-*.bin"))  # n1's share, on n0
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "n1")
    got = run_ranks(2, _restore_expect_error, base, ("n0", "n1"))
    assert "crc32c mismatch" in got[1] and "r00001-" in got[1], got
    # rank 0 raises the class of rank 1's failure (errors cross ranks as their class), naming rank 1
    assert got[0].startswith("CorruptCheckpointError") and "rank(s) [1]" in got[0] and "crc32c mismatch" in got[0], \
        got[0]


def test_the_overlay_serves_received_pieces_in_place_copies_the_rest_and_reads_gaps_as_zeros(
        tmp_path: pathlib.Path) -> None:
    import torch

    from objckpt.runtime import loop
    from objckpt.storage.local import LocalStore
    from objckpt.tier.overlay import OverlayStore, ReadOnlyStoreError

    (tmp_path / "on-disk.bin").write_bytes(b"folder")
    dest = torch.zeros(8, dtype=torch.uint8)
    dest[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # received in place: bytes 10..14 of "f"
    tail = torch.tensor([7, 8], dtype=torch.uint8)  # bytes 16..18, in memory of its own
    prefix = str(tmp_path).strip("/")
    st = OverlayStore(LocalStore("/"), {f"{prefix}/f": [(16, tail), (10, dest[:4])]})
    out = memoryview(dest.numpy())[:4]
    loop.run(st.get_range_into(f"{prefix}/f", 10, out))  # where the bytes already are: no copy
    assert dest[:4].tolist() == [1, 2, 3, 4]
    assert loop.run(st.get_range(f"{prefix}/f", 10, 8)) == bytes([1, 2, 3, 4, 0, 0, 7, 8])  # a gap reads as zeros
    assert loop.run(st.get(f"{prefix}/on-disk.bin")) == b"folder"  # not received: from the folder
    assert loop.run(st.head(f"{prefix}/f")).size == 18
    with pytest.raises(ReadOnlyStoreError):
        loop.run(st.put(f"{prefix}/f", b"x"))


def test_a_healthy_restart_fetches_only_the_bytes_of_another_nodes_blob_a_rank_reads(tmp_path: pathlib.Path) -> None:
    import objckpt

    base = str(tmp_path)
    run_ranks(3, _save_tiered, base, False, True)
    m = objckpt.inspect(str(tmp_path / "n0" / "step-0000000002"))
    (chunk,) = m.tensors["b"].chunks  # the shared tensor: one rank wrote it
    writer = m.blobs[chunk.blob].rank
    reader = (writer + 2) % 3  # its node holds neither the writer's blob nor the ring's copy of it
    got = run_ranks(3, _restore_tiered, base, ("n0", "n1", "n2"), False, True)
    assert all(out["equal"] and out["step"] == 2 for out in got)
    assert got[0]["tiers"] == {r: "peer" if r == reader else "local" for r in range(3)}
    rep = got[reader]["report"]
    # its folder holds the manifest: one round, for the 296 bytes of "b" in the writer's blob, received in place
    ((name, (source, size)),) = rep.received.items()
    assert rep.rounds == 1 and name == m.blobs[chunk.blob].name and size == 37 * 8
    assert source in (writer, (writer + 1) % 3), "from the writer's node or the one holding its copy"
    assert rep.in_place_bytes == rep.bytes_moved == 37 * 8 and got[reader]["received_bytes"] == 37 * 8
