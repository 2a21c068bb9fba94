"""The old path of mortal.client.trainer_inputs (deprecated): warns, and re-exports it."""

import warnings

from mortal.client import trainer_inputs as _moved

_OLD, _NEW = "mortal.controller.trainer_inputs", "mortal.client.trainer_inputs"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
