"""The old path of mortal.client.cli.main (deprecated): warns, and re-exports it."""

import warnings

from mortal.client.cli import main as _moved

_OLD, _NEW = "mortal.controller.cli.main", "mortal.client.cli.main"
warnings.warn(f"{_OLD} moved to {_NEW}; import it from there", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> object:
    return getattr(_moved, name)


if __name__ == "__main__":  # python -m mortal.controller.cli.main
    _moved.main()
