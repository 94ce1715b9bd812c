"""``python -m objckpt.cli``: the ``objckpt`` command line."""
import sys

from .main import main

sys.exit(main())
