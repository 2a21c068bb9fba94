"""The old path of mortal.client.fork (deprecated): warns, and re-exports it."""

import warnings

from mortal.client import fork as _moved

_OLD, _NEW = "mortal.controller.cli.fork", "mortal.client.fork"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
