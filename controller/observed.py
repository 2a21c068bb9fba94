"""The planner's inputs: what the spec asks for (`Desired`), what the world shows (`Observed`), the timings.

`reconciler` builds these from the store and the backend listing; `plan` reads them; tests build them
by hand. Also here: `judge`, the pure verdict on one live worker row (healthy, adoptable, or gone),
because it is the part of observation that needs the clock. No I/O, no store, no backend.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, overload

from mortal.controller.deadlines import Deadlines
from mortal.state.store import WorkerRef
from mortal.state.tables import CheckpointRow, WorkerRow

LIVE_STATES = frozenset({"Pending", "Running"})
FAILED_STATES = frozenset({"Lost", "Failed"})
EXIT_SUCCEEDED = 0
EXIT_FATAL = 3  # the worker protocol's fatal exit (mortal.workers.runtime): the run cannot succeed
EXIT_OUT_OF_MEMORY = 4  # the worker ran out of GPU memory (mortal.workers.oom): relaunched at most once
EXIT_RETRYABLE = 75  # the worker reported an error it may not meet again (mortal.workers.runtime): relaunched


class ProcessView(Protocol):
    """The backend's view of one process (mortal.controller.backends.base.BackendWorker has this shape)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def handle(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    @property
    def exit_code(self) -> int | None: ...


class LiveRow(Protocol):
    """What `judge` reads of a live worker row (mortal.state.tables.WorkerRow, or plan's view of one)."""

    @property
    def started_at(self) -> datetime: ...
    @property
    def handle(self) -> str | None: ...
    @property
    def heartbeat_at(self) -> datetime | None: ...
    @property
    def lease_seconds(self) -> float: ...
    @property
    def message(self) -> str | None: ...
    @property
    def activity(self) -> str | None: ...


@dataclass(frozen=True)
class Desired:
    """The parts of a run's spec (and deletion request) the controller acts on."""

    name: str
    uid: str | None = None  # the run's uid: processes of an earlier run of this name carry another
    generation: int = 1
    backend: str = "local"
    rollout_replicas: int = 1
    suspend: bool = False
    max_steps: int = 100
    max_restarts: int = 10
    backoff_seconds: float = 5.0
    same_failure_limit: int = 3  # restartPolicy.sameFailureLimit (0: off)
    max_staleness: int = 0
    sync_every: int = 1
    checkpoint_every: int = 10
    colocate: bool = False  # rollout.colocate: the rollouts share the actor's GPU
    lora: bool = False  # model.lora is set
    gradient_checkpointing: bool = False  # model.gradientCheckpointing
    micro_batch_size: int = 0  # completions per forward/backward pass of the actor (algorithm.microBatchSize)
    batch_size: int = 0  # algorithm.batchSize: a smaller micro batch must divide it (mortal.controller.heal)
    fitted_micro_batch: int | None = None  # mortalctl apply's estimate of the micro batch that fits (heal)
    loss_type: str = "dapo"  # algorithm.lossType: whether a smaller micro batch keeps the step (heal)
    rollout_share: float | None = None  # rollout.gpuMemoryUtilization as the user set it (None: not set)
    actor_ranks: int = 1  # actor.count
    cpu_offload: bool = False  # actor.cpuOffload
    reshard_after_forward: bool = True  # actor.reshardAfterForward
    replicated: bool = False  # actor.strategy ddp
    deleted: bool = False
    purge: bool = False
    max_duration: float | None = None  # spec.limits.maxDuration, seconds of active time
    max_gpu_hours: float | None = None  # spec.limits.maxGPUHours
    deadlines: Deadlines = Deadlines()  # spec.deadlines and the rewards' timeouts


@dataclass(frozen=True)
class Observed:
    """Everything one pass saw, the backend's listing read first (an exit it saw was reported before)."""

    workers: Sequence[WorkerRow]
    processes: Sequence[ProcessView] = ()
    status: Mapping[str, Any] = field(default_factory=dict)
    checkpoint: CheckpointRow | None = None
    weight_version: int | None = None
    weights_at: datetime | None = None  # when the newest weight version was published
    reward: float | None = None
    metrics: Mapping[int, Mapping[str, float]] | None = None  # the newest steps' metrics; None: not read
    backend_error: str | None = None  # the spec's backend cannot run here (not built, unknown)


@dataclass(frozen=True)
class PlanConfig:
    """Timings of the lifecycle; tests shorten them, nothing else should need to."""

    launch_grace_seconds: float = 15.0  # an intent row with no process is abandoned after this
    startup_timeout_seconds: float = 300.0  # a live process may take this long to send its first heartbeat
    stop_grace_seconds: float = 10.0  # TERM -> KILL for a worker we stop on purpose (it checkpoints)
    orphan_grace_seconds: float = 2.0  # TERM -> KILL for a process no live row owns
    max_backoff_seconds: float = 300.0  # cap of backoffSeconds * 2^k before a relaunch
    backoff_reset_seconds: float = 120.0  # a worker that lived this long resets its slot's backoff
    active_resync_seconds: float = 1.0  # look again this often while workers live (failure detection)
    stop_poll_seconds: float = 0.5  # look again this soon after asking a process to stop
    metrics_window_steps: int = 10  # the newest steps whose metrics a pass reads when the step moved
    reward_stuck_steps: int = 10  # a reward with the same value for every sample this many steps: not healthy
    checkpoint_slack_steps: int = 1  # CheckpointFresh: a checkpoint may be this many steps late
    progress_deadline_min_seconds: float = 60.0  # Progressing: deadline = max(this, factor x median step)
    progress_deadline_factor: float = 10.0
    progress_deadline_default_seconds: float = 600.0  # while no step time is known
    stall_deadline_default_seconds: float = 1800.0  # a task's or step's deadline while no step time is known
    stall_stop_grace_seconds: float = 2.0  # TERM -> KILL for a stalled worker (its stacks asked for first)
    stacks_answer_seconds: float = 5.0  # a stalled worker asked for its stacks is ended without them after it


