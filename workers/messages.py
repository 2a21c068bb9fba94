"""What travels through the task queue between the actor and rollout workers.

The actor enqueues one `RolloutRequest` per prompt (as a task payload); a rollout worker answers it
with one `RolloutResult` (as the task result): `num_generations` completions, their sampling
logprobs and every reward function's score. Both sides import only this module to agree.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class RolloutRequest(BaseModel):
    prompt: str | list[dict[str, Any]] = Field(description="the dataset's prompt: text or chat messages")
    row: dict[str, Any] = Field(default_factory=dict, description="every dataset column, passed to rewards")
    num_generations: int
    seed: int = Field(description="sampling seed: same weights + same seed -> same tokens (on CPU)")


class RolloutResult(BaseModel):
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] = Field(description="per-token sampling logprobs, one list per completion")
    completions: list[Any] = Field(description="decoded text, or [{'role': 'assistant', 'content': ...}]")
    rewards: dict[str, list[float | None]] = Field(description="reward name -> one score per completion")
    weight_version: int = Field(description="the weight version that generated these completions")
    generation_seconds: float = 0.0
    reward_seconds: float = 0.0
    logged_metrics: dict[str, list[float]] = Field(
        default_factory=dict, description="what reward functions passed to TRL's log_metric, by metric name")


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
