"""The run's conditions in RL terms: WeightsInSync, RewardHealthy, CheckpointFresh, Progressing; and
MemoryFits.

Called only by `plan` (which adds them beside Ready and Suspended); tests call each function with
hand-built inputs. Each function reads what one pass observed and returns one `Condition` (status
True, False or None for Unknown); its docstring says when it is False. Pure: no I/O, no clock of its
own (`now` is passed in). Events for their transitions are made by `mortal.controller.status.diff_events`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from mortal.controller.status import Condition

WEIGHTS, REWARD, CHECKPOINT, PROGRESSING = "WeightsInSync", "RewardHealthy", "CheckpointFresh", "Progressing"
MEMORY, OUT_OF_MEMORY = "MemoryFits", "OutOfMemory"
RUN_ENDED = "RunEnded"  # the reason of a condition not evaluated once the run Succeeded or Failed
TYPES = (WEIGHTS, REWARD, CHECKPOINT, PROGRESSING, MEMORY)
OOM_RELAUNCHES = 1  # relaunches of a slot after an out-of-memory exit; the next one fails the run (see plan)
# mortal.workers.rewards' fatal reasons.
REWARD_FATAL_REASONS = ("RewardFailed", "RewardBadOutput", "RewardNotFound", "RewardTimedOut")
STD_METRIC, SCORED_METRIC, STEP_SECONDS_METRIC = "std", "scored", "step_seconds"


@dataclass(frozen=True)
class RolloutVersion:
    """One live rollout as WeightsInSync sees it."""

    name: str  # e.g. rollout-1
    version: int | None  # the weight version it last reported loading
    heartbeat_at: datetime | None


def allowed_lag(max_staleness: int, sync_every: int) -> int:
    """Versions a rollout may be behind the newest: maxStaleness steps in versions, plus one in flight (a
    rollout loads a new version between tasks, so one published while it generates is normal)."""
    return math.ceil(max_staleness / max(1, sync_every)) + 1


def weights_in_sync(
    rollouts: Sequence[RolloutVersion],
    newest: int | None,
    newest_at: datetime | None,
    max_staleness: int,
    sync_every: int,
) -> Condition:
    """False when a live rollout generates with weights more than `allowed_lag` versions behind the newest.
    A version published after a rollout's last heartbeat cannot have been reported yet, so it does not
    count against that rollout."""
    if newest is None:
        return Condition(WEIGHTS, None, "NoWeightsPublished", "the actor has not published weights yet")
    reporting = [(r, r.version) for r in rollouts if r.version is not None]
    if not reporting:
        return Condition(
            WEIGHTS,
            None,
            "NoRolloutReporting",
            f"no live rollout has reported a weight version (newest v{newest})",
        )
    allowed = allowed_lag(max_staleness, sync_every)
    lagging = []
    for r, version in reporting:
        seen = (
            newest
            if newest_at is None or r.heartbeat_at is None or newest_at <= r.heartbeat_at
            else newest - 1
        )
        if seen - version > allowed:
            lagging.append(f"{r.name} at v{version}")
    if lagging:
        return Condition(
            WEIGHTS,
            False,
            "RolloutLagging",
            f"{', '.join(lagging)}; actor at v{newest}; allowed lag {allowed} version(s)",
        )
    versions = sorted({version for _, version in reporting})
    return Condition(
        WEIGHTS,
        True,
        "WeightsCurrent",
        f"{len(reporting)} rollout(s) at v{'/v'.join(map(str, versions))}; actor at v{newest}",
    )


# Fatal worker reasons that name the run's failure itself.
RUN_FAILURE_REASONS = ("ResumeRefused", "CheckpointStorageUnavailable")


def run_failure_reason(worker_message: str | None) -> str:
    """The Failed condition's reason for a worker's fatal exit: its own reason where it says why the run
    cannot go on (a refused resume: mortal.workers.actor.resume_check; checkpoint storage it cannot use:
    mortal.workers.actor.storage), else WorkerFailed."""
    reason = (worker_message or "").split(":", 1)[0]
    return reason if reason in RUN_FAILURE_REASONS else "WorkerFailed"


def reward_failure(worker_message: str | None) -> Condition | None:
    """RewardHealthy False when a worker's fatal message says a reward function broke the run."""
    reason = (worker_message or "").split(":", 1)[0]
    if reason not in REWARD_FATAL_REASONS:
        return None
    return Condition(REWARD, False, reason, (worker_message or "").split(":", 1)[1].strip())


