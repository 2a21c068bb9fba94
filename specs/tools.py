"""`spec.rollout`'s tool-calling fields: multi-turn rollouts with TRL's `tools` and `environment_factory`.

Used by `mortal.specs.training.RolloutSpec` (the fields live there, flat, as TRL's arguments are flat);
this module holds their checks, and `rollout.environmentService` (where environment instances run: in the
rollout worker, in child processes, or behind an HTTP server). It never imports user code: a reference is
only checked to be well formed ('module:attr'); the rollout worker imports it
(mortal.workers.rollout.tools) and fails the run with the reference's name when it cannot.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from mortal.specs.base import SpecModel, rule_error
from mortal.specs.deadlines import DEFAULT_RESET_TIMEOUT_SECONDS
from mortal.specs.rewards import ENV_VAR, FUNCTION_REF, _suggest_ref

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


SERVICE_MODES = ("inProcess", "processPool", "http")


class EnvironmentServiceSpec(SpecModel):
    """Where rollout.environment's instances live (docs/tools-and-multiturn.md#environments-as-services)."""

    mode: Literal["inProcess", "processPool", "http"] = Field(
        "inProcess",
        description="inProcess: each environment instance is built in the rollout worker's own process "
        "(TRL's way). processPool: each lives in a child process of the worker, so a crash or a hang of one "
        "is survived: the process is replaced and the rollout's reset and earlier calls replayed. http: each "
        "lives on an environment server (`mortalctl env serve`), so sandbox-heavy environments scale apart "
        "from the GPU workers.",
    )
    processes: int | None = Field(
        None,
        ge=1,
        description="processPool: child processes hosting the instances (several instances share one; one "
        "call at a time each). Absent: one per CPU core of the worker, at most 16.",
    )
    url: str | None = Field(
        None,
        min_length=1,
        description="http: the environment server's base URL, e.g. http://envs.internal:8700.",
    )
    token_env: str | None = Field(
        None,
        description="http: NAME of the environment variable holding the server's bearer token (list it in "
        "spec.secrets; never the token itself).",
    )
    reset_timeout_seconds: float = Field(
        DEFAULT_RESET_TIMEOUT_SECONDS,
        gt=0,
        description="Wall-clock limit of an instance's reset(**row), and with processPool and http of "
        "building it and of its get_reward(), in seconds; past it the instance's process is killed "
        "(inProcess: the reset is abandoned on its thread) and the run fails (EnvironmentTimedOut) when a "
        "reset timed out. Tool calls keep rollout.toolTimeoutSeconds; an inProcess get_reward() keeps "
        "its reward's timeoutSeconds.",
    )

    @field_validator("token_env")
    @classmethod
    def _token_env_is_a_variable_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_VAR.match(value):
            raise rule_error(
                f"must be the NAME of an environment variable, e.g. MORTAL_ENV_TOKEN (got {value!r}); "
                "never put the token itself in a spec"
            )
        return value

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise rule_error(
                "must be an http:// or https:// URL with a host, e.g. http://envs.internal:8700 "
                f"(got {value!r})"
            )
        if parts.query or parts.fragment or parts.username or parts.password:
            raise rule_error(
                f"must be a base URL without a query, a fragment or credentials (got {value!r}); the token "
                "comes from tokenEnv"
            )
        return value

    @model_validator(mode="after")
    def _fields_fit_the_mode(self) -> EnvironmentServiceSpec:
        if self.mode == "http":
            for key, value in (("url", self.url), ("tokenEnv", self.token_env)):
                if value is None:
                    raise rule_error(
                        f"mode http needs {key}: the server's base URL (url) and the NAME of the environment "
                        "variable holding its bearer token (tokenEnv)",
                        key,
                    )
        else:
            for key, value in (("url", self.url), ("tokenEnv", self.token_env)):
                if value is not None:
                    raise rule_error(f"{key} applies to mode http (the mode is {self.mode}): drop it", key)
        if self.processes is not None and self.mode != "processPool":
            raise rule_error(
                f"processes applies to mode processPool (the mode is {self.mode}): drop it", "processes"
            )
        return self
