"""A lost node's share restored from its peer into what a restarting job builds: a model made
on the meta device and given fresh memory (``to_empty``), its embedding and output weights
tied, and an optimizer that has not taken a step (no state yet).  The restore from a peer
receives whole chunks straight into the destination tensors (docs/tiering.md), so a tied
pair (one memory, two keys) and optimizer entries the load itself creates must come out as
from any other load.  Real gloo ranks, folders standing for nodes, nothing in object storage."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

import objckpt
from mp import run_multiprocess

VOCAB, DIM = 97, 24


class TinyLM(torch.nn.Module):
    """Embedding, one layer, and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.mlp = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mlp(self.embed(x))))


def _trained(seed: int) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        loss = model(torch.randint(0, VOCAB, (4, 5))).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _manager(rank: int, base: str) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(base + "/root", local_dir=base + "/{node}", node_override=f"n{rank}",
                                     replicas=1, persist_every=None, local_keep=2)


def _save(rank: int, world: int, base: str) -> None:
    model, opt = _trained(seed=7)  # the same on every rank (data parallel: replicated state)
    with _manager(rank, base) as m:
        m.save(3, {"model": model, "optim": opt, "step": 3})
        m.wait()


def _restore(rank: int, world: int, base: str) -> dict[str, Any]:
    with torch.device("meta"):
        model = TinyLM()
    model = model.to_empty(device="cpu")  # fresh memory, never written
    model.head.weight = model.embed.weight  # tied again, as the model's own code does
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # no step yet: no state to receive into
    with _manager(rank, base) as m:
        res = m.load({"model": model, "optim": opt, "step": -1})
    want_model, want_opt = _trained(seed=7)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), want_model.state_dict().values()))
    got_state, want_state = opt.state_dict()["state"], want_opt.state_dict()["state"]
    same_opt = sorted(got_state) == sorted(want_state) and all(
        torch.equal(got_state[i][k], want_state[i][k]) for i in want_state for k in want_state[i])
    return {"tiers": res.tiers, "source": res.source, "received": res.received_bytes, "model": same,
            "optim": same_opt, "tied": model.head.weight.data_ptr() == model.embed.weight.data_ptr()}


def test_a_lost_nodes_share_restores_from_its_peer_into_a_meta_built_tied_model_and_a_fresh_optimizer(
        tmp_path: Path) -> None:
    base = str(tmp_path)
    run_multiprocess(2, _save, base)
    shutil.rmtree(tmp_path / "n1")  # node n1 replaced: what its ranks read comes from n0's copy
    got = run_multiprocess(2, _restore, base)
    for rank, g in enumerate(got):
        assert g["tiers"] == {0: "local", 1: "peer"}, (rank, g)
        assert g["model"] and g["optim"] and g["tied"], (rank, g)
    assert got[1]["source"] == "peer" and got[1]["received"] > 0 and got[0]["received"] == 0
