"""``python -m kvspec.cli`` (how ``kvspec`` re-executes itself inside a target's venv)."""

import sys

from .main import main

sys.exit(main())
