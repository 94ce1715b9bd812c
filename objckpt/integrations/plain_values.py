"""Python objects <-> plain data that objckpt stores without pickle, plus notes to undo it.

Frameworks hand objckpt dictionaries that hold more than tensors and JSON
values: ``OrderedDict`` state dicts (with their ``_metadata``), hyper-parameter
``AttributeDict``\\ s, dataclass configs, enums, named tuples, sets, paths,
numpy scalars.  objckpt's tree (:mod:`objckpt.format.tree`) stores dicts,
lists, tuples, tensors and scalars without pickle; anything else it refuses
or pickles.  This module sits in between:

* :func:`to_plain` rewrites a value into what the tree stores, and returns a
  list of :class:`TypeNote` records, one per rewritten value, saying where it
  was and what it was.  The plain tree keeps the original nesting, so tensor
  keys stay readable (``state_dict.layer.weight``) for ``objckpt.read``.
* :func:`from_plain` applies the notes to the tree read back.

Classes are named by ``module:qualname`` and looked up only among modules
the process has already imported: a checkpoint cannot make the loader import
(run) a module.  A class that is not there comes back as its plain form, with
a warning.  Values with no plain form are pickled only when the caller allows
it (``allow_pickle``); otherwise :class:`UnsupportedValueError` names the key.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import pathlib
import pickle
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, UnsupportedValueError

#: how deep values may nest (a reference cycle would otherwise recurse forever)
MAX_DEPTH = 100

Path = tuple[Any, ...]

_SCALARS = (str, int, float, bool, type(None), bytes, bytearray, torch.Size, torch.dtype, torch.device)
_KEY_TYPES = (str, int, float, bool, type(None))

PLAIN_TYPES_DOC = (
    "tensor, str, int, float, bool, None, bytes, torch.Size/dtype/device, dict (and dict subclasses such as "
    "OrderedDict, defaultdict and Lightning's AttributeDict), list, tuple, named tuple, set, frozenset, "
    "dataclass, enum, pathlib path, argparse.Namespace, numpy array/scalar"
)


class Kind(str, enum.Enum):
    """What a plain value was before :func:`to_plain` rewrote it."""

    DICT_SUBCLASS = "dict_subclass"  # name: the class; extra: [attrs (plain), notes of attrs]
    ORDERED_DICT = "ordered_dict"  # extra: as DICT_SUBCLASS (torch keeps _metadata there)
    DEFAULT_DICT = "default_dict"  # name: the default factory ("" for None)
    DATACLASS = "dataclass"  # plain: {field: value}
    ENUM = "enum"  # plain: the member's value
    NAMED_TUPLE = "named_tuple"  # plain: tuple
    SET = "set"  # plain: list
    FROZENSET = "frozenset"  # plain: list
    PATH = "path"  # plain: str
    NAMESPACE = "namespace"  # plain: {attr: value}
    NDARRAY = "ndarray"  # plain: a CPU tensor
    NP_SCALAR = "np_scalar"  # name: the numpy dtype; plain: the Python scalar
    PICKLE = "pickle"  # name: the type (for messages); plain: pickle bytes


@dataclass(frozen=True)
class TypeNote:
    """One rewritten value: ``path`` is the chain of dict keys / sequence indices from the root."""

    path: Path
    kind: Kind
    name: str = ""
    extra: Any = None

    def encode(self) -> list[Any]:
        """The note as stored (a list inside the objckpt tree, so tensors in ``extra`` work too)."""
        return [list(self.path), self.kind.value, self.name, self.extra]

    @classmethod
    def decode(cls, raw: Any, where: str) -> "TypeNote":
        try:
            path, kind, name, extra = raw
            return cls(tuple(path), Kind(kind), str(name), extra)
        except (TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed type note {str(raw)[:120]!r} ({e})") from None


@dataclass
class Plain:
    """What :func:`to_plain` returns: the plain tree and the notes that undo it."""

    value: Any
    notes: list[TypeNote] = field(default_factory=list)


def dotted(path: Path) -> str:
    """The key a path is reported by (objckpt's dotted key style)."""
    return ".".join(str(p) for p in path) or "<root>"


def class_name(obj_or_cls: Any) -> str:
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return f"{cls.__module__}:{cls.__qualname__}"


def _named(cls: Any) -> bool:
    """Whether a class (or function) can be found again by name."""
    qual = getattr(cls, "__qualname__", "")
    return bool(qual) and "<" not in qual and bool(getattr(cls, "__module__", None))


def find_class(name: str) -> Optional[Any]:
    """``module:qualname`` among already imported modules (never imports one), else None."""
    module, _, qual = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qual.split(".") if obj is not None and qual else ():
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class _Converter:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.notes: list[TypeNote] = []

    def refuse(self, x: Any, path: Path, why: str = "") -> Any:
        """A value with no plain form: pickled (when allowed) or an error naming the key."""
        tname = f"{type(x).__module__}.{type(x).__qualname__}"
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"value at key {dotted(path)!r} has type {tname}{why}, which objckpt stores without pickle only "
                f"as plain data ({PLAIN_TYPES_DOC}); make it plain data, or pass allow_pickle=True to "
                "ObjckptCheckpointIO to pickle it (and to load it back: only for checkpoints you trust)")
        try:
            raw = pickle.dumps(x)
        except Exception as e:  # pickling fails with many exception types (PicklingError, TypeError, ...)
            raise UnsupportedValueError(
                f"value at key {dotted(path)!r} of type {tname} cannot be pickled: {e}") from None
        self.notes.append(TypeNote(path, Kind.PICKLE, tname))
        return raw

    def note(self, path: Path, kind: Kind, name: str = "", extra: Any = None) -> None:
        self.notes.append(TypeNote(path, kind, name, extra))

    def attrs(self, x: Any, path: Path) -> Any:
        """Instance attributes of a dict subclass (OrderedDict._metadata), converted on their own."""
        attrs = getattr(x, "__dict__", None)
        if not attrs:
            return None
        sub = _Converter(self.allow_pickle)
        value = sub.conv(dict(attrs), path + ("<attrs>",), 0)
        return [value, [TypeNote(n.path[len(path) + 1:], n.kind, n.name, n.extra).encode() for n in sub.notes]]

    def mapping(self, x: dict[Any, Any], path: Path, depth: int, whole: Any = None) -> Any:
        """A new plain dict of ``x``'s items; ``whole`` (default ``x``) is what is refused for a bad key."""
        for k in x:
            if type(k) not in _KEY_TYPES or (isinstance(k, float) and k != k):
                why = f" (its key {k!r} of type {type(k).__qualname__} is not a str, int, float, bool or None)"
                return self.refuse(x if whole is None else whole, path, why)
        return {k: self.conv(v, path + (k,), depth + 1) for k, v in x.items()}

    def conv(self, x: Any, path: Path, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(f"value at key {dotted(path)!r} is nested more than {MAX_DEPTH} "
                                        "containers deep (a reference cycle?)")
        t = type(x)
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, enum.Enum):
            if not _named(t):
                return self.refuse(x, path, " (a class defined inside a function)")
            if type(x.value) not in _SCALARS:  # a note of its own would share the enum's path
                return self.refuse(x, path, f" (its value {x.value!r} is not a scalar)")
            self.note(path, Kind.ENUM, class_name(x))
            return x.value
        if t in _SCALARS:
            return x
        if t.__module__ == "numpy":
            return self.numpy(x, path)
        if t is dict:
            return self.mapping(x, path, depth)
        if isinstance(x, dict):
            return self.dict_subclass(x, path, depth)
        if t is list:
            return [self.conv(v, path + (i,), depth + 1) for i, v in enumerate(x)]
        if t is tuple:
            return tuple(self.conv(v, path + (i,), depth + 1) for i, v in enumerate(x))
        value: Any
        if isinstance(x, tuple) and hasattr(x, "_fields") and _named(t):
            value = tuple(self.conv(v, path + (i,), depth + 1) for i, v in enumerate(x))
            self.note(path, Kind.NAMED_TUPLE, class_name(x))
            return value
        if t in (set, frozenset):
            value = [self.conv(v, path + (i,), depth + 1) for i, v in enumerate(x)]
            self.note(path, Kind.SET if t is set else Kind.FROZENSET)
            return value
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and _named(t):
            value = {f.name: self.conv(getattr(x, f.name), path + (f.name,), depth + 1)
                     for f in dataclasses.fields(x)}
            self.note(path, Kind.DATACLASS, class_name(x))
            return value
        if isinstance(x, pathlib.PurePath):
            self.note(path, Kind.PATH, class_name(x))
            return str(x)
        if t is argparse.Namespace:
            value = self.mapping(vars(x), path, depth, whole=x)
            if type(value) is dict:
                self.note(path, Kind.NAMESPACE)
            return value
        return self.refuse(x, path)

    def dict_subclass(self, x: dict[Any, Any], path: Path, depth: int) -> Any:
        if isinstance(x, collections.defaultdict):
            factory = x.default_factory
            if factory is not None and not _named(factory):
                return self.refuse(x, path, f" (its default_factory {factory!r} cannot be named)")
            value = self.mapping(x, path, depth)
            if type(value) is dict:  # not refused (pickled) as a whole
                self.note(path, Kind.DEFAULT_DICT, class_name(factory) if isinstance(factory, type)
                          else "" if factory is None else f"{factory.__module__}:{factory.__qualname__}")
            return value
        if not _named(type(x)):
            return self.refuse(x, path, " (a class defined inside a function)")
        value = self.mapping(x, path, depth)
        if type(value) is dict:
            kind = Kind.ORDERED_DICT if type(x) is collections.OrderedDict else Kind.DICT_SUBCLASS
            self.note(path, kind, class_name(x), self.attrs(x, path))
        return value

    def numpy(self, x: Any, path: Path) -> Any:
        import numpy as np  # only reached for numpy values, so numpy is already imported

        if isinstance(x, np.ndarray) and x.dtype.kind in "biufc" and x.dtype.byteorder in "=|<":
            self.note(path, Kind.NDARRAY)
            return torch.from_numpy(np.ascontiguousarray(x).copy())
        if isinstance(x, np.generic) and x.dtype.kind in "biufc":
            self.note(path, Kind.NP_SCALAR, x.dtype.str)
            return x.item()
        return self.refuse(x, path)


