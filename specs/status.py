"""`status:` of a TrainingRun: what the controller and workers observed. Users never write it.

`Phase` is the run's lifecycle; `Phase.TRANSITIONS` lists every legal move, so the store can guard
each status write (SkyPilot style: an UPDATE allowed only from the listed prior phases). `RunStatus`
is the block stored in the runs table (camelCase, `RunStatus.model_dump(by_alias=True, mode="json")`).
Written only by the controller through the store; this module holds no logic that decides phases.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import Field, field_validator

from mortal.specs.base import SpecModel


class Phase(StrEnum):
    """Lifecycle of a run. Succeeded and Failed are terminal: a finished run is never restarted."""

    PENDING = "Pending"
    """Accepted by the store; no worker launched yet."""
    STARTING = "Starting"
    """Workers are being launched (or resumed from a checkpoint); no step finished yet."""
    RUNNING = "Running"
    """The actor is training; steps advance."""
    RECOVERING = "Recovering"
    """A worker was lost; it is being relaunched and the actor resumes from the latest checkpoint."""
    SUSPENDED = "Suspended"
    """spec.suspend is true: no workers run; checkpoints and state are kept."""
    SUCCEEDED = "Succeeded"
    """maxSteps reached and the final checkpoint written."""
    FAILED = "Failed"
    """Gave up: restarts exhausted, or an error that retrying cannot fix (e.g. the model cannot load)."""

    def is_terminal(self) -> bool:
        """True for Succeeded and Failed: no further transition, no workers."""
        return not TRANSITIONS[self]

    def allowed_next(self) -> frozenset[Phase]:
        """The phases a run in this phase may move to (staying in the same phase is always allowed)."""
        return TRANSITIONS[self]

    def can_become(self, other: Phase | str) -> bool:
        """Whether a status write from this phase to `other` is legal (a same-phase write always is)."""
        other = Phase(other)
        return other == self or other in TRANSITIONS[self]


P = Phase
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    P.PENDING: frozenset({P.STARTING, P.SUSPENDED, P.FAILED}),
    P.STARTING: frozenset({P.RUNNING, P.RECOVERING, P.SUSPENDED, P.SUCCEEDED, P.FAILED}),
    P.RUNNING: frozenset({P.RECOVERING, P.SUSPENDED, P.SUCCEEDED, P.FAILED}),
    P.RECOVERING: frozenset({P.STARTING, P.RUNNING, P.SUSPENDED, P.SUCCEEDED, P.FAILED}),
    P.SUSPENDED: frozenset({P.PENDING, P.STARTING, P.FAILED}),
    P.SUCCEEDED: frozenset(),
    P.FAILED: frozenset(),
}
"""phase -> phases it may move to. Resume goes Suspended -> Starting (or Pending when nothing ran)."""
TERMINAL_PHASES: frozenset[str] = frozenset(p.value for p in Phase if p.is_terminal())
"""The phases of a finished run (Succeeded, Failed), as the store's phase column holds them."""


class Condition(SpecModel):
    """One aspect of a run's health, Kubernetes style (e.g. type WorkersReady, status "False")."""

    type: str = Field(min_length=1, description="CamelCase aspect, e.g. Progressing, WorkersReady, Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field("", description="CamelCase machine-readable cause of the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: datetime | None = Field(None, description="When status last changed.")

    @field_validator("status", mode="before")
    @classmethod
    def _yaml_booleans_are_condition_strings(cls, value: object) -> object:
        """An unquoted YAML `status: True` arrives as a bool; Kubernetes' condition status is a string."""
        return str(value) if isinstance(value, bool) else value


class CheckpointRef(SpecModel):
    """The newest complete checkpoint."""

    step: int = Field(ge=0, description="Optimizer step the checkpoint was taken after.")
    path: str = Field(description="Where its files lie (on the shared volume).")
    time: datetime | None = Field(None, description="When it was committed.")


class ReplicaCount(SpecModel):
    """Workers of one role: how many are ready (heartbeating) and how many the spec wants."""

    ready: int = Field(0, ge=0, description="Workers whose heartbeat is fresh.")
    desired: int = Field(0, ge=0, description="Workers the spec asks for.")


class ReplicaStatus(SpecModel):
    """Ready/desired per role."""

    actor: ReplicaCount = Field(default_factory=ReplicaCount, description="The trainer.")
    rollout: ReplicaCount = Field(default_factory=ReplicaCount, description="The generation workers.")


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


class RunStatus(SpecModel):
    """Observed state of a run, rebuilt by the controller from the store and the backend each pass."""

    phase: Phase = Field(Phase.PENDING, description="Lifecycle phase.")
    observed_generation: int = Field(0, ge=0, description="metadata.generation the controller last acted on.")
    step: int = Field(0, ge=0, description="Optimizer steps completed.")
    weight_version: int = Field(0, ge=0, description="Newest weight version published by the actor.")
    last_checkpoint: CheckpointRef | None = Field(None, description="Newest complete checkpoint.")
    replicas: ReplicaStatus = Field(
        default_factory=ReplicaStatus, description="Ready/desired workers per role."
    )
    restarts: int = Field(0, ge=0, description="Worker relaunches so far (counted against maxRestarts).")
    reward: float | None = Field(None, description="Mean total reward of the latest step.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Health aspects: Ready, Suspended, MemoryFits (False: a worker ran out of GPU memory; "
        "the message says what to change), and in RL terms WeightsInSync, RewardHealthy, CheckpointFresh, "
        "Progressing (True, False, or Unknown when not evaluated).",
    )
    last_step_time: datetime | None = Field(None, description="When the controller saw the latest step end.")
    step_seconds: float | None = Field(
        None, ge=0, description="Median duration of the recent steps, in seconds."
    )
    start_time: datetime | None = Field(None, description="When the first worker started.")
    active_seconds: float | None = Field(
        None,
        ge=0,
        description="Active time (every phase but Suspended) before activeSince, in seconds. The "
        "time counted against spec.limits.maxDuration is this plus the time since activeSince "
        "(`active_time`).",
    )
    active_since: datetime | None = Field(
        None,
        description="When the current active period began (start, or resume); absent while Suspended "
        "or finished.",
    )
    gpu_hours: float | None = Field(
        None,
        ge=0,
        description="GPU-hours the run's workers used so far (each worker's wall time x the GPUs it holds, "
        "from the workers table), to 0.01; counted against spec.limits.maxGPUHours. 0 for a CPU run.",
    )
    effective: EffectiveMemory | None = Field(
        None,
        description="Memory settings the controller chose instead of the spec's after an out-of-memory "
        "(a smaller actor microBatchSize, a smaller rollout share): the same training step; absent when "
        "none.",
    )
    completion_time: datetime | None = Field(None, description="When the run reached a terminal phase.")
    message: str | None = Field(None, description="Human-readable summary of the latest transition.")

    @field_validator("observed_generation", "step", "weight_version", "restarts", mode="before")
    @classmethod
    def _null_counter_is_zero(cls, value: object) -> object:
        """A counter the controller has not seen yet may be written as null; it means none so far."""
        return 0 if value is None else value

    def active_time(self, now: datetime) -> float:
        """Seconds the run has been active (not Suspended) up to `now`: what limits.maxDuration counts."""
        since = self.active_since
        return (self.active_seconds or 0.0) + (max(0.0, (now - since).total_seconds()) if since else 0.0)

    def condition(self, type_: str) -> Condition | None:
        """The condition of this type, if set."""
        return next((c for c in self.conditions if c.type == type_), None)
