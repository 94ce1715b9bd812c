"""The ``objckpt`` command line: ``demo | bench | convert | export | info | ls | gc | cp | diff | verify | rm | prune``.

One module per group of commands, each adding its parsers to the one in
:mod:`.main` and turning flags into library calls and results into lines:

* :mod:`.options` -- the storage flags every command takes, the progress bar;
* :mod:`.info` -- ``info`` (a checkpoint's whole tree, as text or JSON);
* :mod:`.checkpoints` -- ``gc``, ``cp``, ``diff``, ``verify`` (work done by :mod:`objckpt.ops`);
* :mod:`.manager` -- ``ls``, ``rm``, ``prune`` (a manager root and its step index);
* :mod:`.convert` -- ``convert``, ``export`` (work done by :mod:`objckpt.integrations`);
* :mod:`.demo`, :mod:`.bench` -- ``objckpt demo`` and ``objckpt bench`` (embedded moto S3 by default).

``objckpt`` (the console script), ``python -m objckpt`` and ``python -m objckpt.cli`` all run :func:`main`.
"""
from __future__ import annotations

from .bench import cmd_bench
from .checkpoints import cmd_cp, cmd_diff, cmd_gc, cmd_verify
from .demo import cmd_demo
from .info import cmd_info
from .main import main
from .manager import cmd_ls

__all__ = ["main", "cmd_demo", "cmd_info", "cmd_ls", "cmd_verify", "cmd_gc", "cmd_bench", "cmd_cp", "cmd_diff"]
