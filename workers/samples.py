"""A step's completions as people read them: the bounded sample the store keeps of each step.

Called by the actor once per optimizer step, after TRL computed the step's advantages, with the
step's StepBatch (mortal.workers.feed); what it returns goes to the store and to W&B through
mortal.workers.metrics.MetricsReporter. It keeps the first `limit` completions of the batch, which
is in prompt order with each prompt's generations together, so whole groups are kept and an
advantage can be read against its group's other completions.
Pure: no I/O, no TRL; it must not decide how many to keep (spec.logging.completionsPerStep does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mortal.state.store import NewCompletion
from mortal.workers.feed import StepBatch


def as_text(value: Any) -> str:
    """A prompt or completion as text: a string as is; chat messages as their content when there is
    one message, else as 'role: content' blocks separated by a blank line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        if len(value) == 1:
            return str(value[0].get("content", ""))
        return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in value)
    return str(value)


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
        out.append(NewCompletion(
            sample=i,
            prompt=as_text(batch.prompts[i]),
            completion=as_text(batch.completions[i]),
            rewards=scores,
            reward=total_reward(scores, weights),
            advantage=_finite(advantages[i]) if advantages is not None else None,
            weight_version=batch.weight_versions[i],
            extra=dict(batch.extra[i]) if i < len(batch.extra) else {},
        ))
    return out
