"""The old path of mortal.client.fork, mortal.client.rollback and mortal.client.cli.fork (deprecated):
warns, and re-exports them."""

import warnings

from mortal.client import fork as _fork
from mortal.client import rollback as _rollback
from mortal.client.cli import fork as _verbs

_OLD = "mortal.controller.cli.fork"
_NEW = "mortal.client.fork, mortal.client.rollback, mortal.client.cli.fork"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)
_MOVED = (_fork, _rollback, _verbs)


def __getattr__(name: str) -> object:
    for module in _MOVED:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
