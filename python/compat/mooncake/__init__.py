"""mooncake-fs's stand-in for Mooncake's ``mooncake`` package: it has
``mooncake.store`` only, served by a mooncake-fs mount (see
mooncake_fs.mooncake_store)."""

import importlib.machinery
import os
import sys
import warnings


def _shadowed():
    """The origin of another ``mooncake`` package later on sys.path, if any."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for p in sys.path:
        if os.path.abspath(p or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("mooncake", [p])
        if spec is not None:
            return spec.origin or p
    return None


_other = _shadowed()
if _other is not None:
    warnings.warn(f"mooncake-fs's mooncake.store hides the mooncake package at {_other}; "
                  "remove mooncake-fs-mooncake-store (or reorder sys.path) to use that one", stacklevel=2)
