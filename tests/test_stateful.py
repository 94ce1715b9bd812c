"""Stateful values, created optimizer state, subtree reads, cast on load, and their bad inputs."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import MissingKeyError, StateDictMismatchError, UnsupportedValueError
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore


def _net(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _trained(seed: int = 0, steps: int = 3) -> tuple[torch.nn.Sequential, torch.optim.Optimizer, Any]:
    net = _net(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        net(x).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return net, opt, sched


class Counter:
    """A user's Stateful object that holds no tensor."""

    def __init__(self) -> None:
        self.n = 0
        self.names: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "names": list(self.names)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.names = sd["n"], list(sd["names"])


def test_stateful_saves_the_same_keys_and_bytes_as_state_dicts(local_or_s3: tuple[str, dict]) -> None:
    uri, opts = local_or_s3
    net, opt, sched = _trained()
    objckpt.save({"model": net, "optim": opt, "sched": sched, "step": 3}, uri + "/objs", storage_options=opts)
    objckpt.save({"model": net.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "step": 3},
                 uri + "/dicts", storage_options=opts)
    a = objckpt.inspect(uri + "/objs", storage_options=opts)
    b = objckpt.inspect(uri + "/dicts", storage_options=opts)
    assert sorted(a.tensors) == sorted(b.tensors) and "optim.state.0.exp_avg" in a.tensors
    assert a.tree == b.tree
    ra, rb = objckpt.read(uri + "/objs", storage_options=opts), objckpt.read(uri + "/dicts", storage_options=opts)
    for k, v in ra["model"].items():
        assert torch.equal(v, rb["model"][k]) and torch.equal(v, net.state_dict()[k])
    assert ra["sched"] == sched.state_dict() and ra["optim"]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


def test_load_into_fresh_objects_restores_everything(tmp_path: Any) -> None:
    net, opt, sched = _trained()
    counter = Counter()
    counter.n, counter.names = 7, ["a", "b"]
    state = {"model": net, "optim": opt, "sched": sched, "train": {"counter": counter, "epoch": 2}, "step": 3}
    objckpt.save(state, str(tmp_path / "ck"))

    net2 = _net(seed=1)
    opt2 = torch.optim.AdamW(net2.parameters(), lr=0.5)  # other lr, empty state
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    counter2 = Counter()
    fresh: dict[str, Any] = {"model": net2, "optim": opt2, "sched": sched2, "train": {"counter": counter2, "epoch": 0}, "step": 0}
    res = objckpt.load(fresh, str(tmp_path / "ck"))

    assert res.missing_keys == [] and res.unexpected_keys == []
    assert fresh["step"] == 3 and fresh["train"]["epoch"] == 2 and fresh["train"]["counter"] is counter2
    assert fresh["model"] is net2 and fresh["optim"] is opt2  # the caller's objects stay, loaded
    assert (counter2.n, counter2.names) == (7, ["a", "b"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3
    assert sched2.state_dict() == sched.state_dict()
    for (k, p), p2 in zip(net.named_parameters(), net2.parameters()):
        assert torch.equal(p, p2), k
        for name, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p2][name]) and v.dtype == opt2.state[p2][name].dtype, (k, name)
    # both go on identically
    x = torch.randn(4, 6)
    for n, o in ((net, opt), (net2, opt2)):
        n(x).square().mean().backward()
        o.step()
    for p, p2 in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, p2)


def test_created_optimizer_state_is_only_for_the_templates_parameters(tmp_path: Any) -> None:
    net, opt, _ = _trained()
    objckpt.save({"optim": opt}, str(tmp_path / "ck"))
    net2 = _net(seed=1)
    params = list(net2.parameters())
    fewer = torch.optim.AdamW(params[:2], lr=1e-2)  # two of the four parameters
    with pytest.raises(StateDictMismatchError, match=r"optim\.state\.2\.exp_avg"):
        objckpt.load({"optim": fewer}, str(tmp_path / "ck"))
    assert fewer.state_dict()["state"] == {}  # refused before anything was created in it
    # without strict the common entries load, and the optimizer's own check refuses the groups, named
    with pytest.raises(StateDictMismatchError, match=r"AdamW.load_state_dict\(\) at key 'optim'"):
        objckpt.load({"optim": fewer}, str(tmp_path / "ck"), strict=False)


