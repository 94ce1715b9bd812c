"""The models and the objckpt internals that the planning benchmarks use (no I/O).

``70b`` (the default, :func:`llama_defs`): a 70B Llama-like state (80 layers, hidden 8192,
64 heads, 8 KV heads, FFN 28672, vocab 128256;
bf16 params + fp32 Adam ``exp_avg``/``exp_avg_sq`` + a 0-d ``step``: 2892 tensors, 706 GB) laid
out FSDP x TP on a (dp, tp) mesh: column-parallel weights and the vocab-parallel embedding
``[Shard(0), Shard(0)]``, row-parallel (o, down) ``[Shard(0), Shard(1)]``, norms
``[Shard(0), Replicate()]``, ``step`` a plain tensor on every rank.

``dense-1t``: the same architecture at about 1T parameters (128 layers, hidden 16384,
128 heads, 16 KV heads, FFN 147456: 4,620 tensors, 10.1 TB with Adam state).

``moe-1t`` (:func:`moe_defs`): a 1T mixture-of-experts state shaped like Kimi K2 / DeepSeek-V3
(61 layers, the first dense, hidden 7168, 384 routed experts of FFN 2048 and one shared expert,
vocab 163840; GQA attention instead of MLA: 3,168 tensors, 10.3 TB with Adam state).  Dense
parameters are laid out like the 70B's on (world/tp, tp); the routed experts are stacked per
layer as torchtitan's ``GroupedExperts`` (``w1``/``w3`` (E, ffn, hidden), ``w2`` (E, hidden, ffn))
on a (dp, ep, tp) mesh: experts ``Shard(0)`` over ep, FSDP ``Shard(1)`` over dp (what
torchtitan picks when dp x ep exceeds the experts), expert-TP ``Shard(1)`` (``w1``/``w3``) or
``Shard(2)`` (``w2``) over tp.  The router's gate (E, hidden) is FSDP x TP-replicated ``[S0, R]``.

**Library internals**: planning has no public API, so these benchmarks call objckpt's
internal functions. Every one of them is imported in :func:`internals` and nowhere else, so a
restructure of the library is repointed here.
"""
from __future__ import annotations

import functools
import math
import random
import sys
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

MiB, GiB = 1 << 20, 1 << 30
BLOB_SIZE, PART_SIZE, CRC_BLOCK = 1 << 30, 16 * MiB, 1 * MiB  # objckpt's S3 defaults
MIN_PART, MAX_PART = 5 * MiB, 5 * GiB
ATTEMPT = "20261122T000000-000000000000"
S0, S1, R = ("S", 0), ("S", 1), ("R",)
S2 = ("S", 2)
#: per kind: its placements on its mesh (None: a plain tensor, replicated on every rank)
PLACEMENTS: dict[str, Optional[tuple]] = {"col": (S0, S0), "row": (S0, S1), "norm": (S0, R), "plain": None,
                                          "ecol": (S1, S0, S1), "erow": (S1, S0, S2)}
#: per kind: which of :func:`mesh_shapes`' meshes it lies on (0: every rank, 1: (dp, tp), 2: (dp, ep, tp))
KIND_MESH: dict[str, int] = {"plain": 0, "col": 1, "row": 1, "norm": 1, "ecol": 2, "erow": 2}
MESH_DIM_NAMES: tuple[tuple[str, ...], ...] = (("world",), ("dp", "tp"), ("dp", "ep", "tp"))


