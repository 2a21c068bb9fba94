"""Memory settings the controller chose for a run, beside the user's spec: the status block and the
worker's view.

Who uses it: the controller's planner (mortal.controller.heal) records what it chose in status.effective
(`EffectiveMemory`) and the reconciler hands it to a launched worker as MORTAL_* variables (`environ`);
the worker (mortal.workers.runtime) reads its spec through `applied`. Only settings that keep the training
step the same are chosen so: the actor's microBatchSize (the step's batch in more passes, gradients
accumulated) and the colocated rollouts' share of the GPU (rollout.gpuMemoryUtilization). The user's spec
is never rewritten: `mortalctl get -o yaml` shows what they applied, status.effective what runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pydantic import Field

from mortal.specs.base import SpecModel

if TYPE_CHECKING:  # run.py imports status.py, which imports this module
    from mortal.specs.run import TrainingRun

MICRO_BATCH_ENV = "MORTAL_MICRO_BATCH_SIZE"  # the actor's algorithm.microBatchSize for this incarnation
ROLLOUT_SHARE_ENV = "MORTAL_ROLLOUT_SHARE"  # the rollout's rollout.gpuMemoryUtilization for this incarnation


class BadMemorySetting(ValueError):
    """A MORTAL_* memory variable that does not fit the run's spec (not an int, a divisor, in range)."""


class EffectiveMemory(SpecModel):
    """What runs instead of the spec's value, and why (status.effective)."""

    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="The actor's completions per forward/backward pass now, when the controller "
        "lowered algorithm.microBatchSize (the same step: gradients accumulated over more passes).",
    )
    rollout_gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="The rollouts' share of the GPU now, when the controller lowered "
        "rollout.gpuMemoryUtilization after a rollout ran out of GPU memory.",
    )
    spec_micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="The spec's micro batch (batchSize when unset) the choice was made from; a "
        "spec with another one drops the choice (the user decided).",
    )
    spec_rollout_gpu_memory_utilization: float | None = Field(
        None, description="The spec's rollout.gpuMemoryUtilization the share was lowered from."
    )
    reduced_after: dict[str, int] = Field(
        default_factory=dict,
        description="Per slot (actor-0, rollout-1), the incarnation whose "
        "out-of-memory exit the newest reduction answered: a later one is a new out-of-memory at the lowered "
        "setting.",
    )
    reason: str | None = Field(None, description="Why: the newest reduction, as its event said it.")


def environ(effective: EffectiveMemory | None, role: str) -> dict[str, str]:
    """The variables a launched worker of `role` gets: only what differs from its spec."""
    if effective is None:
        return {}
    if role == "actor" and effective.micro_batch_size is not None:
        return {MICRO_BATCH_ENV: str(effective.micro_batch_size)}
    if role == "rollout" and effective.rollout_gpu_memory_utilization is not None:
        return {ROLLOUT_SHARE_ENV: repr(effective.rollout_gpu_memory_utilization)}
    return {}


def applied(run: TrainingRun, env: Mapping[str, str]) -> TrainingRun:
    """`run` with the controller's memory choices of `env` in its spec; as it is without them.

    The value comes from the environment the controller wrote, yet it is checked as the spec's own field
    is (a divisor of batchSize, divisible over the actor's ranks; a share in (0, 1)): BadMemorySetting names
    the variable otherwise, rather than a trainer that splits its batch wrongly."""
    spec = run.spec
    micro, share = env.get(MICRO_BATCH_ENV), env.get(ROLLOUT_SHARE_ENV)
    if micro is not None:
        try:
            size = int(micro)
        except ValueError:
            raise BadMemorySetting(f"{MICRO_BATCH_ENV}={micro!r} is not an integer") from None
        batch, ranks = spec.algorithm.batch_size, spec.actor.count
        if size < 1 or batch % size or size % ranks:
            raise BadMemorySetting(
                f"{MICRO_BATCH_ENV}={size} must divide algorithm.batchSize ({batch}) and "
                f"be a multiple of actor.count ({ranks})"
            )
        spec = spec.model_copy(
            update={"algorithm": spec.algorithm.model_copy(update={"micro_batch_size": size})}
        )
    if share is not None:
        try:
            fraction = float(share)
        except ValueError:
            raise BadMemorySetting(f"{ROLLOUT_SHARE_ENV}={share!r} is not a number") from None
        if not 0 < fraction < 1:
            raise BadMemorySetting(f"{ROLLOUT_SHARE_ENV}={fraction} must be in (0, 1)")
        rollout = spec.rollout.model_copy(update={"gpu_memory_utilization": fraction})
        spec = spec.model_copy(update={"rollout": rollout})
    return run if spec is run.spec else run.model_copy(update={"spec": spec})
