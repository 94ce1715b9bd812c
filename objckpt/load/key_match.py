"""Pairing a template's keys with a checkpoint's: torch's wrapper prefixes, and what to say when they differ.

A model saved as ``torch.compile(model).state_dict()`` has keys ``_orig_mod.…``, one
saved through ``DistributedDataParallel`` ``module.…``, layers under activation
checkpointing (keys taken without its hooks, e.g. from ``named_parameters()``)
``layers.0._checkpoint_wrapped_module.…``.  Loaded into the plain model (or the other
way round) every key differs, and nothing would load.

:func:`reconcile` pairs such keys.  It drops a wrapper component (the names in
:data:`objckpt.state.WRAPPER_COMPONENTS`) under a key prefix (a *scope*: ``""``,
``model``, ``layers.0``) of one side only when **every** key of that side under the
scope carries the component right after the scope, **no** key of the other side does,
and the keys then have names in common; it repeats for nested wrappers
(``_orig_mod.module.…``).  Anything else stays a mismatch, and :func:`prefix_hint`
names the prefix that differs and the one-line fix.

:func:`check_key_match` then refuses what would load too little: with ``strict`` any
difference; without it a load that matches no tensor of the checkpoint, or none of a
Stateful value's tensors (resuming from random weights beside trained optimizer
moments is worse than an error).  It suggests ``strict=False`` only when tensors
match.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..errors import StateDictMismatchError
from ..logs import get_logger
from ..state import WRAPPER_COMPONENTS, StatefulValue

log = get_logger("objckpt.load")

#: nested wrappers unwrapped at most (compiled DDP around a checkpoint wrapper is 3)
_MAX_ROUNDS = 8
#: the side whose keys carry the wrapper component
CHECKPOINT, TEMPLATE = "checkpoint", "state dict"


@dataclass(frozen=True)
class Rename:
    """Under ``scope``, ``side``'s keys carry ``component`` the other side's lack (``count`` keys)."""

    scope: str
    component: str
    side: str
    count: int


@dataclass
class KeyMap:
    """Template keys paired with checkpoint keys of another name (the rest pair by equal names)."""

    to_ckpt: dict[str, str] = field(default_factory=dict)
    renames: list[Rename] = field(default_factory=list)

    def ckpt_key(self, template_key: str) -> str:
        return self.to_ckpt.get(template_key, template_key)

    def describe(self) -> str:
        """One phrase per wrapper and side: what was matched without which prefix."""
        out = []
        for (component, side), group in _grouped(self.renames).items():
            scopes = [r.scope for r in group]
            where = ("all keys" if scopes == [""] else
                     f"keys under {', '.join(repr(s) for s in scopes[:3])}"
                     f"{f' and {len(scopes) - 3} more' if len(scopes) > 3 else ''}")
            out.append(f"{side} {where} carry {WRAPPER_COMPONENTS[component]}'s prefix {component + '.'!r} "
                       f"({sum(r.count for r in group)} keys)")
        return "; ".join(out)


def _grouped(renames: Sequence[Rename]) -> dict[tuple[str, str], list[Rename]]:
    out: dict[tuple[str, str], list[Rename]] = {}
    for r in renames:
        out.setdefault((r.component, r.side), []).append(r)
    return out


def _under(names: list[str], scope: str) -> list[str]:
    """The keys of sorted ``names`` strictly under ``scope`` (all of them for ``""``), plus ``scope`` itself."""
    if not scope:
        return names
    lo = bisect.bisect_left(names, scope + ".")
    hi = bisect.bisect_left(names, scope + "/")  # "/" follows "." in every ordering of str
    out = names[lo:hi]
    i = bisect.bisect_left(names, scope)
    if i < len(names) and names[i] == scope:
        out = out + [scope]
    return out


def _candidates(keys: Iterable[str], side: str) -> set[tuple[str, str, str]]:
    """(scope, component, side) for every wrapper component inside a key of ``keys``."""
    out = set()
    for k in keys:
        parts = k.split(".")
        for i, part in enumerate(parts[:-1]):
            if part in WRAPPER_COMPONENTS:
                out.add((".".join(parts[:i]), part, side))
    return out


def _bare(rest: str) -> str:
    """``rest`` without the wrapper components it starts with."""
    parts = rest.split(".")
    i = 0
    while i < len(parts) - 1 and parts[i] in WRAPPER_COMPONENTS:
        i += 1
    return ".".join(parts[i:])


def _nested(a: str, b: str) -> bool:
    """Whether scope ``a`` lies within scope ``b`` or ``b`` within ``a`` (component-wise)."""
    return not a or not b or a == b or a.startswith(b + ".") or b.startswith(a + ".")


def reconcile(template_keys: Iterable[str], ckpt_keys: Iterable[str]) -> KeyMap:
    """Pair template keys with checkpoint keys that differ only by torch's wrapper prefixes
    (the rule in this module's docstring); logs each pairing at INFO."""
    t_view = {k: k for k in template_keys}  # current name -> original key
    c_view = {k: k for k in ckpt_keys}
    renames: list[Rename] = []
    for _ in range(_MAX_ROUNDS):
        missing = t_view.keys() - c_view.keys()
        unexpected = c_view.keys() - t_view.keys()
        if not missing or not unexpected:
            break
        cands = _candidates(unexpected, CHECKPOINT) | _candidates(missing, TEMPLATE)
        if not cands:
            break
        t_sorted, c_sorted = sorted(t_view), sorted(c_view)
        taken: list[tuple[str, str, str, list[str]]] = []
        for scope, component, side in sorted(cands, key=lambda c: (c[0].count(".") if c[0] else -1, c)):
            if any(_nested(scope, s) for s, _, _, _ in taken):
                continue  # next round, on the names this one leaves
            mine, other = (c_sorted, t_sorted) if side == CHECKPOINT else (t_sorted, c_sorted)
            a, b = _under(mine, scope), _under(other, scope)
            head = f"{scope}.{component}." if scope else f"{component}."
            if not a or not b or not all(k.startswith(head) for k in a) or any(k.startswith(head) for k in b):
                continue
            base = f"{scope}." if scope else ""
            # names in common once this and any wrapper right inside it are gone (compiled DDP: _orig_mod.module.)
            if {_bare(k[len(head):]) for k in a}.isdisjoint(_bare(k[len(base):]) for k in b if k != scope):
                continue
            taken.append((scope, component, side, a))
        if not taken:
            break
        for scope, component, side, a in taken:
            view = c_view if side == CHECKPOINT else t_view
            head = f"{scope}.{component}." if scope else f"{component}."
            base = f"{scope}." if scope else ""
            for k in a:
                view[base + k[len(head):]] = view.pop(k)
            renames.append(Rename(scope, component, side, len(a)))
    km = KeyMap(renames=renames)
    if renames:
        km.to_ckpt = {orig: c_view[name] for name, orig in t_view.items() if name in c_view and c_view[name] != orig}
        log.info("matching keys without torch's wrapper prefixes: %s", km.describe())
    return km


def _insertion(longer: str, shorter: str) -> Optional[tuple[str, str]]:
    """(scope, inserted) when ``longer`` is ``shorter`` with ``inserted`` (whole dotted
    components, ending with a dot) put right after ``scope``; else None."""
    lp, sp = longer.split("."), shorter.split(".")
    n = len(lp) - len(sp)
    if n <= 0:
        return None
    i = 0
    while i < len(sp) and lp[i] == sp[i]:
        i += 1
    if lp[i + n:] != sp[i:]:
        return None
    return ".".join(sp[:i]), ".".join(lp[i:i + n]) + "."


def _best_insertion(longer: Sequence[str], shorter: Sequence[str]) -> Optional[tuple[str, str, int]]:
    """The (scope, inserted, count) that turns the most of ``shorter`` into ``longer``."""
    longer_set = set(longer)
    probe = list(shorter)[:20]
    found: dict[tuple[str, str], int] = {}
    for k in probe[:3]:
        for u in longer:
            ins = _insertion(u, k)
            if ins is not None and ins not in found:
                scope, inserted = ins
                pre = f"{scope}." if scope else ""
                found[ins] = sum(1 for s in probe if s.startswith(pre) and
                                 pre + inserted + s[len(pre):] in longer_set)
    if not found:
        return None
    (scope, inserted), count = max(found.items(), key=lambda kv: kv[1])
    return (scope, inserted, count) if count * 2 >= len(probe) else None


def _indexing(scope: str, parts: str) -> str:
    return "".join(f"[{p!r}]" for p in (scope.split(".") if scope else []) + parts.rstrip(".").split("."))


def prefix_hint(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """A sentence naming the key prefix one side has and the other lacks, with the fix;
    "" when the keys do not differ that way."""
    if not missing or not unexpected:
        return ""
    longer_ckpt = _best_insertion(unexpected, missing)
    if longer_ckpt is not None:
        scope, inserted, _ = longer_ckpt
        who = _who(inserted)
        where = f"under {scope!r} " if scope else ""
        fix = (f"objckpt.load({{{inserted.rstrip('.')!r}: state_dict}}, uri)" if not scope else
               f"put the value at {scope!r} one level down, as {{{inserted.rstrip('.')!r}: <that value>}}")
        return (f"the checkpoint's keys {where}have the prefix {inserted!r}{who} that the state dict's keys "
                f"lack: {fix}")
    longer_tmpl = _best_insertion(missing, unexpected)
    if longer_tmpl is not None:
        scope, inserted, _ = longer_tmpl
        who = _who(inserted)
        where = f"under {scope!r} " if scope else ""
        return (f"the state dict's keys {where}have the prefix {inserted!r}{who} that the checkpoint's keys "
                f"lack: load the value under it, objckpt.load(state_dict{_indexing(scope, inserted)}, uri)")
    return ""


def _who(inserted: str) -> str:
    first = inserted.split(".")[0]
    return f" (added by {WRAPPER_COMPONENTS[first]})" if first in WRAPPER_COMPONENTS else ""


def renamed_leaves(leaves: dict[str, object], keymap: KeyMap) -> dict[str, object]:
    """``leaves`` (checkpoint key -> node) with the keys ``keymap`` paired under their template names."""
    if not keymap.to_ckpt:
        return leaves
    out = dict(leaves)
    for t, c in keymap.to_ckpt.items():
        out[t] = leaves[c]
    for c in set(keymap.to_ckpt.values()) - set(keymap.to_ckpt):
        out.pop(c, None)
    return out


@dataclass(frozen=True)
class KeyCheck:
    """What :func:`check_key_match` judges: a template matched against a checkpoint, by key."""

    tensor_keys: list[str]  # the template's tensor leaves
    matched: list[str]  # template keys the checkpoint has (any kind)
    missing: list[str]
    unexpected: list[str]
    ckpt_tensors: list[str]
    stateful: list[StatefulValue]
    keymap: KeyMap


def _listed(keys: Sequence[str], n: int = 10) -> str:
    return f"{list(keys[:n])}{f' and {len(keys) - n} more' if len(keys) > n else ''}"


def _under_key(k: str, scope: str) -> bool:
    return not scope or k == scope or k.startswith(scope + ".")


def _stateful_unmatched(c: KeyCheck, matched_t: list[str]) -> Optional[tuple[StatefulValue, list[str]]]:
    """The first Stateful value whose template holds tensors none of which matched, with those keys."""
    for sv in c.stateful:
        mine = [k for k in c.tensor_keys if _under_key(k, sv.key)]
        if mine and not any(_under_key(k, sv.key) for k in matched_t):
            return sv, mine
    return None


def check_key_match(c: KeyCheck, uri: str, strict: bool) -> None:
    """Raise a :class:`StateDictMismatchError` for a load that would load too little
    (this module's docstring); before any byte is read, so the template is untouched."""
    matched = set(c.matched)
    ckpt_t = set(c.ckpt_tensors)
    matched_t = [k for k in c.tensor_keys if k in matched and c.keymap.ckpt_key(k) in ckpt_t]
    if strict and not (c.missing or c.unexpected):
        return
    unmatched_sv = None
    if not strict:
        if not ckpt_t or not c.tensor_keys:
            return  # an empty checkpoint, or a template asking for values only
        unmatched_sv = _stateful_unmatched(c, matched_t) if matched_t else None
        if matched_t and unmatched_sv is None:
            return
    hint = prefix_hint(c.missing, c.unexpected)  # only on the way to an error: it scans the keys
    lead = f"{hint[0].upper()}{hint[1:]}. " if hint else ""
    renamed = (f" (after matching keys without torch's wrapper prefixes: {c.keymap.describe()})"
               if c.keymap.renames else "")
    if strict:
        retry = (f" Pass strict=False to load the {len(matched_t)} tensor(s) in common." if matched_t and not hint
                 else "")
        raise StateDictMismatchError(
            f"state dict does not match checkpoint {uri!r}{renamed}: {lead}Missing from checkpoint "
            f"{_listed(c.missing)}; in checkpoint but not in state dict {_listed(c.unexpected)}.{retry}")
    if unmatched_sv is None:
        raise StateDictMismatchError(
            f"cannot load {uri!r}: none of the state dict's {len(c.tensor_keys)} tensor(s) is in the checkpoint, "
            f"whose {len(ckpt_t)} tensor(s) have other keys{renamed}. {lead}State dict: {_listed(c.tensor_keys, 5)}; "
            f"checkpoint: {_listed(c.ckpt_tensors, 5)}. Nothing was loaded (strict=False skips some keys; it does "
            "not turn a load of nothing into a success)")
    sv, mine = unmatched_sv
    there = [k for k in c.ckpt_tensors if _under_key(k, sv.key)]
    has = (f"the checkpoint's tensors under it are {_listed(there, 5)}" if there else
           "the checkpoint has no tensor under that key")
    raise StateDictMismatchError(
        f"cannot load {uri!r}: none of the {len(mine)} tensor(s) of the {type(sv.obj).__qualname__} at key "
        f"{sv.key or '<root>'!r} is in the checkpoint ({has}){renamed}. {lead}It would keep the values it "
        "was built with beside loaded state; nothing was loaded. Leave it out of the state to load the "
        "rest without it")
