"""A torch-free workload that speaks the worker protocol for real: for controller tests and benchmarks.

Selected by the run annotation `mortal.dev/workload: simulated` (mortal.workers.main). It uses the
store exactly as the real actor and rollout do (task queue, weights, checkpoints, metrics, resume),
but "training" is a sleep and "generation" returns fixed tokens, so a run of a few steps takes
seconds on a CPU. Annotations tune it:

    mortal.dev/step-seconds: "0.2"        actor: least time per optimizer step
    mortal.dev/generate-seconds: "0.01"   rollout: time per task
    mortal.dev/task-lease-seconds: "5"    how long a leased task is a rollout's before others retry it
    mortal.dev/fail: always               actor exits 75 at once (restart-policy tests)
    mortal.dev/fail: oom-actor|oom-rollout  that role raises torch.cuda.OutOfMemoryError with torch's own
                                          message at its first step or task
    mortal.dev/fail: oom-actor-above:N    the actor raises it at start while its micro batch (the spec's, or
                                          the controller's choice: mortal.specs.memory) is above N
    mortal.dev/stall: task|step           a rollout's task / the actor's step of step `stall-step` blocks
    mortal.dev/stall-step: "2"              forever (the watchdog's tests), in the first `stall-times`
    mortal.dev/stall-times: "1"             launches of the slot (0: every launch)
    mortal.dev/rewards: call              rollouts score with the spec's reward functions (as the real
                                          rollout does: deadlines, timeouts) instead of the fixed score

The reward of step s is s / (s + 10) for every completion, so runs are deterministic and a resumed run's
metrics equal an uninterrupted one's; prompts are drawn and queued ahead as the real actor does
(mortal.workers.schedule). What the "model" trained is its lineage (`Lineage`: each step's rows and the
weight versions they came from, kept in every checkpoint), so a test can tell a row trained twice or never.
What it must not do: import torch or anything heavy (only the out-of-memory failure does, when asked for).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mortal.specs import TrainingRun
from mortal.state import NewTask, TaskRow, paths
from mortal.state.containment import PathOutside, report_refused, tree_inside
from mortal.workers import schedule
from mortal.workers.atomic import atomic_dir, sweep
from mortal.workers.errors import FatalWorkerError
from mortal.workers.messages import RolloutRequest, RolloutResult, reward_names
from mortal.workers.rewards import RewardSet
from mortal.workers.runtime import EXIT_RETRYABLE, EXIT_SUCCEEDED, WorkerContext

POLL_SECONDS = 0.05
OOM_ABOVE = "oom-actor-above:"
KEEP_WEIGHTS = 3
STATE_FILE = "state.json"
SIMULATED_ROWS = 64  # the simulated dataset: rows "row 0" .. "row 63", drawn an epoch at a time


@dataclass
class Lineage:
    """What the simulated model has been trained on, as its checkpoints carry it: the weight versions this
    lineage published (a resumed actor's include its checkpoint's, published again under a new number) and,
    per step, the rows trained and the versions their samples were generated with."""

    published: list[int]
    steps: list[dict[str, Any]]

    @classmethod
    def of(cls, state: dict[str, Any]) -> Lineage:
        return cls(list(state.get("published", [])), list(state.get("steps", [])))

    def trained(self, step: int, rows: list[str], versions: list[int], weights: int) -> None:
        self.steps.append({"step": step, "rows": rows, "versions": versions, "trainedWith": weights})


@dataclass(frozen=True)
class Settings:
    step_seconds: float = 0.2
    generate_seconds: float = 0.01
    task_lease_seconds: float = 5.0
    fail: str | None = None
    stall: str | None = None  # task | step
    stall_step: int = 2
    stall_times: int = 1  # 0: every launch
    call_rewards: bool = False

    @classmethod
    def of(cls, run: TrainingRun) -> Settings:
        notes = run.metadata.annotations
        try:
            return cls(
                step_seconds=float(notes.get("mortal.dev/step-seconds", cls.step_seconds)),
                generate_seconds=float(notes.get("mortal.dev/generate-seconds", cls.generate_seconds)),
                task_lease_seconds=float(notes.get("mortal.dev/task-lease-seconds", cls.task_lease_seconds)),
                fail=notes.get("mortal.dev/fail"),
                stall=notes.get("mortal.dev/stall"),
                stall_step=int(notes.get("mortal.dev/stall-step", cls.stall_step)),
                stall_times=int(notes.get("mortal.dev/stall-times", cls.stall_times)),
                call_rewards=notes.get("mortal.dev/rewards") == "call",
            )
        except ValueError as exc:
            raise FatalWorkerError("InvalidAnnotation", f"simulated workload annotation: {exc}") from exc


def simulated_run(
    name: str,
    *,
    max_steps: int = 5,
    rollout_replicas: int = 1,
    step_seconds: float = 0.05,
    annotations: dict[str, str] | None = None,
    spec: dict[str, Any] | None = None,
) -> TrainingRun:
    """A TrainingRun this workload runs: tiny batches, checkpoints every 2 steps (tests, benchmarks).

    `spec` entries (camelCase, by top-level section) override the defaults section by section.
    """
    doc: dict[str, Any] = {
        "model": {"name": "simulated"},
        "dataset": {"name": "builtin:arith"},
        "algorithm": {"numGenerations": 2, "batchSize": 4, "maxSteps": max_steps},
        "rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
        "rollout": {"replicas": rollout_replicas},
        "checkpoint": {"every": 2, "keep": 2},
        "restartPolicy": {"backoffSeconds": 0.5},
    }
    for section, value in (spec or {}).items():
        doc[section] = {**doc[section], **value} if isinstance(value, dict) and section in doc else value
    notes = {
        "mortal.dev/workload": "simulated",
        "mortal.dev/step-seconds": str(step_seconds),
        **(annotations or {}),
    }
    return TrainingRun.model_validate({"metadata": {"name": name, "annotations": notes}, "spec": doc})


def simulated_reward(step: int) -> float:
    """The score of every completion generated for step `step`."""
    return step / (step + 10)


def never_returns(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward function whose call never returns, as one waiting on an API that never answers (the
    watchdog's tests: `rewards[].timeoutSeconds` abandons it)."""
    threading.Event().wait()
    raise AssertionError("unreachable")


