"""Every ObjckptError subclass crosses ranks as itself (issue 34): one registry
(objckpt.errors), filled as each class is defined, wherever it is defined; the ranks
send (class name, text), never a pickled exception, and the receiving rank raises
that very class.  Unit checks over every class of the package, then real 2-process
gloo runs where a tier-, manager- or S3-defined error raised on one rank is caught
as that exact class on the other."""
from __future__ import annotations

import gc
import importlib
import inspect
import os
import pickle
import pkgutil
from typing import Any, Iterator

import pytest
import torch

import objckpt
from objckpt.distributed.comm import RankError, RemoteError, refusal, refusal_class
from objckpt.errors import CollectiveLoadError, ObjckptError, error_class, error_classes, error_name

from mp import run_multiprocess


def _import_everything() -> None:
    for mod in pkgutil.walk_packages(objckpt.__path__, "objckpt."):
        if not mod.name.endswith("__main__"):  # `python -m objckpt` runs the command line
            importlib.import_module(mod.name)


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _package_classes() -> list[type[ObjckptError]]:
    """Every ObjckptError subclass objckpt defines (not the ones refusal_class makes)."""
    _import_everything()
    seen: dict[type, None] = {}
    for c in _subclasses(ObjckptError):
        if c.__module__.startswith("objckpt.") and "_objckpt_stands_for" not in c.__dict__:
            seen[c] = None
    return list(seen)


#: classes defined outside objckpt/errors.py that once reached other ranks as their base class
OUTSIDE_ERRORS_PY = {
    "objckpt.tier.errors": {"TierSettingsError", "LocalTierError", "TierRestoreError", "DrainError", "DrainCutError"},
    "objckpt.tier.transfer": {"PeerCopyError"},
    "objckpt.tier.overlay": {"ReadOnlyStoreError"},
    "objckpt.tier.topology": {"TopologyError"},
    "objckpt.manager.naming": {"InvalidStepError", "SwappedArgumentsError", "StepFormatError"},
    "objckpt.manager.index": {"IndexContentionError"},
    "objckpt.manager.retention": {"RetentionPolicyError", "StepOrderError"},
    "objckpt.manager.preemption": {"PreemptionSettingsError"},
    "objckpt.storage.s3.config": {"NoCredentialsError", "CertificateError"},
    "objckpt.storage.s3.setting": {"S3ConfigError"},
    "objckpt.storage.s3.request": {"MalformedAnswer"},
    "objckpt.integrations.hf_trainer": {"UnsupportedTrainerError"},
    "objckpt.integrations.lightning_marker": {"NotATorchCheckpointError"},
    "objckpt.distributed.comm": {"RemoteError"},
}


def test_every_class_of_the_package_is_registered_under_its_name() -> None:
    classes = _package_classes()
    by_module: dict[str, set[str]] = {}
    for c in classes:
        by_module.setdefault(c.__module__, set()).add(c.__name__)
        assert error_name(c) == c.__name__, c  # objckpt's own: the bare class name, unique
        assert error_class(c.__name__) is c, c
    for module, names in OUTSIDE_ERRORS_PY.items():
        assert names <= by_module.get(module, set()), (module, names - by_module.get(module, set()))
    ours = {name for name in error_classes() if "." not in name}  # others' classes have qualified names
    assert ours == {c.__name__ for c in classes} | {"ObjckptError"}
    assert len(classes) >= 40


@pytest.mark.parametrize("cls", _package_classes(), ids=lambda c: c.__name__)
def test_each_class_round_trips_through_the_registry_as_itself(cls: type[ObjckptError]) -> None:
    text = f"rank 1: {cls.__name__} at key 'opt.state.0' (s3://b/run/step-7)"
    sent = RankError.of(cls.from_message(text))
    assert sent.kind == cls.__name__

    # rebuilt from the text alone: exactly the class, exactly the text
    got = refusal(sent.kind, text)
    assert type(got) is cls and str(got) == text
    for builtin in cls.__mro__:
        if builtin.__module__ == "builtins" and builtin is not object:
            assert isinstance(got, builtin), (cls, builtin)

    # raised as a message-only error (a save's refusal), every rank's `except cls` catches it
    with pytest.raises(cls) as caught:
        raise refusal_class(sent.kind, ObjckptError)(text)
    assert str(caught.value) == text and error_name(caught.value) == cls.__name__

    # mixed with a base built from more than a message: both classes, both sets of attributes
    plain = cls.from_message(text)
    remote = refusal_class(sent.kind, RemoteError)(sent.kind, text)
    assert isinstance(remote, cls) and isinstance(remote, RemoteError) and remote.kind == cls.__name__
    load = refusal_class(sent.kind, CollectiveLoadError)(text, {1: text})
    assert isinstance(load, cls) and isinstance(load, CollectiveLoadError)
    for made in (remote, load):
        assert set(vars(plain)) <= set(vars(made)), (cls, vars(plain), vars(made))
        assert type(made).__name__ == cls.__name__ and error_name(made) == cls.__name__
        if "_objckpt_stands_for" in type(made).__dict__:  # a class made here: pickled as what it stands for
            back = pickle.loads(pickle.dumps(made))  # e.g. out of a process pool: same class, text, values
            assert type(back) is type(made) and str(back) == str(made) and vars(back) == vars(made)
    assert load.failures == {1: text}