def mesh_shapes(world: int, tp: int, ep: int) -> list[tuple[int, ...]]:
    """The shapes of the three meshes the models' tensors lie on, for ``world`` ranks."""
    if world % (tp * ep):
        raise ValueError(f"{world} ranks do not divide into tp {tp} x ep {ep}")
    return [(world,), (world // tp, tp), (world // (tp * ep), ep, tp)]


@functools.lru_cache(maxsize=None)
def internals() -> types.SimpleNamespace:
    """Every objckpt internal the planning benchmarks call: the one place to repoint them."""
    import objckpt
    from objckpt.runtime import loop as _runtime
    from objckpt.checksum import crc32c
    from objckpt.format import keys, rank_index
    from objckpt.format.manifest import Blob, Chunk, ChunkRecord, Mesh, RankIndexRef, decode, encode, to_json_obj
    try:
        from objckpt.format.entry_json import chunk_dict as _chunk_to_json
    except ImportError:  # a tree from before format/entry_json.py
        from objckpt.format.manifest import _chunk_to_json  # type: ignore[attr-defined,no-redef]
    from objckpt.format.spread import Placement
    from objckpt.format.tree import encode_tree
    from objckpt.layout.base import PLAN_CACHE, ManifestCommon, RankOutcome
    from objckpt.layout.gathered import GatheredLayout, RankReport, check_coverage
    from objckpt.layout.symbolic import RankIndexResolver, SymbolicLayout
    from objckpt.planning.assign import TensorMeta, assign_writes, check_consistent
    from objckpt.planning.pack import PackLimits, pack_items
    from objckpt.planning.read_plan import ChunkIndex, plan_piece
    from objckpt.planning.symbolic import (SymbolicDescription, TensorDesc, assign_shard_specs, cell_box, overlapping_pieces,
                                           plan_rank_writes_symbolic)
    from objckpt.save.pipeline import _tree_digest
    from objckpt.storage.memory import MemoryStore

    limits = PackLimits(BLOB_SIZE, PART_SIZE, MIN_PART, MAX_PART)  # what a save to S3 packs to
    return types.SimpleNamespace(**{k: v for k, v in locals().items()})


#: a tensor leaf in the state skeleton (``None`` is a value: ``fused=None`` in param groups)
TENSOR = "<tensor>"


@dataclass(frozen=True)
class TDef:
    key: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    kind: str


def _attention(p: str, hidden: int, kv: int) -> list[tuple[str, tuple[int, ...], str]]:
    """One layer's q/k/v/o projections (grouped-query: k and v have ``kv`` rows)."""
    return [(p + "self_attn.q_proj.weight", (hidden, hidden), "col"),
            (p + "self_attn.k_proj.weight", (kv, hidden), "col"),
            (p + "self_attn.v_proj.weight", (kv, hidden), "col"),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "row")]


def llama_defs(layers: int = 80, hidden: int = 8192, heads: int = 64, kv_heads: int = 8, ffn: int = 28672,
               vocab: int = 128256) -> tuple[list[TDef], dict[str, Any]]:
    """Tensor definitions (keys as objckpt flattens them) and the nested state skeleton
    (tensor leaves ``TENSOR``) that ``save()`` would be given."""
    kv = kv_heads * (hidden // heads)
    params: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "col")]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += _attention(p, hidden, kv) + [
                   (p + "mlp.gate_proj.weight", (ffn, hidden), "col"), (p + "mlp.up_proj.weight", (ffn, hidden), "col"),
                   (p + "mlp.down_proj.weight", (hidden, ffn), "row"),
                   (p + "input_layernorm.weight", (hidden,), "norm"),
                   (p + "post_attention_layernorm.weight", (hidden,), "norm")]
    params += [("model.norm.weight", (hidden,), "norm"), ("lm_head.weight", (vocab, hidden), "col")]
    defs = [TDef(f"model.{fqn}", shape, "bfloat16", 2, kind) for fqn, shape, kind in params]
    return defs, _optim(params, defs)


def _optim(params: list[tuple[str, tuple[int, ...], str]], defs: list[TDef]) -> dict[str, Any]:
    """Adam's state keys (in get_state_dict's order) appended to ``defs``; the state skeleton."""
    for fqn, shape, kind in params:
        defs += [TDef(f"optim.state.{fqn}.step", (), "float32", 4, "plain"),
                 TDef(f"optim.state.{fqn}.exp_avg", shape, "float32", 4, kind),
                 TDef(f"optim.state.{fqn}.exp_avg_sq", shape, "float32", 4, kind)]
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False, "foreach": None,
             "maximize": False, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": False, "params": [fqn for fqn, _, _ in params]}
    return {"model": {fqn: TENSOR for fqn, _, _ in params},
            "optim": {"state": {fqn: {"step": TENSOR, "exp_avg": TENSOR, "exp_avg_sq": TENSOR}
                                for fqn, _, _ in params},
                      "param_groups": [group]}}