def test_partial_template_state_is_a_mismatch_not_created(tmp_path: Any) -> None:
    """Only whole per-parameter entries are created: an entry the template has (lacking
    exp_avg_sq) is compared key by key."""
    net, opt, _ = _trained()
    objckpt.save({"optim": opt.state_dict()}, str(tmp_path / "ck"))
    sd = opt.state_dict()
    del sd["state"][1]["exp_avg_sq"]
    with pytest.raises(StateDictMismatchError, match=r"optim\.state\.1\.exp_avg_sq"):
        objckpt.load({"optim": sd}, str(tmp_path / "ck"))
    plain = torch.optim.AdamW(_net(1).parameters()).state_dict()  # a plain dict: nothing is created
    with pytest.raises(StateDictMismatchError, match=r"optim\.state"):
        objckpt.load({"optim": plain}, str(tmp_path / "ck"))


class Broken:
    def state_dict(self) -> dict:
        raise RuntimeError("cannot snapshot now")

    def load_state_dict(self, sd: dict) -> None:
        raise AssertionError("never called")


class Refuses(Counter):
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError("version 2 state, I read version 1")


def test_stateful_bad_input_is_named(tmp_path: Any) -> None:
    with pytest.raises(UnsupportedValueError, match=r"'extra\.broken'.*cannot snapshot now"):
        objckpt.save({"extra": {"broken": Broken()}}, str(tmp_path / "a"))
    with pytest.raises(UnsupportedValueError, match=r"'broken'"):
        objckpt.async_save({"broken": Broken()}, str(tmp_path / "b"))
    objckpt.save({"c": Counter()}, str(tmp_path / "c"))
    with pytest.raises(StateDictMismatchError, match=r"Refuses.load_state_dict\(\) at key 'c'.*version 2"):
        objckpt.load({"c": Refuses()}, str(tmp_path / "c"))


def test_whole_object_as_the_state(tmp_path: Any) -> None:
    net, _, _ = _trained()
    objckpt.save(net, str(tmp_path / "m"))
    assert sorted(objckpt.inspect(str(tmp_path / "m")).tensors) == sorted(net.state_dict())
    net2 = _net(seed=5)
    objckpt.load(net2, str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters()))


def test_meta_template_is_refused_with_the_fix(tmp_path: Any) -> None:
    net, _, _ = _trained()
    objckpt.save({"model": net}, str(tmp_path / "m"))
    with torch.device("meta"):
        meta = _net(0)
    with pytest.raises(StateDictMismatchError, match=r"meta device.*to_empty"):
        objckpt.load({"model": meta}, str(tmp_path / "m"))
    meta.to_empty(device="cpu")
    objckpt.load({"model": meta}, str(tmp_path / "m"))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), meta.parameters()))


# --------------------------------------------------------------------------- read(keys=) subtrees


def test_read_subtree_prefixes_fetch_only_their_bytes(tmp_path: Any) -> None:
    net, opt, sched = _trained()
    objckpt.save({"model": net, "optim": opt, "sched": sched, "step": 3}, str(tmp_path / "ck"))
    uri = str(tmp_path / "ck")
    store = CountingStore(open_store(uri)[0])
    out = objckpt.read(uri, keys=["model.0", "optim.param_groups.0", "step"], store=store)
    assert set(out["model.0"]) == {"weight", "bias"}
    first, last = net.get_submodule("0"), net.get_submodule("2")
    assert isinstance(first, torch.nn.Linear) and isinstance(last, torch.nn.Linear)
    assert torch.equal(out["model.0"]["weight"], first.weight)
    assert out["optim.param_groups.0"]["lr"] == opt.param_groups[0]["lr"] and out["step"] == 3
    tensors = sum(v.numel() * v.element_size() for v in first.state_dict().values())
    total = sum(b.size for b in objckpt.inspect(str(tmp_path / "ck")).blobs)
    ranged = sum(n for _, _, n in store.ranges)
    assert tensors <= ranged < total / 4, (ranged, tensors, total)  # small gaps between chunks may be merged

    optim = objckpt.read(uri, keys=["optim"], store=store)["optim"]
    assert set(optim) == {"state", "param_groups"} and set(optim["state"]) == {0, 1, 2, 3}
    assert torch.equal(optim["state"][2]["exp_avg"], opt.state[last.weight]["exp_avg"])
    one = objckpt.read(uri, keys=["optim.state.1"], store=store)["optim.state.1"]
    assert set(one) == {"step", "exp_avg", "exp_avg_sq"}


def test_read_prefix_inside_flat_state_dict_keys(tmp_path: Any) -> None:
    """``model.layers.0`` is no node of the tree ({"model": {"layers.0.w": ...}}): a key prefix."""
    sd = {"layers.0.attn.w": torch.ones(2), "layers.0.mlp.w": torch.zeros(3), "layers.1.attn.w": torch.ones(1),
          "layers.10.w": torch.ones(4)}
    objckpt.save({"model": sd}, str(tmp_path / "ck"))
    got = objckpt.read(str(tmp_path / "ck"), keys=["model.layers.0", "model.layers.1.attn"])
    assert set(got["model.layers.0"]) == {"attn.w", "mlp.w"}  # not layers.10
    assert torch.equal(got["model.layers.0"]["mlp.w"], torch.zeros(3))
    assert set(got["model.layers.1.attn"]) == {"w"}


