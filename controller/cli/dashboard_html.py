"""The old path of mortal.client.cli.dashboard_html (deprecated): warns, and re-exports it."""

import warnings

from mortal.client.cli import dashboard_html as _moved

_OLD, _NEW = "mortal.controller.cli.dashboard_html", "mortal.client.cli.dashboard_html"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
