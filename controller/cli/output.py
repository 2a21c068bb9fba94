"""The old path of mortal.client.cli.output (deprecated): warns, and re-exports it."""

import warnings

from mortal.client.cli import output as _moved

_OLD, _NEW = "mortal.controller.cli.output", "mortal.client.cli.output"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
