"""The built-in tools' old import path, kept so that specs naming `mortal.workers.builtin_tools:calculator`
(or its environments) still load; new specs name `mortal.workers.rollout.builtin_tools`.
Nothing else may import from here."""

import warnings

from mortal.workers.rollout.builtin_tools import *  # noqa: F403

warnings.warn(
    "mortal.workers.builtin_tools moved to mortal.workers.rollout.builtin_tools",
    DeprecationWarning,
    stacklevel=2,
)
