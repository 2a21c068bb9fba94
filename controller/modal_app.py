"""The old path of mortal.client.modal_app (deprecated): warns, and re-exports it."""

import warnings

from mortal.client import modal_app as _moved

_OLD, _NEW = "mortal.controller.modal_app", "mortal.client.modal_app"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
