"""Memory settings the controller chose for a run, beside the user's spec: the worker's view of them.

Who uses it: the controller's planner (mortal.controller.heal) records what it chose in status.effective
(mortal.specs.status.EffectiveMemory) and the reconciler hands it to a launched worker as MORTAL_* variables
(`environ`); the worker (mortal.workers.runtime) reads its spec through `applied`. Only settings that keep
the training step the same are chosen so: the actor's microBatchSize (the step's batch in more passes,
gradients accumulated) and the colocated rollouts' share of the GPU (rollout.gpuMemoryUtilization). The
user's spec is never rewritten: `mortalctl get -o yaml` shows what they applied, status.effective what runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from mortal.specs.run import TrainingRun
from mortal.specs.status import EffectiveMemory

MICRO_BATCH_ENV = "MORTAL_MICRO_BATCH_SIZE"  # the actor's algorithm.microBatchSize for this incarnation
ROLLOUT_SHARE_ENV = "MORTAL_ROLLOUT_SHARE"  # the rollout's rollout.gpuMemoryUtilization for this incarnation


class BadMemorySetting(ValueError):
    """A MORTAL_* memory variable that does not fit the run's spec (not an int, a divisor, in range)."""


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
