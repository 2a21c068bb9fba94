"""What travels through the task queue between the actor and rollout workers.

A task is a `RolloutTask` (the task payload): a fixed chunk of one step's prompts, each a
`RolloutRequest`. A rollout worker answers it with a `RolloutAnswer` (the task result): one
`RolloutResult` per request, in order (`num_generations` completions, their sampling logprobs and
every reward function's score). A chunk is generated in one engine call on a GPU, so which prompts
share a batch follows from the run's seed and step alone (mortal.workers.schedule). Both sides
import only this module to agree.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field


class RolloutRequest(BaseModel):
    prompt: str | list[dict[str, Any]] = Field(description="the dataset's prompt: text or chat messages")
    row: dict[str, Any] = Field(default_factory=dict, description="every dataset column, passed to rewards")
    num_generations: int
    seed: int = Field(description="sampling seed: same weights + same seed -> same tokens (on CPU)")


class RolloutTask(BaseModel):
    requests: list[RolloutRequest] = Field(min_length=1, description="the chunk's prompts, in slot order")
    first_slot: int = Field(0, ge=0, description="the step slot of requests[0]; the rest follow it")


class RolloutResult(BaseModel):
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] = Field(description="per-token sampling logprobs, one list per completion")
    completions: list[Any] = Field(description="decoded text, or [{'role': 'assistant', 'content': ...}]")
    rewards: dict[str, list[float | None]] = Field(description="reward name -> one score per completion")
    weight_version: int = Field(description="the weight version that generated these completions")
    generation_seconds: float = 0.0
    reward_seconds: float = 0.0
    weight_load_seconds: float = Field(
        0.0, description="how long loading this weight version took the worker"
    )
    logged_metrics: dict[str, list[float]] = Field(
        default_factory=dict, description="what reward functions passed to TRL's log_metric, by metric name"
    )
    logged_extra: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="what reward functions passed to TRL's log_extra: column -> one value per completion",
    )
    tool_masks: list[list[int]] | None = Field(
        None,
        description="tool-calling rollouts: per completion token, 1 = the model's (trained), 0 = a tool "
        "result's (TRL's tool_mask, passed to it as env_mask); None: every token is the model's",
    )
    sample_prompt_ids: list[list[int]] | None = Field(
        None,
        description="per completion, its own prompt ids, when environments' reset() made a group's prompts "
        "differ; None: prompt_ids for all",
    )
    turns: list[int] = Field(
        default_factory=list, description="model turns per completion (tool-calling rollouts)"
    )
    tool_calls: list[int] = Field(default_factory=list, description="tool calls per completion")
    tool_failures: list[int] = Field(
        default_factory=list, description="tool calls that failed, per completion"
    )


class RolloutAnswer(BaseModel):
    results: list[RolloutResult] = Field(description="one per request of the task, in the same order")


def reward_names(rewards: list[Any]) -> list[str]:
    """Stable, unique names for a spec's reward entries, computed from the spec alone.

    Both sides derive the same names without importing user code: `name` if given, else the
    function's attribute name (after ':') or the env name; repeats get `_2`, `_3`, ...
    """
    names: list[str] = []
    for entry in rewards:
        base = getattr(entry, "name", None) or (
            entry.function.rsplit(":", 1)[-1] if getattr(entry, "function", None) else entry.env
        )
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


def extra_columns(logged: dict[str, list[Any]], n: int) -> dict[str, list[Any]]:
    """What reward functions passed to `log_extra` for a group of `n` completions, one value each.

    A column logged short is padded with None (TRL pads a column a reward did not log the same way),
    one logged long is cut to `n`; a value JSON cannot hold (a NaN, an object) becomes None or its
    str(), so the answer always travels and stores.
    """
    return {column: [_plain(v) for v in (list(values) + [None] * n)[:n]] for column, values in logged.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)
