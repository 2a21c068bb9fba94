"""`spec.rewards[]`: one reward signal of a TrainingRun (a Python function/class, or a built-in env).

Used by `mortal.specs.training.TrainingSpec`; read by the reward workers, which import the function
named here (this module never imports user code: it only checks that the reference is well formed).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from mortal.specs.base import SpecModel, rule_error
from mortal.specs.deadlines import DEFAULT_REWARD_TIMEOUT_SECONDS, REWARD_SILENT_STEPS

BUILTIN_ENVS = ("code-execution", "llm-judge", "math-answer", "environment")
FUNCTION_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
ENV_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SandboxSpec(SpecModel):
    """Limits for model-written code run by a reward (the code-execution env, or a function that asks)."""

    timeout_seconds: float = Field(10.0, gt=0, description="Wall-clock limit per execution, in seconds.")
    memory_mb: int = Field(
        512,
        ge=16,
        alias="memoryMB",
        description="Address-space limit per execution, in MiB (YAML key memoryMB).",
    )
    backend: Literal["local", "modal"] = Field(
        "local",
        description="Where the code runs: local (the worker's machine, bubblewrap or unshare) or "
        "modal (a modal.Sandbox per execution, no network; needs the modal client and a token on the "
        "worker).",
    )


class RewardSpec(SpecModel):
    """One reward: exactly one of `function` (Python, TRL-style) or `env` (a built-in environment)."""

    function: str | None = Field(
        None,
        description="Python reference 'module:attr' to a TRL-style reward function "
        "f(completions, prompts=..., **columns) -> list[float | None], or to a RewardEnvironment subclass.",
    )
    env: Literal["code-execution", "llm-judge", "math-answer", "environment"] | None = Field(
        None,
        description="A built-in reward environment: code-execution, llm-judge or math-answer; or "
        "environment, the score of rollout.environment's get_reward() (`args: {class: 'module:Class'}` "
        "scores only rollouts of that class).",
    )
    name: str | None = Field(
        None,
        min_length=1,
        description="Name in metrics and results; default: the function's attribute name or the env name.",
    )
    weight: float = Field(1.0, description="Weight of this reward in the weighted sum that GRPO optimizes.")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for a RewardEnvironment class or a built-in env."
    )
    sandbox: SandboxSpec = Field(
        default_factory=SandboxSpec, description="Limits for code this reward executes (code-execution)."
    )
    timeout_seconds: float = Field(
        DEFAULT_REWARD_TIMEOUT_SECONDS,
        gt=0,
        description="Wall-clock limit of one call of this reward (one prompt's completions), in seconds; "
        "past it the call is abandoned, its completions score None and a Warning event names it. Rewards "
        f"none of whose calls return for {REWARD_SILENT_STEPS} steps in a row fail the run (RewardTimedOut).",
    )
    model: str | None = Field(None, description="Judge model name (llm-judge), e.g. gpt-4o-mini.")
    base_url: str | None = Field(
        None,
        alias="baseURL",
        description="OpenAI-compatible endpoint of the judge (llm-judge; YAML key baseURL).",
    )
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the judge's API key (list it in spec.secrets).",
    )

    @field_validator("function")
    @classmethod
    def _function_is_a_reference(cls, value: str | None) -> str | None:
        if value is not None and not FUNCTION_REF.match(value):
            raise rule_error(
                f"must look like 'module:attr' (got {value!r}); for example {_suggest_ref(value)!r}"
            )
        return value

    @field_validator("api_key_env")
    @classmethod
    def _api_key_env_is_a_variable_name(cls, value: str | None) -> str | None:
        if value is not None and not ENV_VAR.match(value):
            raise rule_error(
                f"must be the NAME of an environment variable, e.g. OPENAI_API_KEY (got {value!r}); "
                "never put the key itself in a spec"
            )
        return value

    @model_validator(mode="after")
    def _exactly_one_source(self) -> RewardSpec:
        if self.function is not None and self.env is not None:
            raise rule_error("a reward takes either 'function' or 'env', not both: split it into two entries")
        if self.function is None and self.env is None:
            raise rule_error(
                "a reward needs 'function' (\"module:attr\") or 'env' "
                f"({', '.join(BUILTIN_ENVS)}): add one of them"
            )
        return self

    def display_name(self) -> str:
        """The name before de-duplication: `name`, else the function's attribute, else the env name."""
        if self.name:
            return self.name
        return self.function.rsplit(":", 1)[-1] if self.function else str(self.env)


def _suggest_ref(value: str) -> str:
    """A 'module:attr' close to what the user wrote (a dotted path or a file path), for the hint."""
    dotted = value.strip().removesuffix(".py").replace("/", ".").replace("::", ":")
    if ":" not in dotted and "." in dotted:
        module, attr = dotted.rsplit(".", 1)
        return f"{module}:{attr}"
    return "my_rewards:correct_answer"
