"""Read amplification of resharded loads: bytes a rank fetches against bytes it needs.

A checkpoint saved at world N with FSDP2's layout (every tensor ``Shard(0)`` over a
1-D mesh, torch's uneven split) is loaded at world M: each rank of M wants its own
row range of every tensor.  :func:`measure` loads each of those ranks' boxes in this
process (``objckpt.Shard`` destinations, exactly the boxes a DTensor of M would ask
for) through a :class:`~objckpt.testing.stores.CountingStore`, and reports per rank
the tensor bytes fetched (ranged GETs, merged gaps and crc-block widening included)
against the bytes of its share.  Whole-object GETs (the manifest, rank indexes) are
reported apart: they do not grow with the share.

Used by ``tests/test_reshard_bytes.py`` (the <= 1.1x bound) and
``benchmarks/bench_reshard_bytes.py`` (the table in docs/benchmarks.md).  The save
at world N needs N processes in a process group; :func:`save_rank` is what each runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

import objckpt

from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore

Shapes = dict[str, tuple[int, ...]]


def tiny_llama(dim: int = 128, layers: int = 2, vocab: int = 512, hidden: int = 344,
               moments: bool = True) -> Shapes:
    """Parameter shapes of a small Llama (and AdamW's two moments of each, as FSDP2
    checkpoints them): few-KB norms, 64-256 KB matrices at the defaults."""
    shapes: Shapes = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        for n in ("wq", "wk", "wv", "wo"):
            shapes[f"{p}attention.{n}.weight"] = (dim, dim)
        shapes[f"{p}feed_forward.w1.weight"] = (hidden, dim)
        shapes[f"{p}feed_forward.w2.weight"] = (dim, hidden)
        shapes[f"{p}feed_forward.w3.weight"] = (hidden, dim)
        shapes[f"{p}attention_norm.weight"] = (dim,)
        shapes[f"{p}ffn_norm.weight"] = (dim,)
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (vocab, dim)
    if not moments:
        return shapes
    out = {f"model.{k}": s for k, s in shapes.items()}
    for m in ("exp_avg", "exp_avg_sq"):
        out.update({f"optim.{k}.{m}": s for k, s in shapes.items()})
    return out


def fsdp_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of ``rank`` under ``Shard(0)``: torch splits in chunks of
    ceil(rows / world), so the last ranks may hold fewer rows, or none."""
    step = -(-rows // world) if rows else 0
    start = min(rows, rank * step)
    return start, min(rows, start + step)


def full_tensor(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The deterministic global value of ``key`` (the same on every rank and at load)."""
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 7919 + len(shape))
    return torch.randn(shape, generator=g)


def save_rank(rank: int, world: int, uri: str, shapes: Shapes, storage_options: Optional[dict] = None,
              **save_kw: Any) -> int:
    """One rank of a world-``world`` save (run inside a process group): every tensor a
    ``Shard(0)`` DTensor on a 1-D CPU mesh, as FSDP2 holds parameters and moments."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for k, s in shapes.items():
        a, b = fsdp_rows(s[0], world, rank)
        local = full_tensor(k, s)[a:b].clone()
        state[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(s),
                                      stride=torch.empty(s).stride())
    return objckpt.save(state, uri, storage_options=storage_options, **save_kw).bytes


@dataclass(frozen=True)
class RankBytes:
    """What one rank of the loading world moved."""

    rank: int
    needed: int  # bytes of its share
    fetched: int  # tensor bytes fetched by ranged GETs (widening and merged gaps included)
    metadata: int  # whole-object GETs: manifest and rank indexes
    requests: int  # ranged GETs

    @property
    def ratio(self) -> float:
        return self.fetched / self.needed if self.needed else 1.0


def load_rank(uri: str, shapes: Shapes, world: int, rank: int, storage_options: Optional[dict] = None,
              check: bool = True) -> RankBytes:
    """Load ``rank``'s share at world ``world`` in this process, counting bytes."""
    counting = CountingStore(open_store(uri, storage_options)[0])
    target: dict[str, Any] = {}
    needed = 0
    for k, s in shapes.items():
        a, b = fsdp_rows(s[0], world, rank)
        target[k] = objckpt.Shard(torch.zeros((b - a, *s[1:])), s, (a, *[0] * (len(s) - 1)))
        needed += target[k].local.numel() * target[k].local.element_size()
    objckpt.load(target, uri, store=counting, no_dist=True)
    if check:
        for k, s in shapes.items():
            a, b = fsdp_rows(s[0], world, rank)
            if not torch.equal(target[k].local, full_tensor(k, s)[a:b]):
                raise AssertionError(f"rank {rank}/{world}: {k!r} loaded wrong values")
    ranged = sum(n for _, _, n in counting.ranges)
    return RankBytes(rank, needed, ranged, counting.bytes_read - ranged, counting.ops["get_range"])


def measure(uri: str, shapes: Shapes, world: int, storage_options: Optional[dict] = None) -> list[RankBytes]:
    """Every rank of world ``world``, one after another."""
    return [load_rank(uri, shapes, world, r, storage_options) for r in range(world)]