def to_plain(obj: Any, *, allow_pickle: bool = False) -> Plain:
    """``obj`` rewritten into plain data (new containers throughout; tensors shared, not copied)."""
    conv = _Converter(allow_pickle)
    value = conv.conv(obj, (), 0)
    return Plain(value, conv.notes)


class _Restorer:
    def __init__(self, notes: list[TypeNote], allow_pickle: bool, where: str) -> None:
        self.by_path = {n.path: n for n in notes}
        self.inner = {n.path[:i] for n in notes for i in range(len(n.path))}
        self.allow_pickle = allow_pickle
        self.where = where

    def walk(self, x: Any, path: Path) -> Any:
        if path in self.inner:
            if isinstance(x, dict):
                x = {k: self.walk(v, path + (k,)) for k, v in x.items()}
            elif isinstance(x, list):
                x = [self.walk(v, path + (i,)) for i, v in enumerate(x)]
            elif isinstance(x, tuple):
                x = tuple(self.walk(v, path + (i,)) for i, v in enumerate(x))
        note = self.by_path.get(path)
        return x if note is None else self.apply(note, x)

    def missing(self, note: TypeNote, x: Any) -> Any:
        warnings.warn(f"{self.where}: key {dotted(note.path)!r} was saved as {note.name}, which is not imported "
                      "in this process; it is returned as plain data (import its module before loading to "
                      "get the object back)", stacklevel=4)
        return x

    def cls(self, note: TypeNote, check: Any) -> Optional[Any]:
        found = find_class(note.name)
        return found if isinstance(found, type) and check(found) else None

    def apply(self, note: TypeNote, x: Any) -> Any:
        k = note.kind
        try:
            if k is Kind.PICKLE:
                if not self.allow_pickle:
                    raise UnsupportedValueError(
                        f"{self.where}: key {dotted(note.path)!r} holds a pickled {note.name}; pass "
                        "allow_pickle=True to ObjckptCheckpointIO to load it (only for checkpoints you trust: "
                        "unpickling runs code)")
                return pickle.loads(x)
            if k in (Kind.SET, Kind.FROZENSET):
                return set(x) if k is Kind.SET else frozenset(x)
            if k is Kind.NAMESPACE:
                return argparse.Namespace(**x)
            if k is Kind.NDARRAY:
                return x.numpy()
            if k is Kind.NP_SCALAR:
                import numpy as np

                return np.dtype(note.name).type(x)
            if k is Kind.DEFAULT_DICT:
                factory = find_class(note.name) if note.name else None
                if note.name and not callable(factory):
                    return self.missing(note, x)
                return collections.defaultdict(factory, x)
            if k in (Kind.ORDERED_DICT, Kind.DICT_SUBCLASS):
                cls = self.cls(note, lambda c: issubclass(c, dict))
                if cls is None:
                    return self.missing(note, x)
                out = cls(x)
                if note.extra is not None:
                    value, notes = note.extra
                    attrs = from_plain(value, [TypeNote.decode(n, self.where) for n in notes],
                                       allow_pickle=self.allow_pickle, where=self.where)
                    out.__dict__.update(attrs)
                return out
            if k is Kind.ENUM:
                cls = self.cls(note, lambda c: issubclass(c, enum.Enum))
                return self.missing(note, x) if cls is None else cls(x)
            if k is Kind.NAMED_TUPLE:
                cls = self.cls(note, lambda c: issubclass(c, tuple) and hasattr(c, "_make"))
                return self.missing(note, x) if cls is None else cls._make(x)
            if k is Kind.PATH:
                cls = self.cls(note, lambda c: issubclass(c, pathlib.PurePath))
                return self.missing(note, x) if cls is None else cls(x)
            if k is Kind.DATACLASS:
                cls = self.cls(note, dataclasses.is_dataclass)
                if cls is None:
                    return self.missing(note, x)
                out = cls.__new__(cls)  # as pickle does: fields set, __init__/__post_init__ not run again
                for name, value in x.items():
                    object.__setattr__(out, name, value)
                return out
        except UnsupportedValueError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(f"{self.where}: key {dotted(note.path)!r} could not be restored as "
                                         f"{note.kind.value} {note.name} ({type(e).__name__}: {e})") from None
        raise CorruptCheckpointError(f"{self.where}: unknown type note {k!r}")  # pragma: no cover


def from_plain(value: Any, notes: list[TypeNote], *, allow_pickle: bool = False, where: str = "") -> Any:
    """Undo :func:`to_plain`: ``value`` with every noted path turned back into its object."""
    if not notes:
        return value
    return _Restorer(notes, allow_pickle, where).walk(value, ())