def reward_healthy(metrics: Mapping[int, Mapping[str, float]], stuck_steps: int) -> Condition:
    """From the newest steps' metrics ({step: {name: value}}): False when a reward returned None for every
    sample of the newest step (rewards/<name>/scored 0), or gave every sample the same value (std 0) for
    `stuck_steps` steps in a row."""
    names = sorted({name for values in metrics.values() for k in values if (name := _reward_name(k))})
    if not names:
        return Condition(REWARD, None, "NoRewardMetrics", "no step has recorded per-reward metrics yet")
    steps = sorted(metrics)
    newest = steps[-1]
    for name in names:
        if metrics[newest].get(f"rewards/{name}/{SCORED_METRIC}") == 0.0:
            return Condition(
                REWARD,
                False,
                "RewardAllNone",
                f"reward {name!r} returned None for every sample of step {newest}",
            )
    for name in names:
        run = _constant_run(metrics, steps, name)
        if len(run) >= stuck_steps:
            value = metrics[run[-1]].get(f"rewards/{name}/mean")
            same = f" ({value:g})" if value is not None else ""
            return Condition(
                REWARD,
                False,
                "RewardConstant",
                f"reward {name!r} gave every sample the same value{same} for {len(run)} steps "
                f"in a row (steps {run[0]}-{run[-1]}): no learning signal",
            )
    return Condition(REWARD, True, "RewardsVary", f"{', '.join(names)}: scores vary within step {newest}")


def _reward_name(metric: str) -> str | None:
    if not metric.startswith("rewards/"):
        return None
    name, _, kind = metric[len("rewards/") :].rpartition("/")
    return name if name and kind in (STD_METRIC, SCORED_METRIC) else None


def _constant_run(metrics: Mapping[int, Mapping[str, float]], steps: list[int], name: str) -> list[int]:
    """The newest consecutive steps (no gap) whose reward `name` had std 0, oldest first."""
    run: list[int] = []
    for step in reversed(steps):
        std = metrics[step].get(f"rewards/{name}/{STD_METRIC}")
        if std != 0.0 or (run and step != run[0] - 1):
            break
        run.insert(0, step)
    return run


def checkpoint_fresh(step: int | None, checkpoint_step: int | None, every: int, slack: int) -> Condition:
    """False when the newest complete checkpoint is more than `every` + `slack` steps old."""
    done = step or 0
    since = checkpoint_step if checkpoint_step is not None else 0
    where = f"step {checkpoint_step}" if checkpoint_step is not None else "none yet"
    message = f"newest checkpoint {where}, step {done}, every {every} step(s)"
    if done - since > every + slack:
        return Condition(CHECKPOINT, False, "CheckpointOverdue", f"{message}: {done - since} steps unsaved")
    return Condition(CHECKPOINT, True, "CheckpointRecent", message)


def step_seconds(metrics: Mapping[int, Mapping[str, float]]) -> float | None:
    """Median of the recent steps' durations (None without any)."""
    times = [v[STEP_SECONDS_METRIC] for v in metrics.values() if v.get(STEP_SECONDS_METRIC, 0) > 0]
    return statistics.median(times) if times else None


def progress_deadline(
    median_step_seconds: float | None, minimum: float, factor: float, default: float
) -> float:
    """Seconds without a step end before a run is not Progressing."""
    if median_step_seconds is None:
        return default
    return max(minimum, factor * median_step_seconds)


def generation_paused() -> Condition:
    """Progressing while rollout.replicas is 0: the actor waits for generation by the user's choice."""
    return Condition(
        PROGRESSING, None, "GenerationPaused", "rollout.replicas is 0: the actor waits for generation"
    )


def progressing(
    suspended: bool, last_step_time: datetime | None, deadline: float, now: datetime
) -> Condition:
    """False when no step ended within `deadline` seconds (`progress_deadline`); Unknown while suspended."""
    if suspended:
        return Condition(PROGRESSING, None, "Suspended", "not evaluated while suspended")
    if last_step_time is None:
        return Condition(
            PROGRESSING, None, "AwaitingFirstStep", "no step has ended since the workers started"
        )
    quiet = (now - last_step_time).total_seconds()
    if quiet > deadline:
        return Condition(
            PROGRESSING,
            False,
            "ProgressDeadlineExceeded",
            f"no step has ended for {quiet:.0f}s (deadline {deadline:.0f}s)",
        )
    return Condition(
        PROGRESSING, True, "StepsAdvancing", f"last step ended {quiet:.0f}s ago (deadline {deadline:.0f}s)"
    )


@dataclass(frozen=True)
class OomExit:
    """A slot whose newest ended worker ran out of GPU memory."""

    name: str  # e.g. rollout-0
    role: str  # actor | rollout
    replica: int
    incarnation: int
    details: str  # the worker's own words: what it tried to allocate, the GPU's figures
    count: int  # out-of-memory exits of this slot at its setting now (1: it gets its one relaunch)
    healed: str | None = None  # answered with a smaller setting that keeps the step (controller.heal)


