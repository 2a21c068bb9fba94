"""The old path of mortal.client.apply and mortal.client.cli.apply (deprecated):
warns, and re-exports them."""

import warnings

from mortal.client import apply as _apply
from mortal.client.cli import apply as _verb

_OLD, _NEW = "mortal.controller.cli.apply", "mortal.client.apply, mortal.client.cli.apply"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)
_MOVED = (_apply, _verb)


def __getattr__(name: str) -> object:
    for module in _MOVED:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