def stall_here(ctx: WorkerContext, settings: Settings, what: str, step: int) -> None:
    """Block forever when the annotations ask this slot to stall at `what` of `step` in this launch (the
    slot's earlier launches that failed, i.e. were healed, are fewer than stall-times)."""
    if settings.stall != what or step != settings.stall_step:
        return
    me = ctx.worker
    healed = sum(
        1
        for w in ctx.store.list_workers(me.run)
        if (w.role, w.replica) == (me.role, me.replica)
        and w.incarnation < me.incarnation
        and w.state == "Failed"
    )
    if settings.stall_times and healed >= settings.stall_times:
        return
    ctx.log.warning("annotation mortal.dev/stall=%s: blocking in %s %d forever", what, what, step)
    while True:
        time.sleep(3600)


def main(ctx: WorkerContext) -> int:
    if ctx.worker.role == "actor":
        return run_actor(ctx)
    if ctx.worker.role == "rollout":
        return run_rollout(ctx)
    raise FatalWorkerError("UnknownRole", f"the simulated workload has no role {ctx.worker.role!r}")


# -- actor -------------------------------------------------------------------------------------
def run_actor(ctx: WorkerContext) -> int:
    """Resume, then per step: enqueue tasks, wait for their results, publish weights, log, checkpoint."""
    settings = Settings.of(ctx.run)
    if settings.fail == "oom-actor":
        raise_torch_out_of_memory()
    if settings.fail and settings.fail.startswith(OOM_ABOVE):
        algorithm = ctx.run.spec.algorithm
        micro = algorithm.batch_size // algorithm.accumulation_steps
        if micro > _threshold(settings.fail):
            ctx.log.error("micro batch %d is above %s: out of memory", micro, settings.fail)
            raise_torch_out_of_memory()
        ctx.log.info("micro batch %d (%d passes a step)", micro, algorithm.accumulation_steps)
    if settings.fail == "always":
        ctx.log.error("annotation mortal.dev/fail=always: exiting %d", EXIT_RETRYABLE)
        return EXIT_RETRYABLE
    spec = ctx.run.spec
    step, version, lineage = resume(ctx)
    if step > 0:  # the checkpoint's weights, published again as a new version (as the real actor does): the
        latest = ctx.store.latest_weights(ctx.worker.run)  # newest one may be a killed actor's later weights
        version = publish(ctx, step, version if latest is None else latest.version + 1)
        lineage.published.append(version)
    ctx.report(step=step, weight_version=version)
    ctx.store.reset_tasks(ctx.worker, from_step=step + 1)
    checkpointed = step
    while step < spec.algorithm.max_steps and not ctx.stopping.is_set():
        started = time.monotonic()
        with ctx.activity(f"step {step + 1}"):
            stall_here(ctx, settings, "step", step + 1)
            results = gather(ctx, step + 1, version, settings)
            if results is None:
                break
            ctx.stopping.wait(max(0.0, settings.step_seconds - (time.monotonic() - started)))
        step += 1
        lineage.trained(
            step, [r["row"] for r in results], [r.get("weight_version", -1) for r in results], version
        )
        if step % spec.sync.every == 0 or step == spec.algorithm.max_steps:
            version = publish(ctx, step, version + 1)
            lineage.published.append(version)
        rewards = [_total_reward(ctx.run, r) for r in results]
        metrics = _metrics(rewards, time.monotonic() - started)
        ctx.store.add_metrics(ctx.worker, step, metrics)
        ctx.log.info("step %d: reward %.4f, weight version %d", step, metrics["reward"], version)
        ctx.report(step=step, weight_version=version)
        if step % spec.checkpoint.every == 0 or step == spec.algorithm.max_steps:
            checkpoint(ctx, step, version, lineage)
            checkpointed = step
    if step > checkpointed:  # stopped between checkpoints: keep the progress
        checkpoint(ctx, step, version, lineage)
    ctx.log.info("actor done at step %d (weight version %d)", step, version)
    return EXIT_SUCCEEDED


