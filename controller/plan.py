"""The pure heart of the controller: `plan(desired, observed, now) -> Plan(actions, status, events, outcome)`.

Called by `mortal.controller.reconciler` once per pass, and by tests with hand-built inputs (it does
no I/O and reads no clock). It decides, level-triggered, what closes the gap between a run's spec and
the world: which slots to launch or relaunch (after backoff), which workers are lost, which processes
to stop, when the run is Recovering, Suspended, Succeeded or Failed, and what its status says.

One pass, in order: stop processes no live row owns; handle a run being deleted, finished or
suspended; judge every live worker (exit code, heartbeat, deadlines); fail, heal (mortal.controller.heal)
or succeed the run on what the workers reported, and stop every worker when a limit is reached
(mortal.controller.budgets); launch or relaunch every desired slot without a live worker, failing the
run when relaunching cannot help; rebuild status with the conditions (mortal.controller.conditions)
and ask to be looked at again when something is due.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from mortal.controller import budgets, heal
from mortal.controller import conditions as rl
from mortal.controller import deadlines as dl
from mortal.controller.actions import (
    NORMAL,
    WARNING,
    Action,
    Adopt,
    DumpStacks,
    EndWorker,
    Event,
    Launch,
    Purge,
    Stop,
)
from mortal.controller.observed import (
    EXIT_FATAL,
    EXIT_OUT_OF_MEMORY,
    EXIT_RETRYABLE,
    FAILED_STATES,
    LIVE_STATES,
    Desired,
    Observed,
    PlanConfig,
    ProcessView,
    aware,
    judge,
    worker_ref,
)
from mortal.controller.outcome import Done, Outcome, RequeueAfter
from mortal.controller.status import (
    FAILED,
    PENDING,
    RECOVERING,
    RUNNING,
    STARTING,
    SUCCEEDED,
    SUSPENDED,
    TERMINAL_PHASES,
    Condition,
    Progress,
    build_status,
    condition_status,
    diff_events,
    iso,
    legal_phase,
)
from mortal.specs import memory
from mortal.specs.status import EffectiveMemory

ACTOR, ROLLOUT = "actor", "rollout"
READY_REASONS = {
    RUNNING: "WorkersReady",
    STARTING: "WorkersStarting",
    RECOVERING: "Recovering",
    PENDING: "Pending",
}


@dataclass(frozen=True)
class Plan:
    """What one pass decided; `events` are recorded only after `status` was written."""

    actions: tuple[Action, ...]
    status: dict[str, Any] | None  # None when the run is purged
    events: tuple[Event, ...]
    outcome: Outcome


@dataclass(frozen=True)
class _W:
    """A worker row as this pass sees it (rows it ends are replaced by their ended copy)."""

    id: int
    role: str
    replica: int
    incarnation: int
    ref: str
    handle: str | None
    state: str
    heartbeat_at: datetime | None
    lease_seconds: float
    step: int | None
    weight_version: int | None
    exit_code: int | None
    message: str | None
    started_at: datetime
    ended_at: datetime | None
    gpus: int = 0
    activity: str | None = None
    activity_since: datetime | None = None
    stacks_asked_at: datetime | None = None
    stacks_written_at: datetime | None = None

    @property
    def slot(self) -> tuple[str, int]:
        return (self.role, self.replica)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.replica}"

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def failed(self) -> bool:
        return self.state in FAILED_STATES

    @property
    def out_of_memory(self) -> bool:
        """Ended by its own out-of-memory report (observed._exited: exit 4 alone is a lost process)."""
        return self.state == "Failed" and self.exit_code == EXIT_OUT_OF_MEMORY

    @property
    def stall(self) -> str | None:
        """The stall this row was ended for (the plan ends it Failed with no exit code and the stall's reason
        first in its message), else None."""
        return dl.stall_reason(self.message) if self.state == "Failed" and self.exit_code is None else None


def _view(row: Any, run_uid: str | None) -> _W:
    return _W(
        id=row.id,
        role=row.role,
        replica=row.replica,
        incarnation=row.incarnation,
        ref=worker_ref(row, run_uid).process_id,
        handle=row.handle,
        state=row.state,
        heartbeat_at=aware(row.heartbeat_at),
        lease_seconds=row.lease_seconds,
        step=row.step,
        weight_version=row.weight_version,
        exit_code=row.exit_code,
        message=row.message,
        started_at=aware(row.started_at),
        ended_at=aware(row.ended_at),
        gpus=row.gpus or 0,
        activity=row.activity,
        activity_since=aware(row.activity_since),
        stacks_asked_at=aware(row.stacks_asked_at),
        stacks_written_at=aware(row.stacks_written_at),
    )


def plan(desired: Desired, observed: Observed, now: datetime, config: PlanConfig | None = None) -> Plan:
    """Decide one reconcile pass of one run. Pure: same inputs, same plan."""
    return _Pass(desired, observed, now, config or PlanConfig()).run()


class _Pass:
    def __init__(self, d: Desired, o: Observed, now: datetime, cfg: PlanConfig):
        self.d, self.o, self.now, self.cfg = d, o, now, cfg
        self.prev = dict(o.status or {})
        self.prev_phase = self.prev.get("phase") or PENDING
        self.procs = {p.worker_id: p for p in o.processes}
        self.rows = sorted((_view(r, d.uid) for r in o.workers), key=lambda w: w.incarnation)
        self.actions: list[Action] = []
        self.wake: list[float] = []
        self.notes: list[str] = []
        self.launched: list[Launch] = []
        self.ending_stalled: list[dl.StalledWorker] = []  # past a deadline, asked for their stacks this pass
        self.restarts = _count_restarts(self.rows, self._ended_badly)
        self.timing: tuple[str | None, float | None] = (
            self.prev.get("lastStepTime"),
            self.prev.get("stepSeconds"),
        )
        self.effective = heal.carried(self.prev.get("effective"), d)
        self.heal_events: list[Event] = []

    # -- 1-2: the run as a whole ------------------------------------------------------------------
    def run(self) -> Plan:
        self._stop_orphans()
        if self.d.deleted:
            return self._delete()
        if self.prev_phase in TERMINAL_PHASES:
            cond: dict[str, Any] = next(
                (c for c in self.prev.get("conditions") or [] if c.get("type") == self.prev_phase), {}
            )
            return self._finish(self.prev_phase, cond.get("reason", self.prev_phase), cond.get("message", ""))
        if self.o.backend_error is not None:
            return self._finish(FAILED, "BackendUnavailable", self.o.backend_error)
        if self.d.suspend:
            return self._suspend()
        limit = self._limit_reached()
        if limit is None:
            self._judge_live()  # a run over a limit stops its workers on purpose: no loss to judge
        fatal = next(
            (w for w in reversed(self.rows) if w.state == "Failed" and w.exit_code == EXIT_FATAL), None
        )
        if fatal is not None:
            return self._finish(
                FAILED,
                rl.run_failure_reason(fatal.message),
                f"{fatal.name} failed: {fatal.message or 'fatal error'}",
            )
        self._fit_before_launch()
        self._heal_out_of_memory()
        memory = self._out_of_memory()
        if memory is not None:
            return self._finish(FAILED, rl.OUT_OF_MEMORY, memory)
        if self._actor_finished():
            return self._finish(SUCCEEDED, "MaxStepsReached", f"the actor finished {self.d.max_steps} steps")
        if limit is not None:
            return self._stop_for_limit(limit)
        failure = self._ensure_slots()
        if failure is not None:
            return self._finish(FAILED, *failure)
        return self._active()

    def _stop_orphans(self) -> None:
        """Alive processes with no row, or whose row ended more than a grace ago (a late TERM/zombie)."""
        by_ref = {w.ref: w for w in self.rows}
        for proc in self.procs.values():
            row = by_ref.get(proc.worker_id)
            if not proc.alive or (row is not None and row.live):
                continue
            if row is not None and row.ended_at is not None:
                left = self.cfg.orphan_grace_seconds - (self.now - row.ended_at).total_seconds()
                if left > 0:
                    self.wake.append(left)
                    continue
            why = "its worker row ended" if row is not None else "no worker row owns it"
            self.actions.append(
                Stop(
                    proc.handle,
                    self.cfg.orphan_grace_seconds,
                    Event(WARNING, "OrphanStopped", f"stopped process {proc.worker_id}: {why}"),
                )
            )
            self.wake.append(self.cfg.stop_poll_seconds)

    def _delete(self) -> Plan:
        for w in self._live():
            self._retire(w, "run deleted")
        if not self._live() and not self.wake:
            self.actions.append(Purge(remove_files=self.d.purge))
            return Plan(tuple(self.actions), None, (), Done())
        return self._plan(
            self.prev_phase,
            self._carried_conditions(),
            f"deleting: waiting for {len(self._live())} worker(s) to stop",
        )

    def _finish(self, phase: str, reason: str, message: str) -> Plan:
        for w in self._live():
            self._retire(w, f"run {phase.lower()}")
        conditions = [
            Condition("Ready", False, reason, message),
            Condition("Suspended", False, "NotSuspended"),
            Condition(phase, True, reason, message),
        ]
        return self._plan(phase, conditions + self._final_conditions(phase), message)

    def _suspend(self) -> Plan:
        for w in self._live():
            self._retire(w, "run suspended")
        left = len(self._live())
        message = f"suspending: waiting for {left} worker(s) to stop" if left else "suspended"
        conditions = [
            Condition("Ready", False, "Suspended", message),
            Condition("Suspended", True, "Suspended", "spec.suspend is true"),
        ]
        return self._plan(SUSPENDED, conditions + self._training_conditions(suspended=True), message)

    def _limit_reached(self) -> budgets.Exceeded | None:
        """A limit of spec.limits reached by now; else ask to be looked at again when the first one is."""
        if self.d.max_duration is None and self.d.max_gpu_hours is None:
            return None
        active = (
            budgets.active_time(self.prev, self.now)
            if budgets.is_active(self.prev_phase)
            else (float(self.prev.get("activeSeconds") or 0.0))
        )
        used = budgets.gpu_seconds(self.rows, self.now)
        ready = self._prev_condition("Ready")
        already = (
            ready.reason
            if ready is not None and self.prev.get("observedGeneration") == self.d.generation
            else None
        )  # the same spec as when a limit was found reached: it stays reached
        reached = budgets.exceeded(self.d.max_duration, active, self.d.max_gpu_hours, used, already)
        if reached is None:
            live_gpus = sum(w.gpus for w in self._live())
            left = budgets.seconds_left(self.d.max_duration, active, self.d.max_gpu_hours, used, live_gpus)
            if left is not None:
                self.wake.append(left)
        return reached

    def _stop_for_limit(self, limit: budgets.Exceeded) -> Plan:
        """Stop every worker as a suspend does (TERM: the actor checkpoints at its step boundary and exits),
        and fail the run once none is left, so that its final checkpoint is recorded by then."""
        for w in self._live():
            self._retire(w, limit.message)
        left = len(self._live())
        if not left:
            return self._finish(FAILED, limit.reason, limit.message)
        message = f"{limit.message}; stopping {left} worker(s), the actor writes a final checkpoint"
        conditions = [
            Condition("Ready", False, limit.reason, message),
            Condition("Suspended", False, "NotSuspended"),
        ]
        return self._plan(self.prev_phase, conditions + self._training_conditions(suspended=False), message)

    # -- 3-5: workers -----------------------------------------------------------------------------
    def _judge_live(self) -> None:
        wanted = set(self._desired_slots())
        for w in self._live():
            if w.slot not in wanted:
                self._retire(w, f"scaled down to {self.d.rollout_replicas} rollout replicas")
                continue
            proc = self.procs.get(w.ref)
            verdict = judge(w, proc, self.now, self.cfg)
            if verdict.kind == "ok" and proc is not None and self._stalled(w, proc):
                continue
            if verdict.kind == "wait":
                self.wake.append(verdict.recheck_after or 0.0)
            elif verdict.kind == "adopt":
                self.actions.append(
                    Adopt(
                        w.id,
                        verdict.handle or "",
                        Event(NORMAL, "Adopted", f"{w.name} #{w.incarnation}: {verdict.message}"),
                    )
                )
            elif verdict.kind == "end":
                state = verdict.state or "Lost"
                if state == "Lost" and w.handle is None and proc is None:
                    state = "Stopped"  # an intent the controller never launched: not the worker's failure
                kind, reason = (
                    (NORMAL, "WorkerSucceeded")
                    if state in ("Succeeded", "Stopped")
                    else (WARNING, "WorkerLost" if state == "Lost" else "WorkerFailed")
                )
                event = Event(kind, reason, f"{w.name} #{w.incarnation}: {verdict.message}")
                self._end(w, state, verdict.exit_code, verdict.message, event)
                if proc is not None:  # hung: kill it; exited: what it left (its group, children that left it)
                    self.actions.append(Stop(proc.handle, 0.0, None))

    def _deadline_counts_from(self, w: _W) -> datetime | None:
        """When `w`'s activity began to count against its deadline (None: it has none now). An actor's step
        waits for generation: with no rollout running (rollout.replicas 0 pauses generation, or every rollout
        is being relaunched) it cannot end, so it has no deadline; when the rollouts running now all started
        after the step began, it counts from the first of them."""
        if w.role != ACTOR or not (w.activity or "").startswith("step") or w.activity_since is None:
            return w.activity_since
        running = [r.started_at for r in self.rows if r.role == ROLLOUT and r.state == "Running"]
        if self.d.rollout_replicas == 0 or not running:
            return None
        return max(w.activity_since, min(running))

    def _stalled(self, w: _W, proc: ProcessView) -> bool:
        """Whether `w` ran past the deadline of what it reports doing; if so: ask for its stacks, then (a
        later pass, once it wrote them or `stacks_answer_seconds` went by without) end it (Failed, the
        stall's reason first in its message: a relaunch, and the give-up count) and stop it. Else wake at
        its deadline."""
        step_seconds = (rl.step_seconds(self.o.metrics) if self.o.metrics else None) or self.timing[1]
        derived = dl.DerivedFrom(
            self.cfg.progress_deadline_min_seconds,
            self.cfg.progress_deadline_factor,
            self.cfg.stall_deadline_default_seconds,
        )
        since = self._deadline_counts_from(w)
        stall = dl.stalled(w.activity, since, self.now, self.d.deadlines, step_seconds, derived)
        if stall is None:
            due = dl.due_in(w.activity, since, self.now, self.d.deadlines, step_seconds, derived)
            if due is not None:
                self.wake.append(due)
            return False
        stacks = self._stacks(w, proc)
        if stacks is None:  # asked for its stacks: ended once it answers
            seen = dl.StalledWorker(w.name, w.incarnation, f"{stall.reason}: {stall.message}", self.now, True)
            self.ending_stalled.append(seen)
            return True
        where = f"{w.name} #{w.incarnation}"
        self._end(
            w,
            "Failed",
            None,
            f"{stall.reason}: {stall.message}",
            Event(WARNING, stall.reason, f"{where}: {stall.message}; {stacks}; relaunching it"),
        )
        self.actions.append(Stop(proc.handle, self.cfg.stall_stop_grace_seconds, None))
        self.wake.append(self.cfg.stop_poll_seconds)
        return True

    def _stacks(self, w: _W, proc: ProcessView) -> str | None:
        """What the stall's event says of a stalled worker's stacks once they are written, or once it did not
        answer within `stacks_answer_seconds`; None while they are asked for (now, or still awaited). A
        request made before the activity began (an earlier stall it came out of) is asked again."""
        asked = w.stacks_asked_at
        if asked is None or (w.activity_since is not None and asked < w.activity_since):
            self.actions.append(DumpStacks(proc.handle, w.id))
            self.wake.append(self.cfg.stacks_answer_seconds)
            return None
        if w.stacks_written_at is not None:
            return "its stacks are in its log"
        waited = (self.now - asked).total_seconds()
        if waited < self.cfg.stacks_answer_seconds:
            self.wake.append(self.cfg.stacks_answer_seconds - waited)
            return None
        return f"it did not write its stacks within {self.cfg.stacks_answer_seconds:g} s of being asked"

    def _out_of_memory(self) -> str | None:
        """The run's failure message when a slot ran out of GPU memory and must not be relaunched, else None.

        The same spec on the same GPU makes the same tensors, so relaunching in a loop only hides the
        cause. A slot gets ONE relaunch (counted against maxRestarts), since the memory a worker finds
        also depends on things outside its spec (a predecessor's CUDA context, a colocated neighbour's
        peak); its second out-of-memory fails the run with reason OutOfMemory, as a Job's podFailurePolicy
        would. The MemoryFits condition says what to change before `apply`ing again.
        """
        exits = self._oom_exits()
        condition = rl.memory_fits(exits, self._memory_knobs())
        newest = {w.slot: w for w in self.rows}
        for e in exits:
            last = newest[(e.role, e.replica)]
            pending_relaunch = last.out_of_memory
            if e.count > rl.OOM_RELAUNCHES or (pending_relaunch and self.restarts >= self.d.max_restarts):
                return condition.message
        return None

    def _fit_before_launch(self) -> None:
        """Start the actor with the micro batch `mortalctl apply` estimated to fit
        (heal.fitted_before_launch), chosen only while no actor runs, so that status.effective is what the
        next one is launched with."""
        if any(w.live and w.role == ACTOR for w in self.rows):
            return
        fitted = heal.fitted_before_launch(self.effective, self.d)
        if fitted is not None:
            self.effective = fitted.effective
            self.heal_events.append(Event(NORMAL, fitted.reason, fitted.message))

    def _heal_out_of_memory(self) -> None:
        """Lower a setting that keeps the step for each slot whose newest ended worker ran out of GPU memory
        and was not answered yet (mortal.controller.heal); the relaunch `_ensure_slots` makes then gets it."""
        if self.restarts >= self.d.max_restarts:
            return  # no relaunch left to carry a smaller setting: the run fails as it did
        newest: dict[tuple[str, int], _W] = {}
        for w in self.rows:
            if not w.live:
                newest[w.slot] = w
        for w in newest.values():
            if not w.out_of_memory:
                continue
            reduction = heal.reduce_after(self.effective, self.d, w.role, w.name, w.incarnation)
            if reduction is not None:
                self.effective = reduction.effective
                self.heal_events.append(Event(WARNING, reduction.reason, reduction.message))

    def _oom_exits(self) -> list[rl.OomExit]:
        """Slots whose newest ended worker ran out of GPU memory, with how often that slot did."""
        history: dict[tuple[str, int], list[_W]] = defaultdict(list)
        for w in self.rows:
            history[w.slot].append(w)
        exits = []
        for slot in sorted(history):
            hist = history[slot]
            ended = [w for w in hist if not w.live]
            if not ended or not ended[-1].out_of_memory:
                continue
            last = ended[-1]
            details = (last.message or "no figures reported").removeprefix(f"{rl.OUT_OF_MEMORY}: ")
            answered = self.effective.reduced_after.get(last.name, 0) if self.effective else 0
            count = sum(1 for w in hist if w.out_of_memory and w.incarnation > answered)
            healed = self.effective.reason if answered == last.incarnation and self.effective else None
            exits.append(
                rl.OomExit(last.name, last.role, last.replica, last.incarnation, details, count, healed)
            )
        return exits

    def _memory_knobs(self) -> rl.MemoryKnobs:
        return rl.MemoryKnobs(
            colocate=self.d.colocate,
            lora=self.d.lora,
            gradient_checkpointing=self.d.gradient_checkpointing,
            micro_batch_size=heal.micro_batch(self.effective, self.d),
            rollout_share=heal.rollout_share(self.effective, self.d),
            actor_ranks=self.d.actor_ranks,
            cpu_offload=self.d.cpu_offload,
            reshard_after_forward=self.d.reshard_after_forward,
            replicated=self.d.replicated,
        )

    def _actor_finished(self) -> bool:
        """The newest actor ended Succeeded at maxSteps (a Succeeded actor stopped early is relaunched)."""
        actors = [w for w in self.rows if w.role == ACTOR]
        if not actors or actors[-1].state != "Succeeded":
            return False
        known = [
            s
            for s in (actors[-1].step, self.o.checkpoint.step if self.o.checkpoint else None)
            if s is not None
        ]
        return not known or max(known) >= self.d.max_steps

    def _ensure_slots(self) -> tuple[str, str] | None:
        """Launch each desired slot without a live row; the run's failure (reason, message) when a slot that
        failed may not be relaunched: the restart limit is spent, or it failed the same way too often."""
        history: dict[tuple[str, int], list[_W]] = defaultdict(list)
        for w in self.rows:
            history[w.slot].append(w)
        for slot in self._desired_slots():
            hist = history.get(slot, [])
            live = [w for w in hist if w.live]
            for twin in live[:-1]:
                self._retire(twin, f"superseded by incarnation {live[-1].incarnation}")
            if live:
                continue
            last = hist[-1] if hist else None
            if last is None or not self._ended_badly(last):
                self._launch(slot, restart=False, why=self._went_on(last))
                continue
            stalls = self._same_stalls(hist)
            if self.d.same_failure_limit and stalls >= self.d.same_failure_limit:
                reason, _, what = (last.message or "").partition(": ")
                return reason, (
                    f"{last.name} stalled {stalls} times in a row: {what} (relaunching does not "
                    "heal it; restartPolicy.sameFailureLimit)"
                )
            if self.restarts >= self.d.max_restarts:
                return (
                    "RestartLimitReached",
                    f"restart limit reached: {last.name}: {last.message or last.state}",
                )
            repeated = self._same_failures(hist)
            if self.d.same_failure_limit and repeated >= self.d.same_failure_limit:
                return "CrashLoop", (
                    f"{last.name} failed {repeated} times in a row with the same error, "
                    f"each within {self.cfg.backoff_reset_seconds:.0f} s of its launch: "
                    f"{last.message} (relaunching does not fix it; "
                    "restartPolicy.sameFailureLimit)"
                )
            due = (last.ended_at or self.now).timestamp() + self._backoff(hist) - self.now.timestamp()
            if due > 0:
                self.wake.append(due)
                self.notes.append(
                    f"restarting {last.name} in {due:.0f}s ({last.state.lower()}: {last.message})"
                )
                continue
            self.restarts += 1
            self._launch(slot, restart=True, why=f"{last.state.lower()}: {last.message or 'no message'}")
        return None

    def _ended_badly(self, w: _W) -> bool:
        """Failed or lost, or a rollout that exited 0 while the actor trains on: a rollout ends on its own
        only after the actor's last step, so such an exit (user code calling os._exit(0)) is counted as
        a restart, with its backoff and limit, as Kubernetes counts a container's exit 0 under Always."""
        if w.failed:
            return True
        actors = [a for a in self.rows if a.role == ACTOR]
        return (
            w.role == ROLLOUT and w.state == "Succeeded" and not (actors and actors[-1].state == "Succeeded")
        )

    def _went_on(self, last: _W | None) -> str:
        """Why a slot whose worker ended without failing is launched again, for its event: an actor that
        finished the old maxSteps goes on to a raised one (no other event says so)."""
        if last is None or last.role != ACTOR or last.state != "Succeeded":
            return ""
        ended = f"step {last.step}" if last.step is not None else "its maxSteps"
        return f"to train on from {ended} to maxSteps {self.d.max_steps}"

    def _backoff(self, hist: list[_W]) -> float:
        """backoffSeconds * 2^k for the slot's k-th consecutive failure; a long-lived worker resets k."""
        k = 0
        for w in reversed(hist):
            if not self._ended_badly(w):
                break
            k += 1
            if self._lived_long(w):
                break
        return min(self.cfg.max_backoff_seconds, self.d.backoff_seconds * 2 ** max(0, k - 1))

    def _same_failures(self, hist: list[_W]) -> int:
        """How many of the slot's newest workers in a row reported the newest one's error (exit 75, the same
        message), each soon after its launch. Why fail on it before maxRestarts: a worker that meets the same
        error on every launch (a library's assertion, a bad input) would otherwise be relaunched maxRestarts
        times over a long doubling backoff; a Job's podFailurePolicy likewise fails at once on an exit it
        knows retrying cannot fix. A loss (no report: preempted, killed) breaks the run of them, and so does
        a worker that ran long (as for the backoff)."""
        newest = hist[-1]
        count = 0
        for w in reversed(hist):
            if not (
                w.state == "Failed"
                and w.exit_code == EXIT_RETRYABLE
                and w.message
                and w.message == newest.message
                and not self._lived_long(w)
            ):
                break
            count += 1
        return count

    def _same_stalls(self, hist: list[_W]) -> int:
        """How many of the slot's newest workers in a row were ended for the same stall (reason) as the
        newest.
        Unlike `_same_failures`, a long life does not break the run of them: a stall is found only after
        its deadline."""
        reason = hist[-1].stall
        count = 0
        for w in reversed(hist):
            if reason is None or w.stall != reason:
                break
            count += 1
        return count

    def _lived_long(self, w: _W) -> bool:
        """Whether a worker ran long enough to reset its slot's count of failures (backoff, same failures)."""
        return ((w.ended_at or self.now) - w.started_at).total_seconds() >= self.cfg.backoff_reset_seconds

    def _launch(self, slot: tuple[str, int], restart: bool, why: str) -> None:
        role, replica = slot
        if restart:
            text = f"restarting {role}-{replica} (restart {self.restarts}/{self.d.max_restarts}) after {why}"
            event = Event(WARNING, "Restarted", text)
        else:
            event = Event(NORMAL, "Launched", f"launched {role}-{replica}" + (f" {why}" if why else ""))
        launch = Launch(role, replica, restart, event, env=memory.environ(self.effective, role))
        self.actions.append(launch)
        self.launched.append(launch)

    # -- 6: status --------------------------------------------------------------------------------
    def _active(self) -> Plan:
        history: dict[tuple[str, int], list[_W]] = defaultdict(list)
        for w in self.rows:
            history[w.slot].append(w)
        recovering = [slot for slot in self._desired_slots() if _recovering(history.get(slot, []))]
        actor_ready, rollout_ready = self._ready()
        if recovering:
            phase = RECOVERING
        elif actor_ready and (
            rollout_ready >= min(1, self.d.rollout_replicas) or self.prev_phase in (RUNNING, RECOVERING)
        ):
            phase = RUNNING
        else:
            phase = STARTING if (self.rows or self.launched) else PENDING
        message = self._active_message(phase, recovering, rollout_ready)
        conditions = [
            Condition("Ready", phase == RUNNING, READY_REASONS[phase], message),
            Condition("Suspended", False, "NotSuspended"),
        ]
        return self._plan(phase, conditions + self._training_conditions(suspended=False), message)

    def _active_message(self, phase: str, recovering: list[tuple[str, int]], rollout_ready: int) -> str:
        if phase == RUNNING:
            step = self._progress().step
            return (
                f"training: step {step if step is not None else 0}/{self.d.max_steps}, "
                f"{rollout_ready}/{self.d.rollout_replicas} rollout workers ready"
            )
        if phase == RECOVERING:
            waiting = [f"{r}-{i} restarted, waiting for its first heartbeat" for r, i in recovering]
            return "; ".join(self.notes or waiting)
        starting = len(self._live()) + len(self.launched)
        return f"waiting for {starting} worker(s) to start" if starting else "waiting to launch workers"

    def _plan(self, phase: str, conditions: list[Condition], message: str) -> Plan:
        hop = legal_phase(self.prev_phase, phase)
        if hop != phase:
            self.wake.append(0.0)  # write the legal intermediate phase now, the wanted one next pass
            phase = hop
        status = build_status(
            self.prev,
            phase,
            conditions,
            self._progress(phase),
            self.d.generation,
            message,
            self.now,
            effective=self._effective_status(),
        )
        events = tuple(self.heal_events) + tuple(diff_events(self.prev, status))
        wake = list(self.wake)
        if self._live() or self.launched:
            wake.append(self.cfg.active_resync_seconds)
        outcome: Outcome = RequeueAfter(max(0.0, min(wake))) if wake else Done()
        return Plan(tuple(self.actions), status, events, outcome)

    def _effective_status(self) -> dict[str, Any] | None:
        if self.effective is None or self.effective == EffectiveMemory():
            return None
        return self.effective.model_dump(by_alias=True, mode="json", exclude_none=True)

    def _progress(self, phase: str | None = None) -> Progress:
        actors = [w for w in self.rows if w.role == ACTOR and w.step is not None]
        ckpt = self.o.checkpoint
        actor_ready, rollout_ready = self._ready()
        running = phase not in (SUSPENDED, SUCCEEDED, FAILED)
        steps = [
            s for s in (actors[-1].step if actors else None, ckpt.step if ckpt else None) if s is not None
        ]
        active_seconds, active_since = budgets.next_clock(self.prev, phase or self.prev_phase, self.now)
        return Progress(
            step=max(steps) if steps else None,  # a checkpoint of step C means C steps are done
            weight_version=self.o.weight_version,
            checkpoint={"step": ckpt.step, "path": ckpt.path, "time": iso(aware(ckpt.created_at))}
            if ckpt
            else None,
            reward=self.o.reward,
            actor=(actor_ready, 1 if running else 0),
            rollout=(rollout_ready, self.d.rollout_replicas if running else 0),
            restarts=self.restarts,
            last_step_time=self.timing[0],
            step_seconds=self.timing[1],
            active_seconds=active_seconds,
            active_since=active_since,
            gpu_hours=budgets.gpu_hours(budgets.gpu_seconds(self.rows, self.now)),
        )

    # -- 6: the training conditions -----------------------------------------------------------------
    def _training_conditions(self, suspended: bool) -> list[Condition]:
        """WeightsInSync, RewardHealthy, CheckpointFresh, Progressing from what this pass observed."""
        d, o, cfg = self.d, self.o, self.cfg
        step, prev_step = self._progress().step, self.prev.get("step")
        last, seconds = self.timing
        if o.metrics is not None:
            seconds = rl.step_seconds(o.metrics) or seconds
        if suspended:
            last = None  # the clock starts again with the first step after a resume
        elif step is not None and step > (prev_step if prev_step is not None else 0):
            last = iso(self.now)
        self.timing = (last, seconds)
        if suspended:
            weights = Condition(rl.WEIGHTS, None, "Suspended", "not evaluated while suspended")
        else:
            wanted = set(self._desired_slots())
            rollouts = [
                rl.RolloutVersion(w.name, w.weight_version, w.heartbeat_at)
                for w in self.rows
                if w.role == ROLLOUT and w.state == "Running" and w.slot in wanted
            ]
            weights = rl.weights_in_sync(
                rollouts, o.weight_version, aware(o.weights_at), d.max_staleness, d.sync_every
            )
        if o.metrics is not None:
            reward = rl.reward_healthy(o.metrics, cfg.reward_stuck_steps)
        else:
            reward = self._prev_condition(rl.REWARD) or rl.reward_healthy({}, cfg.reward_stuck_steps)
        ckpt = o.checkpoint.step if o.checkpoint else None
        deadline = rl.progress_deadline(
            seconds,
            cfg.progress_deadline_min_seconds,
            cfg.progress_deadline_factor,
            cfg.progress_deadline_default_seconds,
        )
        last_time = datetime.fromisoformat(last) if last else None
        return [
            weights,
            reward,
            rl.checkpoint_fresh(step, ckpt, d.checkpoint_every, cfg.checkpoint_slack_steps),
            (
                rl.progressing(suspended, aware(last_time), deadline, self.now)
                if self.d.rollout_replicas > 0 or suspended
                else rl.generation_paused()
            ),
            self._deadlines_met(),
            rl.memory_fits(self._oom_exits(), self._memory_knobs()),
        ]

    def _deadlines_met(self) -> Condition:
        """DeadlinesMet from each slot's newest ended worker that was ended for a stall, and the workers being
        ended for one (asked for their stacks this pass)."""
        newest_ended: dict[tuple[str, int], _W] = {}
        for w in self.rows:
            if not w.live:
                newest_ended[w.slot] = w
        stalls = [
            dl.StalledWorker(w.name, w.incarnation, w.message or "", w.ended_at or self.now)
            for w in newest_ended.values()
            if w.stall is not None
        ]
        step, prev_step = self._progress().step, self.prev.get("step")
        last: datetime | None
        if step is not None and step > (prev_step if prev_step is not None else 0):
            last = self.now  # a step ended since the last pass (also on the pass that finishes the run)
        else:
            last = aware(datetime.fromisoformat(self.timing[0])) if self.timing[0] else None
        return dl.deadlines_met(stalls + self.ending_stalled, last)

    def _final_conditions(self, phase: str) -> list[Condition]:
        """A finished run's training conditions, from what it left rather than as the last pass before its end
        saw them (a fast run ends between passes: they said step 1 of 3): CheckpointFresh and RewardHealthy
        judge the final step and metrics; WeightsInSync and Progressing are not evaluated once no worker
        runs (Unknown, so that nothing alerting on False mistakes an end for a stall); a reward that failed
        the run says so."""
        o = self.o
        step = self._progress().step
        reward = (
            rl.reward_healthy(o.metrics, self.cfg.reward_stuck_steps)
            if o.metrics is not None
            else self._prev_condition(rl.REWARD) or rl.reward_healthy({}, self.cfg.reward_stuck_steps)
        )
        newest = f"newest v{o.weight_version}" if o.weight_version is not None else "none published"
        ended = f"the run {phase.lower()} at step {step or 0}"
        final = [
            Condition(rl.WEIGHTS, None, rl.RUN_ENDED, f"{ended} ({newest}): no rollout runs"),
            reward,
            rl.checkpoint_fresh(
                step,
                o.checkpoint.step if o.checkpoint else None,
                self.d.checkpoint_every,
                self.cfg.checkpoint_slack_steps,
            ),
            Condition(rl.PROGRESSING, None, rl.RUN_ENDED, ended),
            self._deadlines_met(),
            rl.memory_fits(self._oom_exits(), self._memory_knobs()),
        ]
        fatal = next(
            (w for w in reversed(self.rows) if w.state == "Failed" and w.exit_code == EXIT_FATAL), None
        )
        failure = rl.reward_failure(fatal.message) if fatal is not None else None
        if failure is None:
            return final
        return [c for c in final if c.type != rl.REWARD] + [failure]

    def _prev_condition(self, type_: str) -> Condition | None:
        return next((c for c in self._carried_conditions() if c.type == type_), None)

    # -- helpers ----------------------------------------------------------------------------------
    def _desired_slots(self) -> list[tuple[str, int]]:
        return [(ACTOR, 0)] + [(ROLLOUT, i) for i in range(self.d.rollout_replicas)]

    def _live(self) -> list[_W]:
        return [w for w in self.rows if w.live]

    def _ready(self) -> tuple[int, int]:
        wanted = set(self._desired_slots())
        ready = {w.slot for w in self.rows if w.state == "Running" and w.slot in wanted}
        return (sum(1 for r, _ in ready if r == ACTOR), sum(1 for r, _ in ready if r == ROLLOUT))

    def _carried_conditions(self) -> list[Condition]:
        status = {condition_status(v): v for v in (True, False, None)}
        return [
            Condition(c["type"], status.get(c.get("status")), c.get("reason", ""), c.get("message", ""))
            for c in self.prev.get("conditions") or []
        ]

    def _retire(self, w: _W, reason: str) -> None:
        """Stop a live worker on purpose: TERM it (it may checkpoint); end its row once it is gone."""
        proc = self.procs.get(w.ref)
        if proc is not None and proc.alive:
            self.actions.append(Stop(proc.handle, self.cfg.stop_grace_seconds, None))
            self.wake.append(self.cfg.stop_poll_seconds)
            return
        age = (self.now - w.started_at).total_seconds()
        if w.handle is None and proc is None and age < self.cfg.launch_grace_seconds:
            self.wake.append(self.cfg.launch_grace_seconds - age)  # a launch may still be in flight
            return
        code = proc.exit_code if proc is not None else None
        self._end(
            w, "Stopped", code, reason, Event(NORMAL, "WorkerStopped", f"{w.name} #{w.incarnation}: {reason}")
        )

    def _end(self, w: _W, state: str, code: int | None, message: str, event: Event | None) -> None:
        self.actions.append(EndWorker(w.id, state, code, message, event))
        ended = replace(w, state=state, exit_code=code, message=message, ended_at=self.now)
        self.rows = [ended if r.id == w.id else r for r in self.rows]


def _count_restarts(rows: list[_W], ended_badly: Callable[[_W], bool]) -> int:
    """Relaunches recorded in the rows: a row whose predecessor in the same slot ended badly (failed, lost,
    or a rollout's early exit: _Pass._ended_badly)."""
    last: dict[tuple[str, int], _W] = {}
    count = 0
    for w in rows:
        before = last.get(w.slot)
        if before is not None and ended_badly(before):
            count += 1
        last[w.slot] = w
    return count


def _recovering(hist: list[_W]) -> bool:
    """The slot lost its worker and has not got a running replacement yet."""
    if not hist:
        return False
    if hist[-1].failed:
        return True
    return hist[-1].state == "Pending" and len(hist) > 1 and hist[-2].failed
