"""The rollout worker: lease a task (a chunk of prompts), sample `numGenerations` completions of each in one
batch, score them, hand them back.

Who calls it: mortal.workers.main (`main(ctx)`, role rollout). Until ctx.stopping: load the newest recorded
weight version if it is newer (between tasks only, by the transport its row names: mortal.workers.sync),
lease the oldest task those weights may answer, generate (mortal.workers.rollout.multiturn for tool-calling
runs), score with every reward beside generation (so scoring scales with replicas), and complete the task
with a RolloutAnswer. Until a version is recorded the model of spec.model.name is version 0. A task's lease
is renewed while it is worked on; a worker that dies loses nothing (its tasks are queued again and answered
with the same seeds). It also ends by itself when idle and the run's newest actor Succeeded at maxSteps, so
nothing is left running if the controller is gone.
What it must not do: write anything but its tasks' results and its heartbeat, or swallow a broken reward,
dataset or model, or a prompt longer than the model takes (FatalWorkerError: the run fails with the reason).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from mortal.state import TaskRow
from mortal.state.containment import PathOutside, report_refused
from mortal.workers.doorbell import RESULTS, TASKS, Doorbell
from mortal.workers.errors import FatalWorkerError
from mortal.workers.messages import RolloutAnswer, RolloutRequest, RolloutResult, RolloutTask, extra_columns
from mortal.workers.models import (
    completion_message,
    encode_prompt,
    load_tokenizer,
    resolve_dtype,
    set_threads,
    worker_device,
)
from mortal.workers.rewards import RewardSet
from mortal.workers.rollout.engines import Engine, GenerationParams, select_engine
from mortal.workers.rollout.multiturn import MultiTurn, Rollout, fitting
from mortal.workers.rollout.tools import Toolbox
from mortal.workers.runtime import EXIT_SUCCEEDED, WorkerContext, startup_objects_frozen
from mortal.workers.sync import UnknownSyncMethod, transport_for
from mortal.workers.sync.base import WeightTransport

# Between looks for a task. On a GPU a whole step takes about a second, so the wait is latency worth
# cutting; on a CPU a step takes seconds and each look is a store query that competes for its cores.
IDLE_SECONDS = {"gpu": 0.02, "cpu": 0.1}
# A version that is still the newest but cannot be fetched (sync ray: the actor's hub lost it, until the
# actor puts it back) is tried again after 0.1 s, then twice as late each time, at most every 5 s.
MISSING_RETRY_SECONDS, MISSING_RETRY_MAX_SECONDS = 0.1, 5.0
# While idle, how often it looks whether the run's training has ended (one store query).
FINISHED_CHECK_SECONDS = 5.0
LEASE_ANNOTATION = "mortal.dev/task-lease-seconds"
DEFAULT_LEASE_SECONDS = 60.0


def task_lease_seconds(ctx: WorkerContext) -> float:
    """How long a leased task stays ours without renewal (annotation, as the simulated workload reads it)."""
    value = ctx.run.metadata.annotations.get(LEASE_ANNOTATION)
    try:
        return float(value) if value is not None else DEFAULT_LEASE_SECONDS
    except ValueError as exc:
        raise FatalWorkerError("InvalidAnnotation", f"{LEASE_ANNOTATION}={value!r} is not a number") from exc


class RolloutWorker:
    """The worker's state between tasks: engine, tokenizer, rewards, loaded weight version."""

    def __init__(
        self,
        ctx: WorkerContext,
        engine: Engine,
        tokenizer: Any,
        rewards: RewardSet,
        toolbox: Toolbox | None = None,
    ) -> None:
        self.ctx = ctx
        self.engine = engine
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.params = GenerationParams.from_spec(ctx.run.spec.generation)
        self.multiturn = (
            MultiTurn(engine, tokenizer, toolbox, self.params, ctx.run.spec.rollout.chat_template)
            if toolbox is not None
            else None
        )
        self.lease_seconds = task_lease_seconds(ctx)
        self.published_version: int | None = None  # None: still the weights of spec.model.name
        self.load_seconds = 0.0  # how long loading the current version took
        # (newest version, failed loads, monotonic time of the next try)
        self._missing: tuple[int, int, float] | None = None
        self._transports: dict[str, WeightTransport] = {}  # by method: how each version's row says it travels
        # heard from before the first look at the store, so no ring between a look and the wait is missed
        self.doorbell = Doorbell.for_worker(ctx.run_dir, listens_for=TASKS)

    @property
    def loaded_version(self) -> int:
        return 0 if self.published_version is None else self.published_version

    def refresh_weights(self) -> None:
        """Load the newest published version if it is newer than ours."""
        latest = self.ctx.store.latest_weights(self.ctx.worker.run)
        if latest is None or (
            self.published_version is not None and latest.version <= self.published_version
        ):
            return
        missing = self._missing if self._missing is not None and self._missing[0] == latest.version else None
        if missing is not None and time.monotonic() < missing[2]:
            return  # backing off: the actor has not put this version back yet
        transport = self._transport(latest.method, latest.version)
        started = time.monotonic()
        try:
            with self.ctx.activity(f"weight-load v{latest.version}"):
                self.engine.load_weights(self._local(transport, latest.path, latest.version), transport)
        except FileNotFoundError as exc:  # pruned by the actor between the read and the load (a newer one
            # exists), or lost by sync ray's hub (put back soon)
            tries = 1 if missing is None else missing[1] + 1
            delay = min(MISSING_RETRY_MAX_SECONDS, MISSING_RETRY_SECONDS * 2 ** (tries - 1))
            self._missing = (latest.version, tries, time.monotonic() + delay)
            self.ctx.log.info(
                "weight version %d could not be loaded (%s); reading the store again in %.1f s (try %d)",
                latest.version,
                exc,
                delay,
                tries,
            )
            return
        self._missing = None
        if not self._intact(transport, latest.path):
            return
        self.published_version = latest.version
        self.load_seconds = time.monotonic() - started
        self.ctx.report(weight_version=latest.version)
        self.ctx.log.info("loaded weight version %d in %.4f s", latest.version, self.load_seconds)

    def _transport(self, method: str, version: int) -> WeightTransport:
        """The transport of a version's row (one instance per method); a method none implements is fatal."""
        if method not in self._transports:
            try:
                self._transports[method] = transport_for(method)()
            except UnknownSyncMethod as exc:
                raise FatalWorkerError("WeightsRefused", f"weight version {version}: {exc}") from exc
        return self._transports[method]

    def _local(self, transport: WeightTransport, path: str, version: int) -> str:
        """The folder to load a version from: itself, or (sync ray) this node's copy of what the object store
        holds, fetched first (FileNotFoundError when it is gone); either checked to lie in the run's weights
        folder (a row pointing elsewhere is never loaded: a Warning event, and the run fails,
        WeightsRefused)."""
        try:
            return str(transport.locate(path, self.ctx.worker.run, self.ctx.run.metadata.uid or ""))
        except PathOutside as exc:
            report_refused(self.ctx.store, self.ctx.worker.run, f"loading weight version {version}", exc)
            raise FatalWorkerError("WeightsRefused", f"weight version {version}: {exc}") from exc

    def _intact(self, transport: WeightTransport, path: str) -> bool:
        """A version read from the actor's ring while the actor may have reused its slot is loaded
        again (mortal.workers.sync.ring says why); a version on the volume is always whole."""
        if transport.loaded_whole(path, self._newest_recorded):
            return True
        self.ctx.log.info(
            "weight version in %s may have been overwritten while it loaded; loading the newest", path
        )
        return False

    def _newest_recorded(self) -> int | None:
        latest = self.ctx.store.latest_weights(self.ctx.worker.run)
        return None if latest is None else latest.version

    def serve_one(self) -> bool:
        """Answer one task; False when none was claimable."""
        task = self.ctx.store.lease_task(
            self.ctx.worker, self.lease_seconds, max_weight_version=self.loaded_version
        )
        if task is None:
            return False
        with self.ctx.activity(f"task {task.step}.{task.slot}"), self.keep_leased(task):
            result = self.answer(task)
        if self.ctx.store.complete_task(self.ctx.worker, task.id, task.lease_token, result):
            self.doorbell.ring(RESULTS)
        else:
            self.ctx.log.warning(
                "task %d.%d: lease lost before completion; result dropped", task.step, task.slot
            )
        self.ctx.report(step=task.step)
        return True

    def answer(self, task: TaskRow) -> dict[str, Any]:
        """Generate and score one task: the RolloutAnswer as JSON."""
        requests = RolloutTask.model_validate(task.payload).requests
        started = time.monotonic()
        if self.multiturn is not None:
            conversations = self.multiturn.rollouts(requests)
            generated = time.monotonic() - started
            results = [
                self._scored_turns(task, request, group, generated / len(requests))
                for request, group in zip(requests, conversations, strict=True)
            ]
        else:
            limit = self.engine.max_model_len()
            prompts = [
                fitting(r, encode_prompt(self.tokenizer, r.prompt), self.params.max_tokens, limit)
                for r in requests
            ]
            groups = self.engine.generate(
                prompts, requests[0].num_generations, [r.seed for r in requests], self.params
            )
            generated = time.monotonic() - started
            results = [
                self._scored(task, request, ids, outs, generated / len(requests))
                for request, ids, outs in zip(requests, prompts, groups, strict=True)
            ]
        scored = time.monotonic() - started - generated
        tokens = sum(len(c) for r in results for c in r.completion_ids)
        decode = " ".join(f"{key}={value}" for key, value in self.engine.generation_stats().items())
        self.ctx.log.info(
            "task %d.%d: %d prompts, %d tokens in %.2f s (%.1f tokens/s)%s, rewards in %.3f s, weights v%d",
            task.step,
            task.slot,
            len(requests),
            tokens,
            generated,
            tokens / max(generated, 1e-9),
            f" [decode {decode}]" if decode else "",
            scored,
            self.loaded_version,
        )
        return RolloutAnswer(results=results).model_dump(mode="json")

    def _scored(
        self,
        task: TaskRow,
        request: RolloutRequest,
        prompt_ids: list[int],
        outs: list[Any],
        generation_seconds: float,
    ) -> RolloutResult:
        """One prompt's group, scored by every reward; `generation_seconds` is its share of the batch."""
        started = time.monotonic()
        completion_ids = [c.ids for c in outs]
        completions = [completion_message(self.tokenizer, request.prompt, ids) for ids in completion_ids]
        scores = self.rewards.score(request.prompt, completions, completion_ids, request.row, step=task.step)
        return RolloutResult(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=[c.logprobs for c in outs],
            completions=completions,
            rewards=scores,
            weight_version=self.loaded_version,
            generation_seconds=generation_seconds,
            reward_seconds=time.monotonic() - started,
            weight_load_seconds=self.load_seconds,
            logged_metrics=self.rewards.logs.metrics,
            logged_extra=extra_columns(self.rewards.logs.extra, len(completions)),  # the actor records them
        )

    def _scored_turns(
        self, task: TaskRow, request: RolloutRequest, group: list[Rollout], generation_seconds: float
    ) -> RolloutResult:
        """One prompt's tool-calling rollouts, scored (each completion is its assistant and tool messages,
        as TRL hands them to reward functions; environments are passed as `environments`)."""
        started = time.monotonic()
        completion_ids = [r.completion_ids for r in group]
        with_environments = bool(self.multiturn.toolbox.environments)
        scores = self.rewards.score(
            request.prompt,
            [r.messages for r in group],
            completion_ids,
            request.row,
            step=task.step,
            environments=[r.environment for r in group] if with_environments else None,
            prompts=[r.prompt for r in group] if with_environments else None,
        )
        prompt_ids = group[0].prompt_ids
        differ = any(r.prompt_ids != prompt_ids for r in group)
        return RolloutResult(
            prompt_ids=prompt_ids,
            sample_prompt_ids=[r.prompt_ids for r in group] if differ else None,
            completion_ids=completion_ids,
            logprobs=[r.logprobs for r in group],
            tool_masks=[r.mask for r in group],
            turns=[r.turns for r in group],
            tool_calls=[r.tool_calls for r in group],
            tool_failures=[r.tool_failures for r in group],
            completions=[r.messages for r in group],
            rewards=scores,
            weight_version=self.loaded_version,
            generation_seconds=generation_seconds,
            reward_seconds=time.monotonic() - started,
            weight_load_seconds=self.load_seconds,
            logged_metrics=self.rewards.logs.metrics,
            logged_extra=extra_columns(self.rewards.logs.extra, len(group)),
        )

    @contextlib.contextmanager
    def keep_leased(self, task: TaskRow) -> Iterator[None]:
        """Renew the task's lease every third of its length while the block runs."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.lease_seconds / 3):
                try:
                    if not self.ctx.store.renew_task(
                        self.ctx.worker, task.id, task.lease_token, self.lease_seconds
                    ):
                        self.ctx.log.warning("task %d.%d: lease lost while working", task.step, task.slot)
                        return
                except Exception as exc:  # the store is unreachable for a moment: the next renewal may work
                    self.ctx.log.warning("task %d.%d: lease renewal failed: %s", task.step, task.slot, exc)

        thread = threading.Thread(target=renew, name="mortal-task-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def run(self) -> None:
        idle = IDLE_SECONDS["cpu" if self.ctx.run.spec.rollout.gpu == "none" else "gpu"]
        next_check = time.monotonic() + FINISHED_CHECK_SECONDS
        while not self.ctx.stopping.is_set():
            self.refresh_weights()
            if self.serve_one():
                continue
            if time.monotonic() >= next_check:
                if self.training_finished():
                    self.ctx.log.info("the actor finished at maxSteps: no task will come; exiting")
                    return
                next_check = time.monotonic() + FINISHED_CHECK_SECONDS
            # the actor's TASKS ring (tasks enqueued, weights recorded) ends it at once, a stop too
            self.doorbell.wait(idle, stopping=self.ctx.stopping)

    def training_finished(self) -> bool:
        """The run's newest actor ended Succeeded at maxSteps (the controller's own test,
        controller/plan.py)."""
        actors = [w for w in self.ctx.store.list_workers(self.ctx.worker.run) if w.role == "actor"]
        if not actors:
            return False
        newest = max(actors, key=lambda w: w.incarnation)  # incarnations increase across all of a run's slots
        return newest.state == "Succeeded" and (newest.step or 0) >= self.ctx.run.spec.algorithm.max_steps


def build(ctx: WorkerContext) -> RolloutWorker:
    """Rewards first (a wrong path fails in a second, before any model is loaded), then model and engine.

    Its log line gives the seconds of each part before the engine's own load: on a GPU most of a start
    went elsewhere than the load, and a start is only made shorter where it is known to go."""
    spec = ctx.run.spec
    phases = Phases()
    rewards = RewardSet.from_spec(
        spec.rewards,
        max_steps=spec.algorithm.max_steps,
        run_dir=ctx.run_dir,
        environment_classes_importable=spec.rollout.environment_service.mode != "http",
    )
    rewards.on_timeout = lambda timeout: ctx.warn("RewardTimeout", timeout.describe(ctx.name))
    toolbox = Toolbox.from_spec(spec.rollout) if spec.rollout.uses_tools else None
    if toolbox is not None:
        toolbox.on_timeout = lambda message: ctx.warn("ToolTimeout", f"{ctx.name}: {message}")
    phases.end("rewards")
    set_threads()
    device = worker_device(spec.rollout.gpu, "spec.rollout.gpu")
    phases.end("device")
    engine_cls = select_engine(spec.generation.engine, device)
    phases.end("engine module")
    tokenizer = load_tokenizer(spec.model)
    phases.end("tokenizer")
    model = spec.rollout_model()
    engine = engine_cls.create(
        model,
        tokenizer,
        device=device,
        max_num_seqs=spec.generation.max_num_seqs,
        memory_share=spec.rollout_memory_share(engine_cls.name, ctx.worker.replica),
        compile_scope=spec.generation.compile_scope,
    )
    loaded = phases.end("engine")
    ctx.log.info(
        "engine %s on %s in %s ready in %.1f s (%s); rewards: %s%s",
        engine.name,
        device,
        str(resolve_dtype(model.dtype, device)).removeprefix("torch."),
        loaded,
        phases,
        ", ".join(rewards.names),
        f"; tools: {len(toolbox.tools)}, environments: {len(toolbox.environments)}"
        if toolbox is not None
        else "",
    )
    return RolloutWorker(ctx, engine, tokenizer, rewards, toolbox)


class Phases:
    """Seconds of consecutive parts of a start, for one log line: `end(name)` closes the part begun at the
    previous end (or at creation) and returns its seconds."""

    def __init__(self) -> None:
        self.mark = time.monotonic()
        self.seconds: dict[str, float] = {}

    def end(self, name: str) -> float:
        now = time.monotonic()
        self.seconds[name], self.mark = now - self.mark, now
        return self.seconds[name]

    def __str__(self) -> str:
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())


def main(ctx: WorkerContext) -> int:
    worker = build(ctx)
    ctx.report(weight_version=worker.loaded_version)
    try:
        with startup_objects_frozen():
            worker.run()
    finally:
        worker.engine.close()
        if worker.multiturn is not None:
            worker.multiturn.toolbox.close()  # environment processes or server sessions, where there are any
    return EXIT_SUCCEEDED
