"""Hugging Face ``Trainer`` checkpoints in object storage (needs the ``[hf]`` extra).

    from objckpt.integrations.hf_trainer import ObjckptTrainer

    trainer = ObjckptTrainer(model=model, args=args, train_dataset=ds,
                             checkpoint_root="s3://bucket/run-1")
    trainer.train(resume_from_checkpoint="latest")   # or an objckpt URI, or True

Every checkpoint the Trainer decides to write (``save_strategy``, ``save_steps``,
``save_strategy="best"``) becomes one step of an :class:`objckpt.CheckpointManager`
under ``checkpoint_root``: ``<root>/step-0000000100`` holds the model, optimizer,
LR scheduler, gradient scaler, every random generator (per rank), the
``TrainerState`` (``trainer_state.json``'s content, callbacks' state included) and
what a Trainer's checkpoint folder holds beside them: the training arguments (the
Trainer pickles them; here ``TrainingArguments.to_dict()``), ``config.json`` and
``generation_config.json``, all as JSON values.
:func:`objckpt.integrations.hf_pretrained.from_pretrained` builds the model from a
step in one call.
``save_total_limit`` becomes the manager's ``keep_last`` and, with
``metric_for_best_model``, ``keep_best=1`` ranked by that metric, so rotation
never deletes the best step; ``load_best_model_at_end`` loads it back from the
store.

Why a mixin over private methods: the Trainer reads and writes checkpoints
through local paths only (``os.path`` checks, ``torch.load`` of named files,
``trainer_state.json`` opened from disk).  The overrides below are the six
places where it does: ``_save_checkpoint``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state`` and
``_load_best_model``.  The Trainer still opens ``trainer_state.json`` from the
path it resumes from, so :meth:`train` writes that one file into a private
temporary directory and hands the Trainer that directory; everything else comes
from the store.  Written against transformers 4.40-5.x (tested with 5.24).

Multi-process (DDP through ``torchrun`` / ``accelerate launch``): every rank
takes part in each save and load (they are objckpt collectives over the
Trainer's process group); the model and optimizer are stored once, each rank's
generator state per rank.  DeepSpeed and FSDP trainers keep their own sharded
checkpointing and are refused with a clear error.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Optional, Union

from transformers import Trainer

from ..api import inspect as _inspect
from ..api import load as _load
from ..api import read as _read
from ..errors import NotFoundError, ObjckptError, StateDictMismatchError
from ..manager import CheckpointManager
from ..manager.preemption import (DEFAULT_CHECK_EVERY, DEFAULT_DEADLINE_S, DEFAULT_SIGNALS, PreemptionSettings,
                                  PreemptionSettingsError)
from .hf_preemption import ObjckptPreemptionCallback
from .hf_pretrained import config_json, generation_config_json, training_args_json
from .rng_state import capture_rng, restore_rng

log = logging.getLogger(__name__)

#: the name the Trainer opens in the directory it resumes from
TRAINER_STATE_NAME = "trainer_state.json"


class UnsupportedTrainerError(ObjckptError, NotImplementedError):
    """The Trainer is set up in a way this integration does not checkpoint (DeepSpeed, FSDP)."""


@dataclass
class _Resume:
    """A resume in progress: the checkpoint it reads, and the stub directory handed to the Trainer."""

    uri: str
    stub: str
    best_model_checkpoint: Optional[str]


def _metric_key(name: Optional[str]) -> Optional[str]:
    """The Trainer's name for the metric it ranks by (``eval_`` prefixed, as ``_determine_best_metric`` does)."""
    if not name:
        return None
    return name if name.startswith("eval_") else f"eval_{name}"