def _threshold(fail: str) -> int:
    try:
        return int(fail.removeprefix(OOM_ABOVE))
    except ValueError:
        raise FatalWorkerError(
            "InvalidAnnotation", f"mortal.dev/fail: {fail!r}: expected {OOM_ABOVE}N"
        ) from None


def resume(ctx: WorkerContext) -> tuple[int, int, Lineage]:
    """(step, weight version, lineage) to continue from: the latest complete checkpoint's, or a fresh start
    (step 0, the newest weights' version: a fresh run has none, so 0)."""
    ckpt = ctx.store.latest_checkpoint(ctx.worker.run)
    if ckpt is None:
        latest = ctx.store.latest_weights(ctx.worker.run)
        return 0, latest.version if latest else 0, Lineage([], [])
    try:
        folder = tree_inside(paths.checkpoints_dir(ctx.worker.run), ckpt.path)
    except PathOutside as exc:  # never read: the run fails rather than resume from what is not its own
        report_refused(ctx.store, ctx.worker.run, f"resuming from checkpoint step-{ckpt.step}", exc)
        raise FatalWorkerError("CheckpointRefused", f"checkpoint of step {ckpt.step}: {exc}") from exc
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise FatalWorkerError("CheckpointUnreadable", f"checkpoint of step {ckpt.step}: {exc}") from exc
    ctx.log.info("resuming from checkpoint of step %d", int(state["step"]))
    return int(state["step"]), int(state["weight_version"]), Lineage.of(state)


