"""The old path of mortal.client.modes (deprecated): warns, and re-exports it."""

import warnings

from mortal.client import modes as _moved

_OLD, _NEW = "mortal.controller.modes", "mortal.client.modes"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