@overload
def aware(moment: datetime) -> datetime: ...


@overload
def aware(moment: None) -> None: ...


def aware(moment: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every time in the store is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def worker_ref(row: WorkerRow, run_uid: str | None = None) -> WorkerRef:
    return WorkerRef(row.run, row.role, row.replica, row.incarnation, run_uid=run_uid)


def slot_name(row: WorkerRow) -> str:
    return f"{row.role}-{row.replica}"


@dataclass(frozen=True)
class Verdict:
    """What one pass concludes about one live row: keep it, adopt a process for it, or end it."""

    kind: str  # "ok" | "wait" | "adopt" | "end"
    state: str | None = None  # for "end": Succeeded | Failed | Lost
    exit_code: int | None = None
    message: str = ""
    kill: bool = False  # "end" of a process still alive (hung): stop it without grace
    handle: str | None = None  # for "adopt"
    recheck_after: float | None = None  # for "wait"


def judge(row: LiveRow, proc: ProcessView | None, now: datetime, cfg: PlanConfig) -> Verdict:
    """The health of a live (Pending/Running) row, from its process and its heartbeat.

    1. the backend saw the process exit -> end it by its exit code (0 done, 3 fatal, 4 out of memory,
       else lost);
    2. no handle recorded -> adopt the process if one carries this worker id, else give up after a grace;
    3. a handle but no such process any more -> lost (after the same grace, for listings that lag);
    4. alive but silent longer than its lease (or its startup timeout) -> lost, and kill it.
    """
    age = (now - aware(row.started_at)).total_seconds()
    if proc is not None and not proc.alive:
        return _exited(row, proc.exit_code)
    if row.handle is None and proc is not None:
        return Verdict("adopt", handle=proc.handle, message=f"adopted running process {proc.handle}")
    if proc is None:
        if age < cfg.launch_grace_seconds:
            return Verdict("wait", recheck_after=cfg.launch_grace_seconds - age)
        what = "launch never completed" if row.handle is None else "process is gone"
        return Verdict("end", state="Lost", message=what)
    if row.heartbeat_at is None:
        if age > cfg.startup_timeout_seconds:
            return Verdict(
                "end",
                state="Lost",
                kill=True,
                message=f"no heartbeat within {cfg.startup_timeout_seconds:g}s of start",
            )
        return Verdict("ok")
    silent = (now - aware(row.heartbeat_at)).total_seconds()
    if silent > row.lease_seconds:
        return Verdict(
            "end",
            state="Lost",
            kill=True,
            message=f"last heartbeat {silent:.1f}s ago (lease {row.lease_seconds:g}s)",
        )
    return Verdict("ok")


def _exited(row: LiveRow, code: int | None) -> Verdict:
    """A process that exited without its row saying so (killed, crashed, or its last write lost).

    Codes 3 (fatal) and 4 (out of GPU memory) are the worker's verdicts only with the message it writes
    before exiting with them: the same codes from the run's own code (os._exit(4) on a thread a reward
    started) once failed a CPU run as out of GPU memory, or at once as fatal. Without it the process is lost,
    and relaunched as any crash is. Its message names the signal that killed it, and what it was doing
    when it last said (its activity), when known."""
    if code == EXIT_SUCCEEDED:
        return Verdict("end", state="Succeeded", exit_code=code, message="exited with code 0")
    if code in (EXIT_FATAL, EXIT_OUT_OF_MEMORY) and row.message:
        return Verdict("end", state="Failed", exit_code=code, message=row.message)
    shown = "an unknown code" if code is None else f"code {code}"
    unsaid = (
        " without the report the worker writes with it" if code in (EXIT_FATAL, EXIT_OUT_OF_MEMORY) else ""
    )
    last = f"; last activity: {row.activity}" if row.activity else ""
    message = f"process exited with {shown}{unsaid}{killed_by(code)}{last}"
    return Verdict("end", state="Lost", exit_code=code, message=message)


def killed_by(code: int | None) -> str:
    """The signal a negative exit code names (a child's status, as subprocess gives it), said after the
    code; "" for any other code. SIGKILL cannot be caught, so the worker could not say why it ended: the
    kernel's out-of-memory killer is a common sender, named so that the reader knows where to look."""
    if code is None or code >= 0:
        return ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f" (killed by signal {-code})"
    if -code == signal.SIGKILL:
        return f" (killed by {name}: the kernel's out-of-memory killer is a common cause)"
    return f" (killed by {name})"