def gather(ctx: WorkerContext, step: int, version: int, settings: Settings) -> list[dict[str, Any]] | None:
    """Enqueue the step's prompts and wait for every result; None if told to stop first.

    With no rollout replicas (now: the spec is re-read, it scales while running) the actor serves
    the tasks itself.
    """
    algo = ctx.run.spec.algorithm
    # as the real feed queues ahead
    for ahead in range(step, min(step + algo.max_staleness, algo.max_steps) + 1):
        ctx.store.enqueue_tasks(
            ctx.worker, [_task(ctx.run, ahead, slot, version) for slot in range(algo.prompts_per_step)]
        )
    replicas, checked = ctx.run.spec.rollout.replicas, time.monotonic()
    while not ctx.stopping.is_set():
        states = ctx.store.step_states(ctx.worker.run, step)  # polled as the real actor polls (feed.collect)
        if len(states) == algo.prompts_per_step and all(state == "done" for state in states):
            rows = ctx.store.step_results(ctx.worker.run, step)
            if len(rows) == algo.prompts_per_step and all(r.state == "done" for r in rows):
                return [r.result or {} for r in rows]
        if time.monotonic() - checked > 1.0:
            replicas, checked = _rollout_replicas(ctx), time.monotonic()
        if replicas > 0 or serve_one(ctx, settings) is None:
            ctx.stopping.wait(POLL_SECONDS)
    return None


def _task(run: TrainingRun, step: int, slot: int, version: int) -> NewTask:
    algo = run.spec.algorithm
    row = schedule.prompt_slots(algo.seed, step - 1, algo.prompts_per_step, SIMULATED_ROWS)[slot]
    request = RolloutRequest(
        prompt=f"simulated prompt {step}.{slot}",
        row={"step": step, "slot": slot, "row": f"row {row}"},
        num_generations=algo.num_generations,
        seed=algo.seed * 1_000_003 + step * 1_000 + slot,
    )
    # as the real feed: at least the version current when queued, so at most maxStaleness behind when trained
    return NewTask(step=step, slot=slot, min_weight_version=version, payload=request.model_dump(mode="json"))


def _rollout_replicas(ctx: WorkerContext) -> int:
    spec = ctx.store.get_run(ctx.worker.run).spec
    return int(spec.get("rollout", {}).get("replicas", 1))


def publish(ctx: WorkerContext, step: int, version: int) -> int:
    """Write weights v`version`, record them, drop all but the newest few."""
    final = paths.weights_dir(ctx.worker.run) / f"v{version}-i{ctx.worker.incarnation}"
    write_dir_atomically(ctx, final, {"weights.json": {"version": version, "step": step}})
    ctx.store.publish_weights(ctx.worker, version, step, str(final))
    for old in ctx.store.list_weights(ctx.worker.run)[:-KEEP_WEIGHTS]:
        ctx.store.delete_weights(ctx.worker, old.version)
    sweep(final.parent, {w.path for w in ctx.store.list_weights(ctx.worker.run)})
    return version


def checkpoint(ctx: WorkerContext, step: int, version: int, lineage: Lineage) -> None:
    """Write checkpoint `step`, record it, keep the newest `checkpoint.keep`."""
    final = paths.checkpoints_dir(ctx.worker.run) / f"step-{step}-i{ctx.worker.incarnation}"
    state = {"step": step, "weight_version": version, "published": lineage.published, "steps": lineage.steps}
    write_dir_atomically(ctx, final, {STATE_FILE: state})
    ctx.store.record_checkpoint(ctx.worker, step, str(final), version)
    for old in ctx.store.list_checkpoints(ctx.worker.run)[: -ctx.run.spec.checkpoint.keep]:
        ctx.store.delete_checkpoint(ctx.worker, old.step)
    sweep(final.parent, {c.path for c in ctx.store.list_checkpoints(ctx.worker.run, complete_only=False)})


def write_dir_atomically(ctx: WorkerContext, final: Path, files: dict[str, Any]) -> None:
    """JSON files in a directory that appears whole (mortal.workers.atomic).

    Files cannot be fenced the way store writes are: a worker paused between its last fence check
    and the rename still renames when it wakes. So every directory name carries the incarnation
    (a zombie can never replace a newer incarnation's files), the store row is the commit point,
    and `sweep` later removes directories no row points to.
    """
    with atomic_dir(final) as tmp:
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content))
        ctx.check_fence()


def _total_reward(run: TrainingRun, result: dict[str, Any]) -> float:
    """Mean over the task's completions of the weighted sum of its reward functions' scores."""
    weights = dict(zip(reward_names(run.spec.rewards), (r.weight for r in run.spec.rewards), strict=True))
    scores = result.get("rewards", {})
    n = len(result.get("completion_ids", [])) or 1
    return sum(weights.get(name, 1.0) * (s or 0.0) for name, col in scores.items() for s in col) / n