@dataclass(frozen=True)
class MemoryKnobs:
    """The spec's memory settings already chosen, so the advice names only what is left to change."""

    colocate: bool = False
    lora: bool = False
    gradient_checkpointing: bool = False
    micro_batch_size: int = 0  # completions per forward/backward pass now; 0: not known
    rollout_share: float | None = None  # rollout.gpuMemoryUtilization, None: not set
    actor_ranks: int = 1  # actor.count: > 1 is sharded over that many GPUs (no LoRA there)
    cpu_offload: bool = False  # actor.cpuOffload
    reshard_after_forward: bool = True  # actor.reshardAfterForward false holds the whole model through a step
    replicated: bool = False  # actor.strategy ddp: every rank holds the whole model


def memory_advice(role: str, knobs: MemoryKnobs) -> str:
    """What to change in the spec so that a worker of `role` fits its GPU, most direct first."""
    if role == "rollout":
        tips = [
            "lower generation.maxNumSeqs (sequences decoded at once) or rollout.promptsPerTask",
            "lower generation.maxTokens (the KV cache grows with it)",
        ]
        if knobs.colocate and knobs.rollout_share is None:
            tips.append(
                "set rollout.gpuMemoryUtilization (e.g. 0.3): the rollout then decodes only the rows "
                "that fit in that share of the GPU, beside the actor"
            )
        elif knobs.rollout_share is not None:
            tips.append(
                f"raise rollout.gpuMemoryUtilization (now {knobs.rollout_share}), the share of the "
                "GPU the rollout may hold"
            )
        if knobs.colocate:
            tips.append(
                "give the rollouts GPUs of their own (rollout.colocate: false, no colocatedReplicas; "
                "the actor's weights, gradients and optimizer state share this GPU now)"
            )
        tips.append("or pick a GPU with more memory (rollout.gpu)")
    else:
        tips = []
        if knobs.actor_ranks > 1 and not knobs.reshard_after_forward:
            tips.append(
                "set actor.reshardAfterForward: true (now false: every GPU holds the whole model, "
                "gathered, from the forward to the backward)"
            )
        if knobs.micro_batch_size != 1:
            now = f" (now {knobs.micro_batch_size})" if knobs.micro_batch_size else ""
            tips.append(
                f"lower algorithm.microBatchSize{now}: the step's batch trained in smaller passes, "
                "gradients accumulated, the same step"
            )
        tips.append("lower algorithm.batchSize (completions per optimizer step)")
        if not knobs.gradient_checkpointing:
            tips.append("set model.gradientCheckpointing: true (recompute activations in backward)")
        if knobs.actor_ranks > 1 and knobs.replicated:
            tips.append(
                "shard the actor's weights, gradients and AdamW state over its ranks "
                "(actor.strategy: fsdp; now ddp: each rank holds the whole model)"
            )
        elif knobs.actor_ranks > 1 and not knobs.cpu_offload:
            tips.append(
                f"shard the actor over more GPUs (actor.count, now {knobs.actor_ranks}), or keep its "
                "shards in host memory (actor.cpuOffload: true)"
            )
        elif knobs.actor_ranks == 1 and not knobs.lora:
            tips.append(
                "train a LoRA adapter (model.lora: {r: 16}) instead of every weight: no full "
                "gradients or AdamW state"
            )
            tips.append(
                "shard the actor's weights, gradients and AdamW state over several GPUs (actor.count: 2)"
            )
        if knobs.colocate:
            share = (
                f"lower rollout.gpuMemoryUtilization (now {knobs.rollout_share})"
                if knobs.rollout_share
                else "set rollout.gpuMemoryUtilization (e.g. 0.3)"
            )
            tips.append(f"{share}: the colocated rollouts' share of this GPU")
            tips.append("give the rollouts GPUs of their own (rollout.colocate: false, no colocatedReplicas)")
        tips.append("or pick a GPU with more memory (actor.gpu)")
    return "; ".join(tips)


def memory_fits(exits: Sequence[OomExit], knobs: MemoryKnobs) -> Condition:
    """False when a slot's newest ended worker ran out of GPU memory, naming it, its figures and the fix."""
    if not exits:
        return Condition(MEMORY, True, "NoOutOfMemory", "no worker has run out of GPU memory")
    lines = []
    for e in exits:
        if e.healed:
            verdict = f"relaunched with a smaller setting: {e.healed}"
        elif e.count > OOM_RELAUNCHES:
            verdict = f"{e.count} times with this spec, so it will not fit as it is"
        else:
            verdict = (
                "relaunched once, as a transient (a neighbour's peak, a predecessor not yet gone); "
                "a second out-of-memory fails the run"
            )
        lines.append(
            f"{e.name} #{e.incarnation} ran out of GPU memory: {e.details}; {verdict}. "
            f"To fit: {memory_advice(e.role, knobs)}"
        )
    return Condition(MEMORY, False, OUT_OF_MEMORY, " | ".join(lines))
