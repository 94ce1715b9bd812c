"""Preemption for PyTorch Lightning: every rank saves the same step, then Lightning stops as on SIGTERM.

    from objckpt.lightning import ModelCheckpoint, ObjckptCheckpointIO, ObjckptPreemption
    trainer = Trainer(plugins=[ObjckptCheckpointIO()], callbacks=[ModelCheckpoint(...), ObjckptPreemption()],
                      default_root_dir="s3://bucket/run")
    trainer.fit(model, data, ckpt_path="last")   # the next job resumes from the preemption checkpoint

:class:`ObjckptPreemption` uses objckpt's preemption (:mod:`objckpt.manager.preemption`:
the process-wide signal handler, the ranks' agreement through one small collective over
the default process group, the deadline) without a ``CheckpointManager``: the checkpoint
is Lightning's own, written by ``trainer.save_checkpoint`` (the
:class:`~objckpt.integrations.lightning.ObjckptCheckpointIO` plugin, or any other).

**Lightning's own SIGTERM handling (2.6), and why it is deferred.**  At ``fit`` Lightning
installs a SIGTERM handler (``_SignalConnector.register_signal_handlers``, after the
``setup`` hooks) whose notifier (``_sigterm_notifier_fn``) forwards the signal to the
processes its launcher started, runs ``dist.broadcast`` *inside the signal handler* when
there are several ranks, and sets ``trainer.received_sigterm``.  The training loop then
raises ``SIGTERMException`` (a ``SystemExit``) at the end of that same batch, on that rank
(``TrainingEpochLoop.on_advance_end``), in an evaluation loop (``_EvaluationLoop``), or at
the start of the next batch on every rank when rank 0 has it (``_broadcast_sigterm_tensor``).
Nothing is saved (unless an ``OnExceptionCheckpoint`` saves, on one rank's exception),
the ranks an agreement would need have left, and a collective run from a signal handler
on one rank pairs with whatever collective the other ranks run next.  So this callback
defers the notifier: it replaces it, on this trainer only, before Lightning registers its
handler, with one that does nothing once the callback listens (``on_train_start``) and is
Lightning's own before that (a signal in the sanity check stops as Lightning does).  Every
other SIGTERM handler still runs: SLURM's ``_sigterm_handler_fn`` and the handler that was
there before ``fit`` (Lightning composes them; objckpt's handler chains to Lightning's).

**At the agreed step** (``on_train_batch_end``, once per optimizer step, every rank): it
saves ``trainer.save_checkpoint(path)`` (a collective in Lightning: rank 0 writes), waits
for the plugin's save in flight until the deadline at most, then sets
``trainer.received_sigterm``: from there on Lightning does what it does on SIGTERM, on
every rank at the same batch: ``SIGTERMException`` at the end of the batch,
``on_exception`` hooks, teardown (the plugin waits for its saves), and ``fit`` raises the
``SystemExit`` whose status is 0.  ``path`` defaults to ``last.ckpt`` in the
``ModelCheckpoint``'s directory (``<default_root_dir>/checkpoints`` without one), so
``fit(ckpt_path="last")`` resumes from it; with objckpt's ``ModelCheckpoint`` "last" is the
newest committed checkpoint of the directory whatever its name.
"""
from __future__ import annotations

import logging
import signal
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks import Callback

from ..distributed.comm import get_comm
from ..manager.preemption import (DEFAULT_CHECK_EVERY, DEFAULT_DEADLINE_S, DEFAULT_SIGNALS, Preemption,
                                  PreemptionSettings, PreemptionSettingsError)
from .lightning import _objckpt_io

log = logging.getLogger(__name__)

#: the attribute of Lightning's ``_SignalConnector`` this callback defers (Lightning 2.x)
_NOTIFIER = "_sigterm_notifier_fn"


