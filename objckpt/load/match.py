"""A template matched against a manifest: which template tensor each stored box fills.

Before any tensor byte is read, every template leaf is paired with the checkpoint's
(torch's wrapper prefixes reconciled, :mod:`.key_match`), or the load raises naming
every key that does not fit: a mismatch costs one GET.  The :class:`Match` is what a
prepared load (:mod:`.prepared`) holds and the fill (:mod:`.pipeline`) reads into.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from ..distributed.placements import Shard, local_part, local_view
from ..errors import StateDictMismatchError
from ..format.dtypes import NAME_TO_DTYPE, converts_between_floats, dtype_from_name, itemsize
from ..format.manifest import Manifest
from ..format.subtree import NOTHING, find
from ..runtime.memory import CAST_BATCH_BYTES
from ..state import Slot, StatefulValue, template_slots
from .fill import FillTarget
from .key_match import KeyCheck, check_key_match, reconcile, renamed_leaves
from .reshard_hint import rank_local_hint
from .session import stored_key


@dataclass
class Match:
    """A template matched against a manifest: what to fill, and from which state-dict values."""

    targets: list[FillTarget]
    sources: list[Any]  # the state-dict value of each target: its placements give the replica group
    value_slots: list[Slot]
    n_tensors: int
    missing: list[str]
    unexpected: list[str]
    #: the tensors loaded with ``cast``: read through temporaries of the stored dtype
    casts: list["CastTarget"] = field(default_factory=list)
    #: the encoded checkpoint value of each value slot, by key
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class CastTarget:
    """A template tensor loaded with ``cast=True``: its pieces are read into a temporary
    of the stored dtype, which is then copied (converting) into it.  The temporary is
    made only when its batch is read (:func:`cast_batches`), so a load converting a
    whole state (bf16 checkpoint, fp32 model) never holds it all twice."""

    key: str  # the stored key
    dest: torch.Tensor  # the template's local tensor
    stored: torch.dtype
    pieces: tuple[tuple[Any, tuple[int, ...]], ...]  # (box, local offsets) of each piece
    source: Any  # the state-dict value (its placements give the replica group)

    @property
    def nbytes(self) -> int:
        return self.dest.numel() * itemsize(self.stored)

    def targets(self) -> tuple[torch.Tensor, list[FillTarget]]:
        """A new temporary, and the fill targets that land in it."""
        temp = torch.empty(tuple(self.dest.shape), dtype=self.stored, device=self.dest.device)
        return temp, [FillTarget(self.key, box, local_view(temp, box, offs)) for box, offs in self.pieces]


def cast_batches(casts: list[CastTarget], limit: Optional[int] = None) -> list[list[CastTarget]]:
    """``casts`` in order, cut into batches of temporaries up to ``limit`` bytes
    (:data:`CAST_BATCH_BYTES` when not given; a larger tensor alone in its batch)."""
    limit = CAST_BATCH_BYTES if limit is None else limit
    out: list[list[CastTarget]] = []
    size = 0
    for c in casts:
        if not out or size + c.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(c)
        size += c.nbytes
    return out


def castable(have: torch.dtype, stored: torch.dtype) -> bool:
    """Whether ``load(..., cast=True)`` converts ``stored`` into ``have``: floating dtypes only
    (not complex, integer, bool, nor the packed fp4 pairs)."""
    return converts_between_floats(have) and converts_between_floats(stored)


def _under_value_leaves(keys: Iterable[str], leaves: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Template keys that lie inside a tensor-free checkpoint leaf (a Stateful value inside a dict
    that held no tensor: the template walks down to it, the checkpoint stopped above), with
    their encoded values; and the checkpoint leaves they lie in."""
    out: dict[str, Any] = {}
    covered: set[str] = set()
    for key in keys:
        if key in leaves:
            continue
        i = key.rfind(".")
        while i > 0:
            parent = key[:i]
            if parent in leaves:
                node = find(leaves[parent], key[i + 1:])
                if node is not NOTHING:
                    out[key] = node
                    covered.add(parent)
                break
            i = key.rfind(".", 0, i)
    return out, covered


#: template leaves whose local part is all of themselves (not DTensors, not Shards)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_target(t: torch.Tensor, ck: str, e: Any, out: Match, seen: set[tuple]) -> bool:
    """Take the plain tensor ``t`` for the stored tensor ``e`` (key ``ck``) into ``out`` when it
    has ``e``'s shape and dtype and holds memory (what :func:`match_template`'s general path
    would conclude through :func:`~objckpt.distributed.placements.local_part`, at a fraction
    of its cost); False leaves ``t`` to that path, which names what does not fit."""
    if t.shape != e.shape or t.is_meta or NAME_TO_DTYPE.get(e.dtype) is not t.dtype:
        return False
    out.n_tensors += 1
    sk = e.alias_of or ck
    box = ((0,) * t.dim(), e.shape)
    ident = (t.device, t.data_ptr(), e.shape, t.stride(), sk, box)
    if ident in seen and t.numel():
        return True  # tied destination: fill once
    seen.add(ident)
    out.targets.append(FillTarget(sk, box, t))
    out.sources.append(t)
    return True


