"""``python -m objckpt``: the ``objckpt`` command line (the same as the console script)."""
import sys

from .cli import main

sys.exit(main())
