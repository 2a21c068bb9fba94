"""A step's completions as people read them: the bounded sample the store keeps of each step.

Called by the actor once per optimizer step, after TRL computed the step's advantages, with the
step's StepBatch (mortal.workers.actor.feed); what it returns goes to the store and to W&B through
mortal.workers.actor.metrics.MetricsReporter. It keeps the first `limit` completions of the batch, which
is in prompt order with each prompt's generations together, so whole groups are kept and an
advantage can be read against its group's other completions.
Pure: no I/O, no TRL; it must not decide how many to keep (spec.logging.completionsPerStep does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mortal.state.store import NewCompletion
from mortal.workers.actor.feed import StepBatch


def as_text(value: Any) -> str:
    """A prompt or completion as text: a string as is; chat messages as their content when there is
    one message without tool calls, else as 'role: content' blocks separated by a blank line, each
    tool call written as `-> name(arguments)` (the turns of a tool-calling rollout)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        if len(value) == 1 and not value[0].get("tool_calls"):
            return str(value[0].get("content", ""))
        return "\n\n".join(_message_text(m) for m in value)
    return str(value)


def _message_text(message: dict[str, Any]) -> str:
    role = message.get("role", "?")
    if role == "tool":
        role = f"tool {message.get('name', '')}".rstrip()
    lines = [f"{role}: {message.get('content') or ''}".rstrip()]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        args = (
            ", ".join(f"{k}={v!r}" for k, v in arguments.items())
            if isinstance(arguments, dict)
            else arguments
        )
        lines.append(f"  -> {function.get('name')}({args})")
    return "\n".join(lines)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def total_reward(scores: Mapping[str, float | None], weights: Mapping[str, float]) -> float | None:
    """The weighted sum TRL trains on: unscored rewards add nothing; None when no reward scored it."""
    scored = [(name, v) for name, v in scores.items() if _finite(v) is not None]
    if not scored:
        return None
    return sum(weights.get(name, 1.0) * v for name, v in scored)


def step_completions(
    batch: StepBatch, advantages: Sequence[float] | None, weights: Mapping[str, float], limit: int
) -> list[NewCompletion]:
    """The first `limit` completions of the step; `advantages` (one per completion, else ignored) as TRL
    computed them, `weights` the reward weights by name."""
    if advantages is not None and len(advantages) != len(batch.completion_ids):
        advantages = None
    out = []
    for i in range(min(limit, len(batch.completion_ids))):
        scores = {name: _finite(v) for name, v in batch.rewards[i].items()}
        out.append(
            NewCompletion(
                sample=i,
                prompt=as_text(batch.prompts[i]),
                completion=as_text(batch.completions[i]),
                rewards=scores,
                reward=total_reward(scores, weights),
                advantage=_finite(advantages[i]) if advantages is not None else None,
                weight_version=batch.weight_versions[i],
                extra=(dict(batch.extra[i]) if i < len(batch.extra) else {}) | _tool_columns(batch, i),
            )
        )
    return out


def _tool_columns(batch: StepBatch, i: int) -> dict[str, Any]:
    """A tool-calling completion's turns, tool calls and failed calls (empty for single-turn runs)."""
    if i >= len(batch.turns):
        return {}
    return {
        "turns": batch.turns[i],
        "tool_calls": batch.tool_calls[i],
        "tool_failures": batch.tool_failures[i],
    }