class ObjckptTrainerMixin:
    """Mix in before ``transformers.Trainer``: ``class MyTrainer(ObjckptTrainerMixin, Trainer)``.

    ``checkpoint_root``: where the steps go (``s3://bucket/run``, a path, ...).
    ``storage_options``: for objckpt (endpoint, credentials; by default the AWS
    environment).  ``async_save``: the training loop goes on once the state is
    staged in host memory; uploads finish in the background (``train`` waits for
    the last one before returning).

    Preemption (:mod:`objckpt.integrations.hf_preemption`): ``preemption_signals``
    (default ``(signal.SIGTERM,)``), ``preemption_deadline_s`` and
    ``preemption_check_every`` go to the manager (``CheckpointManager``'s keywords of the
    same names); an :class:`~objckpt.integrations.hf_preemption.ObjckptPreemptionCallback`
    then saves the step every rank agrees on once any rank got one of the signals, and
    stops training: ``train`` returns, :attr:`preemption_step` names the step.
    ``preemption_signals=()`` turns it off (no handler, no callback)."""

    def __init__(self, *args: Any, checkpoint_root: str, storage_options: Optional[dict[str, Any]] = None,
                 async_save: bool = False, preemption_signals: tuple[int, ...] = DEFAULT_SIGNALS,
                 preemption_deadline_s: float = DEFAULT_DEADLINE_S,
                 preemption_check_every: int = DEFAULT_CHECK_EVERY, **kwargs: Any) -> None:
        try:  # checked before the Trainer is built: the error names this class's keyword
            self._objckpt_preemption = PreemptionSettings.checked(preemption_signals, preemption_deadline_s,
                                                                  preemption_check_every)
        except PreemptionSettingsError as e:
            raise PreemptionSettingsError(str(e).replace("CheckpointManager(", f"{type(self).__name__}(")) from None
        super().__init__(*args, **kwargs)
        self.checkpoint_root = checkpoint_root.rstrip("/")
        self.objckpt_storage_options = storage_options
        self.objckpt_async_save = async_save
        self._objckpt_manager: Optional[CheckpointManager] = None
        self._objckpt_listening = False  # whether _objckpt_manager listens for the preemption signals
        self._objckpt_training = False  # inside train()
        self._objckpt_resume: Optional[_Resume] = None
        self._objckpt_saved: set[int] = set()
        self.preemption_callback: Optional[ObjckptPreemptionCallback] = None
        if self._objckpt_preemption.signals:
            self.preemption_callback = ObjckptPreemptionCallback(lambda: self.checkpoint_manager)
            self.add_callback(self.preemption_callback)  # type: ignore[attr-defined]

    # -- the manager -------------------------------------------------------------------------
    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The :class:`CheckpointManager` of ``checkpoint_root``, its retention from the
        Trainer's arguments (created on first use, when the process group exists).  It listens
        for the preemption signals while :meth:`train` runs only (nothing acts on a signal
        outside ``train``: the handler there before is back when it returns); one made
        outside ``train`` does not listen, and ``train`` replaces it with one that does."""
        listen = self._objckpt_training and bool(self._objckpt_preemption.signals)
        if self._objckpt_manager is not None and self._objckpt_listening != listen:
            self._objckpt_drop_manager()
        if self._objckpt_manager is None:
            args = self.args  # type: ignore[attr-defined]
            limit = args.save_total_limit if args.save_total_limit and args.save_total_limit > 0 else None
            metric = _metric_key(args.metric_for_best_model)
            best = 1 if limit is not None and metric is not None else None
            mode = "max" if args.greater_is_better else "min"
            self._objckpt_manager = CheckpointManager(
                self.checkpoint_root, keep_last=limit, keep_best=best, best_key=metric if best else None,
                best_mode=mode, async_save=self.objckpt_async_save, storage_options=self.objckpt_storage_options,
                preemption_signals=self._objckpt_preemption.signals if listen else (),
                preemption_deadline_s=self._objckpt_preemption.deadline_s,
                preemption_check_every=self._objckpt_preemption.check_every)
            self._objckpt_listening = listen
        return self._objckpt_manager

    def _objckpt_stop_listening(self) -> None:
        """The manager stops listening for the preemption signals (the handler there before is
        back) and stays: dropping it would make the next use a collective again (its steps
        are read once, on rank 0, and broadcast), which a rank-0-only use after ``train``
        would hang in."""
        if self._objckpt_manager is not None and self._objckpt_listening:
            self._objckpt_manager._preemption.close()
            self._objckpt_listening = False

    def _objckpt_drop_manager(self) -> None:
        """Close the manager (its saves waited for, its signal handler put back); the next
        use of :attr:`checkpoint_manager` makes another."""
        mgr, self._objckpt_manager = self._objckpt_manager, None
        if mgr is not None:
            mgr.close()

    @property
    def preemption_step(self) -> Optional[int]:
        """The step saved because the job is being preempted (None: none): after ``train``
        returns with one, exit (``sys.exit(0)``); the next job resumes from it."""
        cb = self.preemption_callback
        return None if cb is None else cb.saved_step

    def _objckpt_refuse_unsupported(self) -> None:
        for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
            if getattr(self, flag, False):
                raise UnsupportedTrainerError(
                    f"objckpt's Trainer integration does not checkpoint {name} trainers ({name} writes its own "
                    f"sharded checkpoints); checkpoint_root={self.checkpoint_root!r}")

    # -- saving ------------------------------------------------------------------------------
    def _objckpt_trainer_state(self) -> dict[str, Any]:
        """``trainer_state.json``'s content, the callbacks' state updated as the Trainer does."""
        from transformers.trainer_callback import ExportableState

        t: Any = self
        for cb in [cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(t.state.stateful_callbacks.get(name), list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(t.state), sort_keys=True))
        return out

    def _objckpt_metadata(self, step: int) -> dict[str, Any]:
        """The step's index metadata: step, epoch and, when evaluated at this step, the ranked metric."""
        t: Any = self
        md: dict[str, Any] = {"global_step": step, "epoch": t.state.epoch}
        metric = _metric_key(t.args.metric_for_best_model)
        if metric is not None:
            for entry in reversed(t.state.log_history):
                if entry.get("step") == step and isinstance(entry.get(metric), (int, float)):
                    md[metric] = float(entry[metric])
                    break
        return md

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, as one step of the manager (every rank calls it)."""
        self._objckpt_refuse_unsupported()
        t: Any = self
        step = int(t.state.global_step)
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        mgr = self.checkpoint_manager
        best = t.state.best_global_step
        if best and (best == step or best in self._objckpt_saved):
            t.state.best_model_checkpoint = mgr.step_uri(best)
        state: dict[str, Any] = {"model": t.model, "trainer_state": self._objckpt_trainer_state(),
                                 "training_args": training_args_json(t.args)}
        # the files save_pretrained writes beside the weights (hf_pretrained.STEP_FILES), as JSON values
        for key, value in (("model_config", config_json(t.model)),
                           ("generation_config", generation_config_json(t.model))):
            if value is not None:
                state[key] = value
        if not t.args.save_only_model:
            state["rng"] = capture_rng(all_cuda_devices=t.args.parallel_mode.value == "distributed")
            state["optimizer"] = t.optimizer
            state["scheduler"] = t.lr_scheduler
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        mgr.save(step, state, metadata=self._objckpt_metadata(step))
        self._objckpt_saved.add(step)

    # -- resuming ----------------------------------------------------------------------------
    def _objckpt_target(self, resume: Union[str, bool, None]) -> Optional[str]:
        """The objckpt URI to resume from, or None (start fresh, or a stock local checkpoint)."""
        if resume is None or resume is False:
            return None
        if resume is True or resume == "latest":
            step = self.checkpoint_manager.latest_step()
            if step is None:
                if resume is True:
                    raise NotFoundError(f"resume_from_checkpoint=True: no checkpoint under {self.checkpoint_root!r}")
                log.info("no checkpoint under %s yet: training starts from scratch", self.checkpoint_root)
                return None
            return self.checkpoint_manager.step_uri(step)
        if not isinstance(resume, str):
            raise TypeError(f"resume_from_checkpoint must be a str, a bool or None, not {type(resume).__name__}")
        if "://" not in resume and not os.path.isfile(os.path.join(resume, "manifest.json")):
            return None  # a Trainer's own local checkpoint directory: the stock path reads it
        _inspect(resume, storage_options=self.objckpt_storage_options, chunks=False)  # NotFoundError naming it
        return resume

    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` may also be an objckpt URI,
        ``"latest"`` (the newest step under ``checkpoint_root``, or a fresh start when
        there is none) or ``True`` (the newest step; an error when there is none)."""
        self._objckpt_refuse_unsupported()
        self._objckpt_training = True
        try:
            uri = self._objckpt_target(resume_from_checkpoint)
            try:
                out = self._objckpt_train(uri, resume_from_checkpoint, *args, **kwargs)
            except BaseException:
                self._objckpt_settle(raising=True)
                raise
            finally:
                self._objckpt_resume = None
            self._objckpt_settle(raising=False)
            return out
        finally:
            self._objckpt_training = False
            self._objckpt_stop_listening()

    def _objckpt_train(self, uri: Optional[str], resume: Any, *args: Any, **kwargs: Any) -> Any:
        if uri is None:
            fresh = None if resume is True or resume == "latest" else resume
            return super().train(fresh, *args, **kwargs)  # type: ignore[misc]
        with tempfile.TemporaryDirectory(prefix="objckpt-trainer-") as stub:
            ts = dict(_read(uri, "trainer_state", storage_options=self.objckpt_storage_options)["trainer_state"])
            best = ts.get("best_model_checkpoint")
            ts["best_model_checkpoint"] = None  # a URI fails the Trainer's os.path.isdir check: put back later
            with open(os.path.join(stub, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                json.dump(ts, f)
            self._objckpt_resume = _Resume(uri, stub, best)
            self._objckpt_saved.update(self.checkpoint_manager.steps())
            log.info("resuming from %s", uri)
            return super().train(stub, *args, **kwargs)  # type: ignore[misc]

    def _objckpt_settle(self, raising: bool) -> None:
        """Wait for the saves in flight; while another error is on its way, log theirs instead."""
        if self._objckpt_manager is None:
            return
        try:
            self._objckpt_manager.wait()
        except Exception:
            if not raising:
                raise
            log.exception("a checkpoint save under %s failed as well", self.checkpoint_root)

    def _objckpt_resuming(self, checkpoint: Optional[str]) -> Optional[_Resume]:
        r = self._objckpt_resume
        return r if r is not None and checkpoint == r.stub else None

    def _objckpt_load(self, r: _Resume, state: dict[str, Any], what: str) -> None:
        """Load ``state``'s keys from the checkpoint; a key it lacks is an error naming it."""
        res = _load(state, r.uri, storage_options=self.objckpt_storage_options, strict=False)
        prefixes = tuple(f"{k}." for k in state)
        missing = [k for k in res.missing_keys if k in state or k.startswith(prefixes)]
        if missing:
            raise StateDictMismatchError(
                f"cannot resume the Trainer's {what} from {r.uri!r}: the checkpoint lacks {len(missing)} key(s) "
                f"it needs: {missing[:10]}")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        r = self._objckpt_resuming(resume_from_checkpoint)
        if r is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = model if model is not None else self.model  # type: ignore[attr-defined]
        self._objckpt_load(r, {"model": target}, "model")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        r = self._objckpt_resuming(checkpoint)
        if r is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        t: Any = self
        if r.best_model_checkpoint is not None:  # set aside in train(): restore it now
            t.state.best_model_checkpoint = r.best_model_checkpoint
        present = set(_inspect(r.uri, storage_options=self.objckpt_storage_options, chunks=False).tensors)
        if any(k.startswith("optimizer.") for k in present):  # absent with save_only_model
            self._objckpt_load(r, {"optimizer": t.optimizer, "scheduler": t.lr_scheduler}, "optimizer and scheduler")

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        r = self._objckpt_resuming(checkpoint)
        if r is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None:
            self._objckpt_load(r, {"scaler": scaler}, "gradient scaler")

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        r = self._objckpt_resuming(checkpoint)
        if r is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        holder: dict[str, Any] = {"rng": None}
        _load(holder, r.uri, storage_options=self.objckpt_storage_options, strict=False)  # this rank's own
        if holder["rng"] is None:
            log.info("%s holds no generator state: the resumed run is not reproducible bit for bit", r.uri)
            return
        restore_rng(holder["rng"], f"{r.uri} rng")

    def _load_best_model(self) -> None:
        t: Any = self
        if self.preemption_step is not None:  # the job is exiting: no download in the grace period
            log.info("preempted at step %d: the best model is not loaded", self.preemption_step)
            return None
        best = t.state.best_model_checkpoint
        if not best or ("://" not in best and not os.path.isfile(os.path.join(best, "manifest.json"))):
            return super()._load_best_model()  # type: ignore[misc]  # a stock local checkpoint
        self._objckpt_settle(raising=False)  # the best step may be the save still in flight
        log.info("loading the best model from %s (score: %s)", best, t.state.best_metric)
        self._objckpt_load(_Resume(best, "", None), {"model": t.model}, "best model")


class ObjckptTrainer(ObjckptTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints go to ``checkpoint_root`` through objckpt."""
