"""The old path of mortal.client.cli.dashboard_data (deprecated): warns, and re-exports it."""

import warnings

from mortal.client.cli import dashboard_data as _moved

_OLD, _NEW = "mortal.controller.cli.dashboard_data", "mortal.client.cli.dashboard_data"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
