"""The base of every spec model: camelCase YAML keys, snake_case attributes, unknown keys refused.

Imported by the spec modules (metadata, training, rewards, status, run); nothing outside
`mortal.specs` needs it. `rule_error` builds the errors our validators raise: a pydantic error whose
text says the fix, optionally naming the field it is about, so the loader can point at that field's
line rather than at the enclosing block. It must stay free of I/O and of the rest of mortal.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

RULE_ERROR = "mortal_spec"
"""pydantic error type of our own validators; `ctx['field']` (an alias) names the field, if any."""


class SpecModel(BaseModel):
    """Config shared by all spec models (YAML/JSON is camelCase, Python is snake_case)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )


def rule_error(message: str, field: str | None = None) -> PydanticCustomError:
    """An error for a broken spec rule; `message` says the fix, `field` is the camelCase key it blames
    (dotted for a key below the validated model, e.g. "rollout.colocate")."""
    return PydanticCustomError(RULE_ERROR, "{message}", {"message": message, "field": field})