@pytest.mark.parametrize("key", ["model.9", "mod", "model.layers.0.attn.w.x", "optim"])
def test_read_unknown_key_or_prefix_is_named(tmp_path: Any, key: str) -> None:
    objckpt.save({"model": {"layers.0.attn.w": torch.ones(2)}}, str(tmp_path / "ck"))
    with pytest.raises(MissingKeyError, match=f"{key!r}.*neither as a key nor as a key prefix"):
        objckpt.read(str(tmp_path / "ck"), keys=[key])
    with pytest.raises(TypeError, match="str keys"):
        objckpt.read(str(tmp_path / "ck"), keys=[3])  # type: ignore[list-item]


# --------------------------------------------------------------------------- cast on load


def test_cast_loads_other_float_dtypes_only_when_asked(local_or_s3: tuple[str, dict]) -> None:
    uri, opts = local_or_s3
    w = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    objckpt.save({"w": w, "h": w.half(), "i": torch.arange(4), "s": torch.tensor(2.5)}, uri, storage_options=opts)
    bf = {"w": torch.zeros(5, 7, dtype=torch.bfloat16), "h": torch.zeros(5, 7, dtype=torch.float64),
          "i": torch.zeros(4, dtype=torch.int64), "s": torch.zeros((), dtype=torch.float16)}
    with pytest.raises(StateDictMismatchError, match=r"'w'.*bfloat16.*float32.*cast=True"):
        objckpt.load(bf, uri, storage_options=opts)
    assert not bf["w"].any()
    objckpt.load(bf, uri, storage_options=opts, cast=True)
    assert bf["w"].dtype == torch.bfloat16 and torch.equal(bf["w"], w.to(torch.bfloat16))
    assert torch.equal(bf["h"], w.half().double()) and bf["s"].item() == 2.5
    with pytest.raises(StateDictMismatchError, match=r"'i'.*float32.*int64"):
        objckpt.load({"i": torch.zeros(4)}, uri, storage_options=opts, cast=True, strict=False)
    with pytest.raises(StateDictMismatchError, match=r"'w'.*\[5, 8\]"):
        objckpt.load({"w": torch.zeros(5, 8, dtype=torch.bfloat16)}, uri, storage_options=opts, cast=True,
                     strict=False)


def test_cast_holds_one_batch_of_temporaries(local_or_s3: tuple[str, dict], monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole fp32 state loaded into a bf16 template reads through temporaries of the
    stored dtype one batch at a time: at no point are more than a batch (or one larger
    tensor) of them alive, and every value, tied ones included, is converted exactly."""
    import weakref

    from objckpt.load import pipeline

    uri, opts = local_or_s3
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(6)}  # 1 MiB each
    state["big"] = torch.randn(768, 1024, generator=g)  # 3 MiB: alone in its batch
    state["tied"] = state["w0"]
    objckpt.save(state, uri, storage_options=opts)
    limit = 2 << 20
    monkeypatch.setattr(pipeline, "CAST_BATCH_BYTES", limit)
    alive: list[weakref.ref] = []
    most = [0]
    made = pipeline.CastTarget.targets

    def tracked(self: Any) -> Any:
        temp, pieces = made(self)  # (tensors are freed by reference counting: no collection needed)
        alive.append(weakref.ref(temp))
        most[0] = max(most[0], sum(r().nbytes for r in alive if r() is not None))
        return temp, pieces

    monkeypatch.setattr(pipeline.CastTarget, "targets", tracked)
    template = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in state.items() if k != "tied"}
    template["tied"] = template["w0"]
    objckpt.load(template, uri, storage_options=opts, cast=True)
    for k, v in state.items():
        assert torch.equal(template[k], v.to(torch.bfloat16)), k
    assert len(alive) == 7  # the tied tensor is read once
    assert most[0] <= 3 << 20  # one batch of 2 MiB, or the 3 MiB tensor alone; the state is 9 MiB


def test_cast_through_a_stateful_bf16_model(tmp_path: Any) -> None:
    net, _, _ = _trained()
    objckpt.save({"model": net}, str(tmp_path / "ck"))
    half = _net(3).to(torch.bfloat16)
    objckpt.load({"model": half}, str(tmp_path / "ck"), cast=True)
    for p, q in zip(net.parameters(), half.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(q, p.to(torch.bfloat16))
