"""What every operation runs on: the one background event loop and CPU thread
pool (:mod:`.loop`), and the host memory every operation borrows (:mod:`.memory`:
budgets, the pinned pool, CUDA side streams).

Both are process-wide and forget themselves after ``fork``.  Nothing here
imports the rest of objckpt, so every layer may use it.  The submodules are
not imported here: ``runtime.memory`` needs torch, ``runtime.loop`` does not.
"""