def moe_defs(layers: int = 61, dense_layers: int = 1, hidden: int = 7168, heads: int = 64, kv_heads: int = 8,
             ffn: int = 18432, experts: int = 384, expert_ffn: int = 2048, vocab: int = 163840
             ) -> tuple[list[TDef], dict[str, Any]]:
    """A mixture-of-experts state (see the module docstring), as :func:`llama_defs` gives it."""
    kv = kv_heads * (hidden // heads)
    params: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "col")]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += _attention(p, hidden, kv)
        if i < dense_layers:
            params += [(p + "mlp.gate_proj.weight", (ffn, hidden), "col"),
                       (p + "mlp.up_proj.weight", (ffn, hidden), "col"),
                       (p + "mlp.down_proj.weight", (hidden, ffn), "row")]
        else:
            params += [(p + "moe.router.gate.weight", (experts, hidden), "norm"),
                       (p + "moe.experts.w1", (experts, expert_ffn, hidden), "ecol"),
                       (p + "moe.experts.w2", (experts, hidden, expert_ffn), "erow"),
                       (p + "moe.experts.w3", (experts, expert_ffn, hidden), "ecol"),
                       (p + "moe.shared_experts.w1.weight", (expert_ffn, hidden), "col"),
                       (p + "moe.shared_experts.w2.weight", (hidden, expert_ffn), "row"),
                       (p + "moe.shared_experts.w3.weight", (expert_ffn, hidden), "col")]
        params += [(p + "input_layernorm.weight", (hidden,), "norm"),
                   (p + "post_attention_layernorm.weight", (hidden,), "norm")]
    params += [("model.norm.weight", (hidden,), "norm"), ("lm_head.weight", (vocab, hidden), "col")]
    defs = [TDef(f"model.{fqn}", shape, "bfloat16", 2, kind) for fqn, shape, kind in params]
    return defs, _optim(params, defs)


#: the ``--model`` choices: name -> (tensor definitions, state skeleton)
MODELS: dict[str, Callable[..., tuple[list[TDef], dict[str, Any]]]] = {
    "70b": llama_defs,
    "dense-1t": functools.partial(llama_defs, layers=128, hidden=16384, heads=128, kv_heads=16, ffn=147456),
    "moe-1t": moe_defs,
}