@pytest.mark.parametrize("cls", _package_classes(), ids=lambda c: c.__name__)
def test_a_class_with_its_own_constructor_says_how_to_rebuild_it(cls: type[ObjckptError]) -> None:
    """A class whose ``__init__`` cannot take a message alone overrides from_message
    (at or below the class that defines that ``__init__``)."""
    owner = next(c for c in cls.__mro__ if "__init__" in vars(c))
    if not issubclass(owner, ObjckptError):
        return
    try:
        inspect.signature(owner.__init__).bind(None, "a message")
        return
    except TypeError:
        pass
    rebuilt_by = next(c for c in cls.__mro__ if "from_message" in vars(c))
    assert issubclass(rebuilt_by, owner), (cls, owner, rebuilt_by)


def test_names_are_unique_and_other_packages_classes_are_qualified() -> None:
    with pytest.raises(TypeError, match="'StorageError'.*unique"):
        type("StorageError", (ObjckptError,), {"__module__": "objckpt.somewhere_else"})
    gc.collect()  # the refused class object, out of ObjckptError.__subclasses__()

    class StorageError(ObjckptError):  # a user's class of the same name: its own, qualified name
        pass

    name = error_name(StorageError)
    assert name == f"{__name__}.test_names_are_unique_and_other_packages_classes_are_qualified.<locals>.StorageError"
    assert error_class(name) is StorageError and error_class("StorageError") is objckpt.StorageError
    assert type(refusal(name, "x")) is StorageError
    assert refusal_class("KeyError", RemoteError) is RemoteError  # builtins are not objckpt's classes
    assert error_name(KeyError("k")) == "KeyError"


def test_a_class_with_custom_init_and_no_override_is_still_rebuilt() -> None:
    class Needs(ObjckptError):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"{a}{b}")

    got = refusal(error_name(Needs), "from another rank")
    assert type(got) is Needs and str(got) == "from another rank"


# --------------------------------------------------------------------------- real ranks


def _cross_ranks(rank: int, world: int, root: str, bucket: str, options: dict[str, Any]) -> dict[str, str]:
    from objckpt.manager.naming import StepFormatError
    from objckpt.storage.local import LocalStore
    from objckpt.storage.s3.config import S3ConfigError
    from objckpt.testing.stores import FaultyStore
    from objckpt.tier.errors import LocalTierError
    from objckpt.tier.overlay import OverlayStore, ReadOnlyStoreError

    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = "600"  # a rank left waiting fails the test by hanging
    out: dict[str, str] = {}
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}

    # a save: rank 1 writes its shard through a tier's read-only overlay (ReadOnlyStoreError, tier/overlay.py)
    shard = {"s": objckpt.Shard(torch.full((2, 4), float(rank)), (4, 4), (2 * rank, 0))}
    store = LocalStore("/") if rank == 0 else OverlayStore(LocalStore("/"), {})
    try:
        objckpt.save(shard, f"{root}/sharded", store=store)
        out["save"] = "no error"
    except ReadOnlyStoreError as e:
        out["save"] = f"{type(e).__name__}: {e}"

    # a load, while reading: rank 1's read of the local tier fails (LocalTierError, tier/errors.py)
    objckpt.save(state, f"{root}/plain")
    store = (FaultyStore(LocalStore("/"), "get_range", 1, lambda: LocalTierError("the local disk went away"))
             if rank == 1 else LocalStore("/"))
    try:
        objckpt.load({"w": torch.zeros(3, 4), "b": torch.zeros(5)}, f"{root}/plain", store=store,
                     read_strategy="allgather")
        out["read"] = "no error"
    except LocalTierError as e:
        out["read"] = f"{type(e).__name__}: {e}"

    # a load: rank 1's storage options are wrong (S3ConfigError, storage/s3/config.py)
    uri = f"s3://{bucket}/ck"
    if rank == 0:
        objckpt.save(state, uri, storage_options=options, no_dist=True)
    torch.distributed.barrier()
    mine = dict(options) if rank == 0 else {**options, "no_such_option": 1}
    try:
        objckpt.load({"w": torch.zeros(3, 4), "b": torch.zeros(5)}, uri, storage_options=mine)
        out["load"] = "no error"
    except S3ConfigError as e:
        out["load"] = f"{type(e).__name__}: {e}"

    # a manager: rank 0 reads an index written with another step format (StepFormatError,
    # manager/naming.py) and rank 1, which read nothing, raises that class too
    if rank == 0:
        with objckpt.CheckpointManager(f"{root}/run", no_dist=True) as m:
            m.save(3, state)
    torch.distributed.barrier()
    try:
        with objckpt.CheckpointManager(f"{root}/run", step_format="ckpt_{step}") as m:
            m.latest_step()
        out["manager"] = "no error"
    except StepFormatError as e:
        out["manager"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(240)
def test_errors_of_tier_manager_and_s3_classes_reach_every_rank_as_themselves(
        tmp_path: Any, moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, options = moto_s3
    r0, r1 = run_multiprocess(2, _cross_ranks, str(tmp_path), bucket, options, timeout=200)
    for rank, out in enumerate((r0, r1)):
        assert out["save"].startswith("ReadOnlyStoreError: ") and "rank 1" in out["save"], (rank, out["save"])
        assert "read-only overlay" in out["save"], out["save"]
        assert out["read"].startswith("LocalTierError: ") and "rank(s) [1]" in out["read"], (rank, out["read"])
        assert "reading tensor(s)" in out["read"] and "the local disk went away" in out["read"], out["read"]
        assert out["load"].startswith("S3ConfigError: ") and "rank(s) [1]" in out["load"], (rank, out["load"])
        assert "no_such_option" in out["load"], out["load"]
        assert out["manager"].startswith("StepFormatError: ") and "step_format" in out["manager"], (rank, out)
