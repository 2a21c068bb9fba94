"""The base of every spec model: camelCase YAML keys, snake_case attributes, unknown keys refused.

Imported by the spec modules (metadata, training, rewards, status, run); nothing outside
`mortal.specs` needs it. `rule_error` builds the errors our validators raise: a pydantic error whose
text says the fix, optionally naming the field it is about, so the loader can point at that field's
line rather than at the enclosing block. It must stay free of I/O and of the rest of mortal.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
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

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """`maxSteps: true` is a mistake, not the number 1, which pydantic's lax mode would make of it (a
        whole model in strict mode would refuse more than that: "5m" durations, ints for floats)."""
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _number_not_bool(field.annotation):
                raise rule_error("must be a number, not true or false")
        return value


def rule_error(message: str, field: str | None = None, key: str | None = None) -> PydanticCustomError:
    """An error for a broken spec rule; `message` says the fix, `field` is the camelCase key it blames
    (dotted for a key below the validated model, e.g. "rollout.colocate"). `key`: the key of a mapping
    field it blames (a label's), kept whole: dots and slashes are part of such a key, never a path."""
    return PydanticCustomError(RULE_ERROR, "{message}", {"message": message, "field": field, "key": key})


def blamed(error: Any) -> tuple[Any, ...]:
    """The path of what a pydantic error blames: its loc, and for a spec rule the field or mapping key it
    names below it (rule_error), so that the error points at that key's own line."""
    ctx = (error.get("ctx") or {}) if error["type"] == RULE_ERROR else {}
    field, key = ctx.get("field"), ctx.get("key")
    below = [*(field.split(".") if field else ()), *(() if key is None else (key,))]
    return (*error["loc"], *below)


def _number_not_bool(annotation: Any) -> bool:
    """Whether `annotation` takes numbers (int, float, in a union too) and no boolean."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
    else:
        members = (annotation,)
    return bool not in members and any(m in (int, float) for m in members)