def _metrics(rewards: list[float], seconds: float) -> dict[str, float]:
    mean = statistics.fmean(rewards) if rewards else 0.0
    std = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    return {"reward": mean, "reward_std": std, "loss": 1.0 - mean, "step_seconds": seconds}


# -- rollout -----------------------------------------------------------------------------------
def run_rollout(ctx: WorkerContext) -> int:
    """Serve tasks until told to stop."""
    settings = Settings.of(ctx.run)
    rewards = None
    if settings.call_rewards:
        rewards = RewardSet.from_spec(ctx.run.spec.rewards, ctx.run.spec.algorithm.max_steps, ctx.run_dir)
        rewards.on_timeout = lambda timeout: ctx.warn("RewardTimeout", timeout.describe(ctx.name))
    while not ctx.stopping.is_set():
        task = serve_one(ctx, settings, rewards)
        if task is None:
            ctx.stopping.wait(POLL_SECONDS)
        else:
            ctx.report(step=task.step, weight_version=(task.result or {}).get("weight_version"))
    return EXIT_SUCCEEDED


def serve_one(ctx: WorkerContext, settings: Settings, rewards: RewardSet | None = None) -> TaskRow | None:
    """Lease one task the newest weights may answer, "generate", score it (with `rewards`, else the fixed
    score), complete it; the task, or None if none was free."""
    latest = ctx.store.latest_weights(ctx.worker.run)
    version = latest.version if latest else 0
    task = ctx.store.lease_task(ctx.worker, settings.task_lease_seconds, max_weight_version=version)
    if task is None:
        return None
    if settings.fail == "oom-rollout" and ctx.worker.role == "rollout":
        raise_torch_out_of_memory()
    with ctx.activity(f"task {task.step}.{task.slot}"):
        if ctx.worker.role == "rollout":
            stall_here(ctx, settings, "task", task.step)
        started = time.monotonic()
        time.sleep(settings.generate_seconds)
        task.result = simulated_result(ctx.run, task, version, time.monotonic() - started, rewards)
    if not ctx.store.complete_task(ctx.worker, task.id, task.lease_token, task.result):
        ctx.log.warning("task %d.%d: lease lost before completion", task.step, task.slot)
    return task


def simulated_result(
    run: TrainingRun, task: TaskRow, version: int, seconds: float, rewards: RewardSet | None = None
) -> dict[str, Any]:
    """A RolloutResult of fixed tokens, every completion scored simulated_reward(step), or by `rewards`."""
    request = RolloutRequest.model_validate(task.payload)
    n = request.num_generations
    completion_ids = [[task.step, task.slot, g] for g in range(n)]
    completions = [f"simulated completion {task.step}.{task.slot}.{g}" for g in range(n)]
    if rewards is not None:
        # the simulated steps count from 1; a reward sees TRL's global_step, the steps trained before
        scores = rewards.score(request.prompt, completions, completion_ids, request.row, step=task.step - 1)
    else:
        scores = {name: [simulated_reward(task.step)] * n for name in reward_names(run.spec.rewards)}
    result = RolloutResult(
        prompt_ids=[1, 2, 3],
        completion_ids=completion_ids,
        logprobs=[[-1.0, -1.0, -1.0] for _ in range(n)],
        completions=completions,
        rewards=scores,
        weight_version=version,
        generation_seconds=seconds,
    )
    row = RolloutRequest.model_validate(task.payload).row.get("row")
    # which dataset row it answered (the lineage's record)
    return {**result.model_dump(mode="json"), "row": row}


# torch 2.x's caching allocator, word for word (c10/cuda/CUDACachingAllocator.cpp), as an 80 GB GPU prints it.
TORCH_OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "1.23 GiB is free. Process 48213 has 77.95 GiB memory in use. Of the allocated memory 70.10 GiB is "
    "allocated by PyTorch, and 6.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
    "See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def raise_torch_out_of_memory() -> None:
    """Raise what a real worker gets when an allocation does not fit (torch.cuda.OutOfMemoryError)."""
    import torch

    raise torch.cuda.OutOfMemoryError(TORCH_OOM_MESSAGE)
