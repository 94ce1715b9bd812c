"""A Hugging Face model from an objckpt checkpoint in one call (needs the ``[hf]`` extra).

    from transformers import AutoModelForCausalLM
    from objckpt.integrations.hf_pretrained import from_pretrained, training_arguments

    model = from_pretrained(AutoModelForCausalLM, "s3://bucket/run-1/step-0000000500")
    args = training_arguments("s3://bucket/run-1/step-0000000500")   # the run's TrainingArguments

A step written by :class:`objckpt.integrations.hf_trainer.ObjckptTrainer` holds, beside
the model's tensors (``model.*``), the content of the files of a Trainer's checkpoint
folder, as JSON values in its manifest (:data:`STEP_FILES`): ``config.json``,
``generation_config.json``, ``trainer_state.json`` and the training arguments.  The
Trainer pickles those into ``training_args.bin``; here they are
``TrainingArguments.to_dict()`` (tokens masked, as the Trainer's own JSON masks them).

:func:`export_pretrained` writes a folder ``from_pretrained`` reads: the weights as
safetensors (``objckpt export``'s layout, :mod:`objckpt.integrations.hf`) and those
JSON files.  :func:`from_pretrained` writes it into a temporary directory, hands it to
the class's own ``from_pretrained`` and removes it.  Why a folder instead of building the
model here: ``from_pretrained`` is where transformers ties weights, computes the buffers
no state dict holds (rotary frequencies), picks dtypes and places weights
(``device_map``); going through it gives exactly the model a Trainer's own checkpoint
folder gives, whatever the architecture and the transformers version.  Cost: one copy of
the weights on local disk while the call runs (``workdir=`` chooses where).

This module imports ``transformers`` only inside the functions that need it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import MissingKeyError
from ..format.subtree import NOTHING, select
from ..load.session import ReadSession
from ..storage import ObjectStore
from .hf import ExportOptions, ExportResult, export_session

log = logging.getLogger(__name__)

#: the plain values of a Trainer step (:mod:`objckpt.integrations.hf_trainer`), each the
#: content of the file of that name in a Trainer's checkpoint folder (the training
#: arguments, which the Trainer pickles into ``training_args.bin``, as JSON)
STEP_FILES: dict[str, str] = {
    "model_config": "config.json",
    "generation_config": "generation_config.json",
    "trainer_state": "trainer_state.json",
    "training_args": "training_args.json",
}


@dataclass(frozen=True)
class PretrainedFolder:
    """What :func:`export_pretrained` wrote: the directory, the weights, the JSON files."""

    directory: str
    weights: ExportResult
    json_files: list[str]


# ---- what a Trainer step stores --------------------------------------------------------------

def _dtype_key() -> str:
    """The ``config.json`` key of the weights' dtype: ``dtype`` since transformers 4.56,
    ``torch_dtype`` before."""
    try:
        import transformers
    except ImportError:
        return "dtype"
    major_minor = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2])
    return "dtype" if major_minor >= (4, 56) else "torch_dtype"


def config_json(model: Any) -> Optional[dict[str, Any]]:
    """``config.json`` as ``save_pretrained`` writes it (``architectures`` naming the class,
    the weights' dtype), or None for a model without a transformers config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    out: dict[str, Any] = json.loads(config.to_json_string())
    out["architectures"] = [type(model).__name__.removeprefix("FSDP")]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        out[_dtype_key()] = str(dtype).removeprefix("torch.")
    return out


def generation_config_json(model: Any) -> Optional[dict[str, Any]]:
    """``generation_config.json`` as ``save_pretrained`` writes it (the values that differ
    from the defaults), or None for a model that does not generate."""
    gen = getattr(model, "generation_config", None)
    can = getattr(model, "can_generate", None)
    if gen is None or not hasattr(gen, "to_json_string") or not (callable(can) and can()):
        return None
    out: dict[str, Any] = json.loads(gen.to_json_string(use_diff=True))
    return out


def training_args_json(args: Any) -> dict[str, Any]:
    """``TrainingArguments.to_dict()`` as JSON values (enums as values, tokens masked).

    An argument whose value is not JSON (a subclass's own field holding an object) is
    stored as its ``repr``, with a warning naming it: the Trainer pickles the arguments,
    and a save must not fail where its own would not."""
    out: dict[str, Any] = {}
    for key, value in args.to_dict().items():
        try:
            out[key] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            log.warning("objckpt: training argument %r (%s) is not JSON: stored as its repr",
                        key, type(value).__name__)
            out[key] = repr(value)
    return out


# ---- reading it back ----------------------------------------------------------------------

def _step_values(ck: ReadSession) -> dict[str, Any]:
    """The :data:`STEP_FILES` values the checkpoint holds (those it lacks are left out)."""
    present = [k for k in STEP_FILES if select(ck.manifest.tree, k) is not NOTHING]
    if not present:
        return {}
    values: dict[str, Any] = ck.read_tree(present, allow_pickle=False)
    return values


def _write_json(directory: str, name: str, value: Any) -> None:
    tmp = os.path.join(directory, f"{name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(directory, name))


def holds_model_config(uri: str, *, storage_options: Optional[dict[str, Any]] = None,
                       store: Optional[ObjectStore] = None) -> bool:
    """Whether the checkpoint holds the model's ``config.json`` (a Trainer step does): then
    ``objckpt export`` writes the folder :func:`export_pretrained` writes, else weights only."""
    ck = ReadSession.open(uri, storage_options, store)
    return select(ck.manifest.tree, "model_config") is not NOTHING


def export_pretrained(uri: str, directory: str, *, prefix: str = "model.", dtype: Optional[torch.dtype] = None,
                      max_shard_size: "int | str" = "5GB", config: Any = None,
                      storage_options: Optional[dict[str, Any]] = None,
                      store: Optional[ObjectStore] = None) -> PretrainedFolder:
    """Write ``directory`` so that ``from_pretrained(directory)`` builds the checkpoint's model.

    The tensors under ``prefix`` (``"model."``: a Trainer step, or ``{"model": model}``;
    ``""`` for a flat state dict) become safetensors shards, cast to ``dtype`` if given;
    the step's :data:`STEP_FILES` values become ``config.json``,
    ``generation_config.json``, ``trainer_state.json`` and ``training_args.json``.
    ``config`` (a ``PretrainedConfig`` or a dict) is the ``config.json`` to write instead of
    the step's own, and needed for a checkpoint that holds none (:class:`MissingKeyError`
    otherwise, naming the checkpoint).  One of those files left in ``directory`` by an
    earlier export that this checkpoint does not hold is removed, as ``from_pretrained``
    would read it."""
    ck = ReadSession.open(uri, storage_options, store)
    values = _step_values(ck)
    if config is not None:
        values["model_config"] = json.loads(config.to_json_string()) if hasattr(config, "to_json_string") \
            else dict(config)
    if "model_config" not in values:
        raise MissingKeyError(
            f"checkpoint {uri!r} holds no 'model_config' (the model's config.json, which the steps of "
            f"objckpt.integrations.hf_trainer.ObjckptTrainer hold): pass config= (the model's PretrainedConfig, "
            f"e.g. AutoConfig.from_pretrained(...)) to build the model")
    if dtype is not None:  # the config names the weights' dtype: say the one they now have
        cfg = values["model_config"] = dict(values["model_config"])
        for key in {"dtype", "torch_dtype"} & set(cfg) | {_dtype_key()}:
            cfg[key] = str(dtype).removeprefix("torch.")
    weights = export_session(ck, directory, ExportOptions(prefix, dtype, max_shard_size))
    written = []
    for key, name in STEP_FILES.items():
        if key in values:
            _write_json(directory, name, values[key])
            written.append(name)
        elif os.path.exists(os.path.join(directory, name)):
            os.unlink(os.path.join(directory, name))
    return PretrainedFolder(directory, weights, written)


def from_pretrained(model_class: Any, uri: str, *model_args: Any, storage_options: Optional[dict[str, Any]] = None,
                    prefix: str = "model.", workdir: Optional[str] = None, **kwargs: Any) -> Any:
    """``model_class.from_pretrained`` of the checkpoint at ``uri``, in one call.

    ``model_class``: a transformers model class (``GPT2LMHeadModel``) or an Auto class
    (``AutoModelForCausalLM``, which reads ``config.json``'s ``model_type``).  The weights,
    ``config.json`` and ``generation_config.json`` come from the checkpoint
    (:func:`export_pretrained`, into a temporary directory under ``workdir``, removed before
    returning); ``model_args`` and ``kwargs`` (``dtype``, ``device_map``, ``config``...)
    go to ``from_pretrained`` as they are.  The model's ``name_or_path`` is ``uri``."""
    if not callable(getattr(model_class, "from_pretrained", None)):
        raise TypeError(f"model_class must be a transformers model class or Auto class (it has from_pretrained), "
                        f"got {model_class!r}")
    config = kwargs.get("config")
    with tempfile.TemporaryDirectory(prefix="objckpt-pretrained-", dir=workdir) as folder:
        export_pretrained(uri, folder, prefix=prefix, storage_options=storage_options,
                          config=None if config is None or isinstance(config, (str, os.PathLike)) else config)
        model = model_class.from_pretrained(folder, *model_args, **kwargs)
    for holder in (model, getattr(model, "config", None)):  # not the temporary directory, gone now
        if holder is not None and hasattr(holder, "name_or_path"):
            try:
                holder.name_or_path = uri
            except AttributeError:
                log.debug("objckpt: %s has a read-only name_or_path", type(holder).__name__)
    return model


def read_step_value(uri: str, key: str, *, storage_options: Optional[dict[str, Any]] = None,
                    store: Optional[ObjectStore] = None) -> Any:
    """One :data:`STEP_FILES` value of a Trainer step (``"training_args"``, ``"trainer_state"``...);
    a step without it is a :class:`MissingKeyError` naming the checkpoint and the key."""
    if key not in STEP_FILES:
        raise MissingKeyError(f"{key!r} is not a Trainer step value; choose one of {sorted(STEP_FILES)}")
    values = _step_values(ReadSession.open(uri, storage_options, store))
    if key not in values:
        raise MissingKeyError(f"checkpoint {uri!r} holds no {key!r} (the steps of "
                              f"objckpt.integrations.hf_trainer.ObjckptTrainer hold it)")
    return values[key]


def training_arguments(uri: str, *, storage_options: Optional[dict[str, Any]] = None,
                       store: Optional[ObjectStore] = None, cls: Any = None) -> Any:
    """The ``TrainingArguments`` (or ``cls``, a subclass) a Trainer step was saved with.

    Built from the stored ``to_dict()``: a masked token (``"<HUB_TOKEN>"``) comes back as
    None, since no token is stored; an argument this transformers version does not have is
    left out, with a warning naming it."""
    if cls is None:
        from transformers import TrainingArguments
        cls = TrainingArguments
    stored = read_step_value(uri, "training_args", storage_options=storage_options, store=store)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(stored) - fields)
    if unknown:
        log.warning("objckpt: %s: training arguments this %s does not have are left out: %s", uri,
                    cls.__name__, unknown)
    kwargs = {k: None if k.endswith("_token") and v == f"<{k.upper()}>" else v
              for k, v in stored.items() if k in fields}
    return cls(**kwargs)