def match_template(state_dict: Any, m: Manifest, leaves: dict[str, Any], uri: str, strict: bool,
                   cast: bool = False, stateful: Optional[dict[str, StatefulValue]] = None,
                   world_size: Optional[int] = None, slots: Optional[list[Slot]] = None) -> Match:
    """Pair every template leaf with the checkpoint, or raise naming what does not fit.
    ``world_size``: how many ranks load, when known (a plain tensor shaped like one rank's
    part of the stored one is told what reshards, :mod:`.reshard_hint`).  ``slots``: the
    template's leaves, when the caller walked them already."""
    slots = list(template_slots(state_dict, stateful)) if slots is None else slots
    tkeys = {s.key for s in slots}
    keymap = reconcile(tkeys, leaves)  # torch's wrapper prefixes (_orig_mod., module.) on one side only
    leaves = renamed_leaves(leaves, keymap)
    inside, covered = _under_value_leaves(tkeys, leaves)
    values = {**{k: leaves[k] for k in tkeys if k in leaves}, **inside}
    missing = [s.key for s in slots if s.key not in values]
    unexpected = [k for k in leaves if k not in tkeys and k not in covered]
    check_key_match(KeyCheck([s.key for s in slots if isinstance(s.value, (torch.Tensor, Shard))],
                             list(values), missing, unexpected, list(m.tensors),
                             list((stateful or {}).values()), keymap), uri, strict)
    problems: list[str] = []
    out = Match([], [], [], 0, missing, unexpected, values=values)
    seen: set[tuple] = set()
    tensors, renamed = m.tensors, keymap.to_ckpt
    for s in slots:
        if s.key not in values:
            continue
        v = s.value
        ck = renamed.get(s.key, s.key)
        entry = tensors.get(ck)
        if type(v) in _PLAIN and entry is not None and _plain_target(v, ck, entry, out, seen):
            continue  # a plain tensor of the stored dtype and shape (most leaves), taken in a few steps
        is_t = isinstance(v, (torch.Tensor, Shard))
        in_ckpt_t = entry is not None
        if is_t != in_ckpt_t:
            problems.append(f"{s.key!r}: {'tensor' if is_t else 'value'} in state dict, "
                            f"{'tensor' if in_ckpt_t else 'value'} in checkpoint")
            continue
        if not is_t:
            out.value_slots.append(s)
            continue
        e = tensors[ck]
        part = local_part(s.key, s.value)
        local = part.local
        stored = dtype_from_name(e.dtype, s.key)
        if tuple(part.shape) != e.shape or (part.dtype != stored and not (cast and castable(part.dtype, stored))):
            hint = rank_local_hint(s.key, s.value, tuple(part.shape), e, m, world_size)
            if tuple(part.shape) == e.shape and castable(part.dtype, stored):
                hint = " (pass cast=True to convert between floating dtypes)"
            elif tuple(part.shape) == e.shape and cast:
                hint = (" (cast=True converts between floating dtypes only, e.g. float32 and bfloat16; not complex, "
                        "integer, bool or packed fp4 tensors)")
            problems.append(f"{s.key!r}: state dict has {part.dtype} {list(part.shape)}, checkpoint has "
                            f"{e.dtype} {list(e.shape)}{hint}")
            continue
        if local is not None and local.is_meta:
            problems.append(f"{s.key!r}: the state dict's tensor is on the meta device (no memory to load "
                            "into); allocate it first, e.g. model.to_empty(device=...)")
            continue
        if not part.pieces or part.local is None:
            continue  # this rank holds no part of it
        out.n_tensors += 1
        sk = stored_key(m, ck)
        if part.dtype != stored:  # cast=True: read into a temporary of the stored dtype, convert after
            ident = (local.device, local.data_ptr(), tuple(local.shape), tuple(local.stride()), sk, "cast")
            if ident not in seen or not local.numel():  # tied destination: fill once
                seen.add(ident)
                out.casts.append(CastTarget(sk, local, stored, tuple(
                    (box, offs) for (box, _), offs in zip(part.pieces, part.local_offsets)), s.value))
            continue
        for box, view in part.pieces:  # several for a strided DTensor: each a view of its local tensor
            ident = (view.device, view.data_ptr(), tuple(view.shape), tuple(view.stride()), sk, box)
            if ident in seen and view.numel():
                continue  # tied destination: fill once
            seen.add(ident)
            out.targets.append(FillTarget(sk, box, view))
            out.sources.append(s.value)
    if problems:
        raise StateDictMismatchError(f"cannot load {uri!r}: " + "; ".join(problems[:20]))
    return out
