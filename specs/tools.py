"""`spec.rollout`'s tool-calling fields: multi-turn rollouts with TRL's `tools` and `environment_factory`.

Used by `mortal.specs.training.RolloutSpec` (the fields live there, flat, as TRL's arguments are flat);
this module holds their checks. It never imports user code: a reference is only checked to be
well formed ('module:attr'); the rollout worker imports it (mortal.workers.rollout.tools) and fails the run
with the reference's name when it cannot.
"""

from __future__ import annotations

import re

from mortal.specs.base import rule_error
from mortal.specs.rewards import FUNCTION_REF, _suggest_ref

ENVIRONMENT_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
ENVIRONMENT_COLUMN = "environment"
"""The dataset column that picks an environment by name when `rollout.environment` is a dict (TRL's)."""


def check_reference(value: str, what: str) -> str:
    """A 'module:attr' reference, or a rule error whose message shows the fix."""
    if not FUNCTION_REF.match(value):
        raise rule_error(
            f"{what} must look like 'module:attr' (got {value!r}); for example {_suggest_ref(value)!r}"
        )
    return value


def check_tools(value: list[str]) -> list[str]:
    for ref in value:
        check_reference(ref, "each tool")
    names = [ref.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for ref in value]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise rule_error(
            f"two tools are named {repeated[0]!r}: the model calls a tool by its function's "
            "name, so each must be distinct"
        )
    return value


def check_environment(value: str | dict[str, str] | None) -> str | dict[str, str] | None:
    if value is None or isinstance(value, str):
        return value if value is None else check_reference(value, "an environment")
    if not value:
        raise rule_error("an environment dict needs at least one 'name: module:Class' entry")
    for name, ref in value.items():
        if not ENVIRONMENT_NAME.match(name):
            raise rule_error(f"environment name {name!r} may hold only letters, digits, '_', '.' and '-'")
        check_reference(ref, f"environment {name!r}")
    return value
