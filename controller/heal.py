"""Heal an out-of-memory with a setting that keeps the training step the same, before failing the run.

Who calls it: mortal.controller.plan, purely (no I/O), once per pass. An actor out of GPU memory is
relaunched with the next smaller algorithm.microBatchSize (more passes, gradients accumulated: the same
optimizer step); a rollout with half its rollout.gpuMemoryUtilization, down to MIN_ROLLOUT_SHARE. Only
when neither is left does the planner's out-of-memory rule fail the run. What would change the step
(batchSize, LoRA, more GPUs) is never chosen here: the advice leaves it to the user.
The choice lives in status.effective and reaches a launched worker as a MORTAL_* variable, so the spec
stays as applied. Idempotent: a reduction answers one out-of-memory exit (`reduced_after`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mortal.controller.observed import Desired
from mortal.specs.status import EffectiveMemory

# TRL's loss types whose step depends on how the batch is split: bnpo divides each pass's loss by that
# pass's own tokens (the others divide so that the passes add up to the whole batch's step). A smaller
# micro batch would change such a run's training: the user's call, not ours.
SPLIT_DEPENDENT_LOSSES = frozenset({"bnpo"})
FITTED_ANNOTATION = "mortal.dev/fitted-micro-batch"  # mortalctl apply's choice before launch (controller.fit)
MIN_ROLLOUT_SHARE = 0.05  # halving stops here; below it the budget's own refusal is the likely end


@dataclass(frozen=True)
class Reduction:
    """One setting lowered after slot `slot`'s out-of-memory exit of incarnation `incarnation`."""

    effective: EffectiveMemory
    reason: str  # MicroBatchReduced | RolloutShareReduced
    message: str  # the event's words


def carried(previous: dict | None, desired: Desired) -> EffectiveMemory | None:
    """Last pass's choices, less any the spec has since overridden (the user changed that field)."""
    if not previous:
        return None
    effective = EffectiveMemory.model_validate(previous)
    changes: dict = {}
    if effective.spec_micro_batch_size not in (None, desired.micro_batch_size):
        changes |= {"micro_batch_size": None, "spec_micro_batch_size": None}
    if effective.spec_rollout_gpu_memory_utilization not in (None, desired.rollout_share):
        changes |= {"rollout_gpu_memory_utilization": None, "spec_rollout_gpu_memory_utilization": None}
    return effective.model_copy(update=changes) if changes else effective


def fitted_before_launch(effective: EffectiveMemory | None, desired: Desired) -> Reduction | None:
    """The micro batch `mortalctl apply` estimated to fit the actor's GPU (desired.fitted_micro_batch, from
    FITTED_ANNOTATION) when the controller has chosen none yet; None when there is none or it is no
    smaller."""
    fitted, now = desired.fitted_micro_batch, desired.micro_batch_size
    if (
        fitted is None
        or (effective is not None and effective.micro_batch_size is not None)
        or desired.loss_type in SPLIT_DEPENDENT_LOSSES
    ):
        return None
    if not 0 < fitted < now or desired.batch_size % fitted or fitted % desired.actor_ranks:
        return None  # an annotation that no longer fits the spec (edited by hand, a spec applied without it)
    message = (
        f"actor micro batch {now} -> {fitted} before launch: mortalctl apply's estimate of {now} "
        f"completions a pass did not fit the actor's GPU ({desired.batch_size // fitted} passes a "
        "step, gradients accumulated: the same step)"
    )
    chosen = (effective or EffectiveMemory()).model_copy(
        update={"micro_batch_size": fitted, "spec_micro_batch_size": now, "reason": message}
    )
    return Reduction(chosen, "MicroBatchReduced", message)


def micro_batch(effective: EffectiveMemory | None, desired: Desired) -> int:
    """The actor's micro batch now: the controller's choice, else the spec's (batchSize when unset)."""
    return (
        effective.micro_batch_size if effective and effective.micro_batch_size else desired.micro_batch_size
    )


def rollout_share(effective: EffectiveMemory | None, desired: Desired) -> float | None:
    if effective and effective.rollout_gpu_memory_utilization:
        return effective.rollout_gpu_memory_utilization
    return desired.rollout_share


def smaller_micro_batch(current: int, batch_size: int, ranks: int) -> int | None:
    """The largest micro batch at most half of `current` that divides the batch and splits over the ranks.
    Half, not the next divisor down: each relaunch costs a model load, so the search takes log2 steps."""
    if batch_size < 1:  # not known (a hand-built Desired): nothing to divide
        return None
    for size in range(current // 2, 0, -1):
        if batch_size % size == 0 and size % ranks == 0:
            return size
    return None


def smaller_share(share: float) -> float | None:
    half = round(share / 2, 4)
    return half if half >= MIN_ROLLOUT_SHARE else None


def reduce_after(
    effective: EffectiveMemory | None, desired: Desired, role: str, slot: str, incarnation: int
) -> Reduction | None:
    """The next setting for slot `slot` (actor-0, rollout-1) after its out-of-memory exit of `incarnation`;
    None when that exit was answered already, or nothing that keeps the step is left to lower."""
    base = effective or EffectiveMemory()
    if base.reduced_after.get(slot, 0) >= incarnation:
        return None
    answered = {**base.reduced_after, slot: incarnation}
    if role == "actor":
        if desired.loss_type in SPLIT_DEPENDENT_LOSSES:
            return None
        now = micro_batch(effective, desired)
        lower = smaller_micro_batch(now, desired.batch_size, desired.actor_ranks)
        if lower is None:
            return None
        message = (
            f"actor micro batch {now} -> {lower} after CUDA out of memory (algorithm.microBatchSize; "
            f"{desired.batch_size // lower} passes a step, gradients accumulated: the same step)"
        )
        chosen = base.model_copy(
            update={
                "micro_batch_size": lower,
                "spec_micro_batch_size": desired.micro_batch_size,
                "reduced_after": answered,
                "reason": message,
            }
        )
        return Reduction(chosen, "MicroBatchReduced", message)
    share = rollout_share(effective, desired)
    lower_share = smaller_share(share) if share is not None else None
    if lower_share is None:
        return None
    message = (
        f"{slot} GPU share {share} -> {lower_share} after CUDA out of memory "
        "(rollout.gpuMemoryUtilization: fewer rows decoded at once, the same step)"
    )
    chosen = base.model_copy(
        update={
            "rollout_gpu_memory_utilization": lower_share,
            "spec_rollout_gpu_memory_utilization": desired.rollout_share,
            "reduced_after": answered,
            "reason": message,
        }
    )
    return Reduction(chosen, "RolloutShareReduced", message)