class ObjckptPreemption(Callback):
    """Saves the step every rank agrees on after a preemption signal, then stops ``fit`` (see the module).

    ``signals`` (default ``(signal.SIGTERM,)``), ``deadline_s`` and ``check_every``:
    ``CheckpointManager``'s ``preemption_signals``, ``preemption_deadline_s`` and
    ``preemption_check_every`` (docs/tiering.md, "Preemption").  ``path``: where to save
    (``{step}`` is replaced by the step); default ``last.ckpt`` of the checkpoint
    directory.  ``process_group``: the group the ranks agree over (default: the default
    group, which Lightning's DDP uses).  After ``fit``: :attr:`saved_step`,
    :attr:`checkpoint_path` and :attr:`signalled_ranks` say what was saved, where, and
    which ranks had received a signal."""

    def __init__(self, *, signals: tuple[int, ...] = DEFAULT_SIGNALS, deadline_s: float = DEFAULT_DEADLINE_S,
                 check_every: int = DEFAULT_CHECK_EVERY, path: Optional[str] = None,
                 process_group: Any = None) -> None:
        try:
            self.settings = PreemptionSettings.checked(signals, deadline_s, check_every)
        except PreemptionSettingsError as e:
            raise PreemptionSettingsError(str(e).replace("CheckpointManager(preemption_", "ObjckptPreemption(")) \
                from None
        if not self.settings.signals:
            raise PreemptionSettingsError("ObjckptPreemption(signals=()) listens to nothing; leave the callback "
                                          "out to turn preemption off")
        self.path = path
        self.process_group = process_group
        self._preemption: Optional[Preemption] = None
        self._listening = False
        self._connector: Any = None
        self._last_step: Optional[int] = None
        #: the step saved at a preemption, and where (None: none)
        self.saved_step: Optional[int] = None
        self.checkpoint_path: Optional[str] = None
        #: the ranks that had received a signal when the ranks agreed
        self.signalled_ranks: list[int] = []

    # -- Lightning's SIGTERM notifier, deferred (module docstring) ----------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self.saved_step = self.checkpoint_path = None
        self.signalled_ranks = []
        if signal.SIGTERM not in self.settings.signals:
            return
        conn = getattr(trainer, "_signal_connector", None)
        notifier: Optional[Callable[..., Any]] = getattr(conn, _NOTIFIER, None)
        if conn is None or notifier is None or not hasattr(conn, "received_sigterm"):
            log.warning("objckpt: ObjckptPreemption: this Lightning version has no %s to defer: Lightning's own "
                        "SIGTERM handling stays on and may stop a rank before the ranks agree on a step to save",
                        _NOTIFIER)
            return

        def deferred(signum: int, frame: Any) -> None:
            if not self._listening:
                notifier(signum, frame)

        setattr(conn, _NOTIFIER, deferred)  # read by register_signal_handlers, after the setup hooks
        self._connector = conn

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after Lightning's register_signal_handlers: objckpt's handler chains to Lightning's
        self._preemption = Preemption(self.settings, get_comm(self.process_group))
        self._listening = True
        self._last_step = trainer.global_step

    # -- the agreement and the save ------------------------------------------------------------
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        p = self._preemption
        step = int(trainer.global_step)
        if p is None or self.saved_step is not None or step == self._last_step:
            return  # not listening, done, or no optimizer step in this batch (gradient accumulation)
        self._last_step = step
        if p.reached(step):
            self._save(trainer, p, step)

    def _checkpoint_path(self, trainer: Any, step: int) -> str:
        if self.path is not None:
            return self.path.format(step=step)
        cb = trainer.checkpoint_callback
        folder = getattr(cb, "dirpath", None) or f"{str(trainer.default_root_dir).rstrip('/')}/checkpoints"
        name = getattr(cb, "CHECKPOINT_NAME_LAST", None) or "last"
        return f"{str(folder).rstrip('/')}/{name}{getattr(cb, 'FILE_EXTENSION', '.ckpt')}"

    def _save(self, trainer: Any, p: Preemption, step: int) -> None:
        path = self._checkpoint_path(trainer, step)
        log.info("objckpt: preemption save of step %d to %s (%.1f s left of the deadline)", step, path, p.left())
        trainer.save_checkpoint(path)
        io = _objckpt_io(trainer)
        done = io._wait_for(path, timeout=p.left()) if io is not None else True
        self.saved_step, self.checkpoint_path = step, path
        self.signalled_ranks = list(p.agreed.signalled) if p.agreed is not None else []
        if trainer.is_global_zero:
            if not done:
                log.warning("objckpt: the preemption deadline passed before the save of step %d to %s committed; "
                            "Lightning's teardown still waits for it (a SIGKILL before its commit leaves the "
                            "previous checkpoint)", step, path)
            elif p.left() <= 0:
                log.warning("objckpt: the preemption save of step %d to %s committed after its deadline "
                            "(deadline_s): the scheduler's grace period may be too short for it", step, path)
            else:
                log.warning("objckpt: preemption: step %d saved to %s; training stops", step, path)
        if self._connector is not None:
            self._connector.received_sigterm = True  # Lightning's own SIGTERM path from here (module docstring)
        else:
            trainer.should_stop = True

    # -- the end ---------------------------------------------------------------------------------
    def _close(self) -> None:
        self._listening = False
        if self._preemption is not None:
            self._preemption.close()  # before Lightning's teardown: its handler, ours chained to, goes back
            self._preemption = None
        if self._connector is not None:
            self._connector.__dict__.pop(_NOTIFIER, None)
            self._connector = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._close()


__all__ = ["ObjckptPreemption"]
