"""The old path of mortal.client.checkpoint_copy and mortal.client.cli.cp (deprecated):
warns, and re-exports them."""

import warnings

from mortal.client import checkpoint_copy as _copy
from mortal.client.cli import cp as _verb

_OLD, _NEW = "mortal.controller.cli.cp", "mortal.client.checkpoint_copy, mortal.client.cli.cp"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)
_MOVED = (_copy, _verb)


def __getattr__(name: str) -> object:
    for module in _MOVED:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
