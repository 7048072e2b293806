"""kvspec: an executable specification of paged KV-cache block management.

Layers, each importing only those below it::

    kvspec.spec                      the model and its invariants (imports nothing of ours)
    kvspec.reference, kvspec.adapters, kvspec.targets
                                     implementations of the spec's interface; adapters are
                                     the only code that imports vllm
    kvspec.testing                   the stateful machines (take an implementation)
    kvspec.proofs, kvspec.cli        z3 obligations and the command line
"""

__version__ = "0.1.0"

import os as _os
from pathlib import Path as _Path

# Every process kvspec starts in a target venv imports this checkout's kvspec, not whichever
# checkout the venv's editable install names (targets/checkout_finder.py).
_os.environ["KVSPEC_CHECKOUT"] = str(_Path(__file__).resolve().parent.parent)