def model_defs(name: str, layers: Optional[int] = None) -> tuple[list[TDef], dict[str, Any]]:
    """A model of :data:`MODELS`; ``layers``: fewer layers, for quick runs and tests."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    return MODELS[name]() if layers is None else MODELS[name](layers=layers)


def encoded_tree(state: dict[str, Any]) -> Any:
    """The JSON tree objckpt stores (tensor leaves -> ``{"$tensor": key}``)."""
    import torch

    leaf = torch.empty(0, device="meta")

    def fill(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: (leaf if v == TENSOR else fill(v)) for k, v in x.items()}
        return [fill(v) for v in x] if isinstance(x, list) else x

    return internals().encode_tree(fill(state), lambda k, t: None)


def local_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Optional[Sequence[tuple]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) at ``coord``: torch's ``compute_local_shape_and_global_offset``
    in pure Python (fast enough for thousands of ranks; checked against torch on sample ranks).
    Mesh dims shard left to right with torch.chunk's sizes; an empty shard's offset is the dim's size."""
    if placements is None:
        return tuple(0 for _ in global_shape), tuple(global_shape)
    local = list(global_shape)
    offs: dict[int, int] = {}
    for md, p in enumerate(placements):
        if p[0] != "S":
            continue
        d, n, r, cur = p[1], mesh_shape[md], coord[md], local[p[1]]
        full = -(-cur // n)
        start = min(cur, full * r)
        size = max(0, min(cur, start + full) - start)
        local[d] = size
        offs[d] = global_shape[d] if size == 0 else offs.get(d, 0) + start
    return tuple(offs.get(d, 0) for d in range(len(global_shape))), tuple(local)


def torch_boxes(defs: list[TDef], mesh: tuple[int, int], rank: int, ep: int = 1) -> tuple[dict[str, tuple], float]:
    """Every tensor's box from torch's own function on a DeviceMesh over the ``fake`` process
    group (what a real rank runs), and the seconds that took (mesh set-up excluded).
    ``mesh``: the (dp, tp) mesh; expert tensors lie on (dp / ep, ep, tp)."""
    s = torch_session(defs, mesh, rank, ep, describe=False)
    return s.boxes, s.boxes_s


@dataclass
class Session:
    """What one simulated rank measured with torch on the ``fake`` process group."""

    boxes: dict[str, tuple]
    boxes_s: float
    #: objckpt's own description of a state of (meta) DTensors, and its seconds
    description: Any = None
    describe_s: float = 0.0


def torch_session(defs: list[TDef], mesh: tuple[int, int], rank: int, ep: int = 1, *, describe: bool = True,
                  strided: bool = False) -> Session:
    """:func:`torch_boxes`, then (``describe``) objckpt's ``describe_local`` of this rank's
    state as DTensors on the meta device (no memory), what a save describes first.
    ``strided``: the placements FSDP2 x TP gives (``_StridedShard(d, tp)`` on dp where tp
    shards the same dim), which objckpt describes on the mesh with its dims permuted."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = mesh[0] * mesh[1]
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        shapes = mesh_shapes(world, mesh[1], ep)
        dms = {i: init_device_mesh("cpu", shapes[i], mesh_dim_names=MESH_DIM_NAMES[i])
               for i in sorted({KIND_MESH[d.kind] for d in defs} - {0})}

        def torch_placements(kind: str, fsdp2: bool) -> Any:
            pl = PLACEMENTS[kind]
            if pl is None:
                return None
            out = [Shard(p[1]) if p[0] == "S" else Replicate() for p in pl]
            if fsdp2 and pl[0][0] == "S" and pl[-1] == pl[0]:  # FSDP (first dim) and TP (last) shard one dim
                out[0] = _StridedShard(pl[0][1], split_factor=shapes[KIND_MESH[kind]][-1])
            return out

        tpl = {k: torch_placements(k, False) for k in PLACEMENTS}
        out = {}
        t0 = clock()
        for d in defs:
            if tpl[d.kind] is None:
                out[d.key] = (tuple(0 for _ in d.shape), tuple(d.shape))
            else:
                shape, offs = compute_local_shape_and_global_offset(d.shape, dms[KIND_MESH[d.kind]], tpl[d.kind])
                out[d.key] = (tuple(int(o) for o in offs), tuple(int(s) for s in shape))
        session = Session(out, clock() - t0)
        if not describe:
            return session
        from objckpt.distributed.comm import TorchComm
        from objckpt.distributed.placements import local_part
        from objckpt.planning.assign import TensorMeta
        from objckpt.save.describe import LocalState, describe_symbolic

        dpl = {k: torch_placements(k, strided) for k in PLACEMENTS}
        values: dict[str, Any] = {}
        local_shapes: dict[tuple, tuple[int, ...]] = {}  # torch's strided rule is slow at 65,536 ranks: once per shape
        for d in defs:  # meta tensors: what describe_local finds, without the memory (it refuses meta tensors)
            dtype = getattr(torch, d.dtype)
            if dpl[d.kind] is None:
                values[d.key] = torch.empty(d.shape, dtype=dtype, device="meta")
                continue
            dm = dms[KIND_MESH[d.kind]]
            local = local_shapes.get((d.shape, d.kind))
            if local is None:
                local = tuple(int(n) for n in compute_local_shape_and_global_offset(d.shape, dm, dpl[d.kind])[0])
                local_shapes[(d.shape, d.kind)] = local
            stride = tuple(math.prod(d.shape[i + 1:]) for i in range(len(d.shape)))
            values[d.key] = DTensor.from_local(torch.empty(local, dtype=dtype, device="meta"), dm, dpl[d.kind],
                                               run_check=False, shape=torch.Size(d.shape), stride=stride)
        comm = TorchComm()
        t0 = clock()
        metas: dict[str, Any] = {}
        for key, v in values.items():  # describe_local's per-tensor step, then describe_symbolic
            part = local_part(key, v)
            metas[key] = TensorMeta(str(v.dtype).removeprefix("torch."), part.shape, v.element_size(),
                                    tuple(b for b, _ in part.pieces))
        local_state = LocalState(None, metas, {}, {}, {d.key: d.dtype for d in defs})
        session.description = describe_symbolic(local_state, values, comm)
        session.describe_s = clock() - t0
        return session
    finally:
        dist.destroy_process_group()


def chunk_records(items: list, plan: Any, rng: random.Random) -> list:
    """What a rank reports per chunk after writing (``ChunkRecord``s, crcs random)."""
    ock = internals()
    where = {f"{it.key}\x00{i}": (it.key, it.offsets) for i, it in enumerate(items)}
    out = []
    for c in plan.chunks:
        key, base = where[c.key]
        nb = -(-c.length // CRC_BLOCK) if c.length > CRC_BLOCK else 0
        chunk = ock.Chunk(tuple(b + o for b, o in zip(base, c.offsets)), tuple(c.shape), c.blob, c.offset, c.length,
                          rng.getrandbits(32), tuple(rng.getrandbits(32) for _ in range(nb)))
        out.append(ock.ChunkRecord(key, chunk))
    return out


#: CPU seconds of this process by default: the planning code is single-threaded Python, and
#: CPU time leaves out other processes and hypervisor steal on a shared machine.
clock = time.process_time


def set_clock(name: str) -> None:
    global clock
    clock = time.process_time if name == "cpu" else time.perf_counter


class Timer:
    """Accumulates ``clock`` seconds over every ``with`` block."""

    def __init__(self) -> None:
        self.t = 0.0

    def __enter__(self) -> "Timer":
        self._t0 = clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.t += clock() - self._t0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
