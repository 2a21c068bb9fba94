"""`spec.deadlines`: how long each thing a run's workers may block on may take before it is healed.

    deadlines: {taskSeconds: 10m, stepSeconds: 30m, weightLoadSeconds: 5m, collectiveSeconds: 5m}

Read by the controller's planner (mortal.controller.deadlines turns them, and the run's own step times,
into the deadline of each activity a worker reports in its heartbeat) and by the workers (collectives
pass `collectiveSeconds` to torch.distributed). Reward and tool calls have their deadlines beside them:
`rewards[].timeoutSeconds`, `rollout.toolTimeoutSeconds`. docs/deadlines.md says what happens past each.
Pure: no I/O, nothing of mortal outside mortal.specs.
"""

from __future__ import annotations

from pydantic import Field

from mortal.specs.base import SpecModel
from mortal.specs.limits import Duration


class DeadlinesSpec(SpecModel):
    """Past a deadline the worker's stacks go to its log, a Warning event names it, and it is relaunched
    (its task given to another rollout, the actor resumed from its checkpoint)."""

    task_seconds: Duration | None = Field(
        None,
        description="Longest a rollout may work on one task (generate and score): 90s, 10m, or seconds. "
        "Absent: the progress deadline (10 x the run's median step time, at least 60 s; 30 minutes before "
        "the first step), and never less than the task's reward timeouts added up.",
    )
    step_seconds: Duration | None = Field(
        None,
        description="Longest the actor may spend in one optimizer step (waiting for rollouts included): 90s, "
        "10m, or seconds. Absent: derived from the run's own step times as taskSeconds is, and at least "
        "twice the task deadline.",
    )
    weight_load_seconds: Duration | None = Field(
        None,
        description="Longest a rollout may take to load one weight version: 90s, 10m, or seconds. Absent: "
        "10m.",
    )
    collective_seconds: Duration | None = Field(
        None,
        description="Longest one torch.distributed collective may wait for its peer before the worker fails "
        "and is relaunched: 90s, 10m, or seconds. Absent: 5m for a weight transfer (sync nccl), torch's own "
        "default among a sharded actor's ranks.",
    )

    def weight_load(self) -> float:
        """Seconds a weight load may take (the default when unset)."""
        return (
            self.weight_load_seconds if self.weight_load_seconds is not None else DEFAULT_WEIGHT_LOAD_SECONDS
        )

    def collective(self) -> float:
        """Seconds a collective may wait (the default when unset)."""
        return self.collective_seconds if self.collective_seconds is not None else DEFAULT_COLLECTIVE_SECONDS


DEFAULT_COLLECTIVE_SECONDS = 300.0
DEFAULT_WEIGHT_LOAD_SECONDS = 600.0
DEFAULT_REWARD_TIMEOUT_SECONDS = 300.0
DEFAULT_RESET_TIMEOUT_SECONDS = 300.0  # environmentService.resetTimeoutSeconds: an instance's reset(**row)
# Steps in a row in which no reward call returned (each timed out) before the run fails: nothing trains.
REWARD_SILENT_STEPS = 3
