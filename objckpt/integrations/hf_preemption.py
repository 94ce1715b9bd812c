"""Preemption for the Hugging Face ``Trainer``: every rank saves the same step, then training stops.

:class:`~objckpt.integrations.hf_trainer.ObjckptTrainerMixin` adds
:class:`ObjckptPreemptionCallback` unless it is given ``preemption_signals=()``.  The
callback drives its :class:`~objckpt.CheckpointManager`'s preemption
(:mod:`objckpt.manager.preemption`: the signal handler, the ranks' agreement, the
deadline) through the Trainer's own control flow, so nothing else of the Trainer changes:

* ``on_step_end`` (once per optimizer step, on every rank): the manager's
  ``reached_preemption(global_step)``, a collective.  At the step the ranks agree on it sets
  ``control.should_save`` (whatever ``save_strategy`` / ``save_steps`` say: the step is
  usually off the interval) and clears ``control.should_evaluate`` (no evaluation in the
  grace period; with ``save_strategy="best"`` an evaluation would also decide whether to
  save).  The Trainer then calls the mixin's ``_save_checkpoint``, whose ``mgr.save`` of
  the agreed step is the manager's preemption save (the fastest tier, the deadline).
* ``on_save`` of that step: ``mgr.wait()`` (bounded by ``preemption_deadline_s`` from the
  first signal), then ``control.should_training_stop``.  It is set here, after the save and
  not before it, because the saved ``TrainerState`` holds the ``TrainerControl``: a resume
  with ``restore_callback_states_from_checkpoint=True`` would otherwise stop at once.
* ``on_epoch_end`` after it: no epoch-end save or evaluation (``save_strategy="epoch"``
  would save the same step again).

``trainer.train()`` then returns (the mixin skips ``load_best_model_at_end``'s download
after a preemption) and :attr:`ObjckptTrainerMixin.preemption_step
<objckpt.integrations.hf_trainer.ObjckptTrainerMixin.preemption_step>` says which step was
saved: the script exits 0; ``train(resume_from_checkpoint="latest")`` in the next job
resumes from it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from transformers import TrainerCallback

from ..manager import CheckpointManager

log = logging.getLogger(__name__)


class ObjckptPreemptionCallback(TrainerCallback):
    """Saves the step the ranks agree on after a preemption signal, then stops training (see the module).

    ``manager``: returns the Trainer's :class:`~objckpt.CheckpointManager` (the mixin's
    ``checkpoint_manager``, created on first use: here at ``on_train_begin``, in the main
    thread, which installs the signal handler)."""

    def __init__(self, manager: Callable[[], CheckpointManager]) -> None:
        self._manager = manager
        #: the step saved at a preemption (None: none yet)
        self.saved_step: Optional[int] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.saved_step = None
        self._manager()  # the handler listens from here on
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        step = int(state.global_step)
        mgr = self._manager()
        if not mgr.reached_preemption(step):
            return control
        if mgr.preemption_step == step:
            control.should_save = True
            control.should_evaluate = False
        else:  # the agreed step passed without a save (a later callback cleared should_save): stop now
            log.error("objckpt: preemption: step %s was agreed on but not saved (control.should_save was cleared "
                      "after this callback set it); training stops at step %d without a preemption checkpoint",
                      mgr.preemption_step, step)
            control.should_training_stop = True
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        mgr = self._manager()
        step = int(state.global_step)
        if mgr.preemption_step != step:
            return control
        mgr.wait()  # bounded by the preemption deadline; says in the log where the step got
        self.saved_step = step
        control.should_training_stop = True
        log.warning("objckpt: preemption: step %d saved under %s; training stops (resume_from_checkpoint='latest' "
                    "resumes from it)", step, mgr.root)
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.saved_step is not None:
            control.should_save = False
            control.should_evaluate = False
        return control


__all__ = ["ObjckptPreemptionCallback"]
