"""The actor's side of the rollout queue: enqueue each step's prompts, wait for the scored groups.

Called by mortal.workers.actor.loop from TRL's rollout_func, once per optimizer step. Step s's prompts
are the rows `schedule.prompt_slots(seed, s, ...)`, cut into fixed chunks (`schedule.task_chunks`,
rollout.promptsPerTask): one task per chunk, a `RolloutTask` of `RolloutRequest`s (the row,
numGenerations, a seed that depends only on (seed, step, slot)), generated in one batch. While
the actor trains step s, the tasks of steps s..s+maxStaleness exist, each asking for weights of
at least the version current when it was enqueued, so a sample is at most maxStaleness versions
old when it is trained on (0: on-policy, when weights are published every step). Results come back
in slot order, flattened to one entry per completion, with the version that generated them.
It must not train, publish weights or touch TRL; waiting ends early (StopRequested) when the
worker is asked to stop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mortal.state.store import STALE_ROLLOUTS, NewTask, Store, WorkerRef
from mortal.state.tables import TaskRow
from mortal.workers import schedule
from mortal.workers.doorbell import TASKS, Doorbell
from mortal.workers.messages import RolloutAnswer, RolloutRequest, RolloutResult, RolloutTask

log = logging.getLogger("mortal.feed")


class StopRequested(Exception):
    """The worker was asked to stop while waiting for rollouts (the step is abandoned, not trained)."""


class BadRollout(RuntimeError):
    """A rollout result does not have the shape the task asked for (a rollout-side bug)."""


@dataclass
class StepBatch:
    """One step's completions, flattened in slot order (G consecutive entries per prompt)."""

    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[dict[str, float | None]] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)  # the dataset's prompt (text or chat messages)
    completions: list[Any] = field(default_factory=list)  # decoded text or [{'role': 'assistant', ...}]
    extra: list[dict[str, Any]] = field(default_factory=list)  # log_extra columns, this completion's values
    tool_masks: list[list[int]] = field(default_factory=list)  # tool-calling runs: 0 on tool-result tokens
    turns: list[int] = field(default_factory=list)  # tool-calling runs: model turns, calls, failed calls
    tool_calls: list[int] = field(default_factory=list)
    tool_failures: list[int] = field(default_factory=list)
    generation_seconds: float = 0.0
    reward_seconds: float = 0.0
    weight_load_seconds: float = 0.0
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)

    def metrics(self, step: int, weights_step: Callable[[int], int]) -> dict[str, float]:
        """Staleness (optimizer steps between the sampling weights and the trained ones) and volumes.

        `weights_step(version)` is the step a version's weights are the result of; with sync.every 1
        the staleness in steps equals the one in versions. Values reward functions passed to
        `log_metric` are averaged over the step under their own names, as TRL reports them.
        `rewards/<name>/scored` is the fraction of samples each reward scored (not None): TRL's own
        `rewards/<name>/mean` is NaN, so dropped, when it scored none, and the controller's
        RewardHealthy condition needs to tell that from a step without metrics."""
        staleness = [step - weights_step(v) for v in self.weight_versions]
        logged = {name: sum(values) / len(values) for name, values in self.logged_metrics.items() if values}
        names = dict.fromkeys(name for scores in self.rewards for name in scores)
        scored = {
            f"rewards/{name}/scored": sum(s.get(name) is not None for s in self.rewards) / len(self.rewards)
            for name in names
        }
        return (
            logged
            | scored
            | self._tool_metrics()
            | {
                "staleness/mean": sum(staleness) / len(staleness),
                "staleness/max": float(max(staleness)),
                "completion_tokens": float(sum(len(c) for c in self.completion_ids)),
                "rollout/generation_seconds": self.generation_seconds,
                "rollout/reward_seconds": self.reward_seconds,
                "weights/load_seconds": self.weight_load_seconds,
            }
        )

    def _tool_metrics(self) -> dict[str, float]:
        """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed / calls, 0
        without calls), the fraction of completions that called a tool at least once (tools/call_rate: what
        rises while a model learns to use one) and the mean model turns per completion; nothing when the run
        calls no tools."""
        if not self.turns:
            return {}
        calls = sum(self.tool_calls)
        return {
            "tools/call_frequency": calls / len(self.tool_calls),
            "tools/failure_frequency": sum(self.tool_failures) / calls if calls else 0.0,
            "tools/call_rate": sum(n > 0 for n in self.tool_calls) / len(self.tool_calls),
            "tools/turns": sum(self.turns) / len(self.turns),
        }

    def env_masks(self) -> list[list[int]] | None:
        """One loss mask per completion (TRL's env_mask) when the run calls tools, else None."""
        return self.tool_masks or None

    def decoded_texts(self) -> list[str] | None:
        """Each completion's text as the rollout decoded it (tokenizer.decode(ids, skip_special_tokens=True),
        workers.models.completion_message): what TRL would decode from completion_ids again. None for
        tool-calling rollouts, whose completions are several messages, not one decode of their ids."""
        if self.tool_masks:
            return None
        texts = [c if isinstance(c, str) else _single_message_text(c) for c in self.completions]
        return None if any(t is None for t in texts) else texts


@dataclass
class RolloutFeed:
    """Enqueues and collects one run's rollout tasks."""

    store: Store
    worker: WorkerRef
    rows: list[dict[str, Any]]
    seed: int
    prompts_per_step: int
    num_generations: int
    max_staleness: int
    max_steps: int
    reward_names: list[str]
    stopping: threading.Event
    prompts_per_task: int = 1
    # between looks at the step's tasks (one indexed query each); actor.py: 0.02 on a GPU
    poll_seconds: float = 0.05
    doorbell: Doorbell = field(default_factory=lambda: Doorbell(None))  # rings TASKS when tasks are enqueued;
    # its RESULTS ring ends a wait early (a silent one where the backend does not ring)
    _enqueued: set[int] = field(default_factory=set)

    @property
    def tasks_per_step(self) -> int:
        return len(schedule.task_chunks(self.prompts_per_step, self.prompts_per_task))

    def tasks_for(self, step: int, min_weight_version: int) -> list[NewTask]:
        """Step `step`'s tasks; a task's `slot` is its chunk's index, its payload says the first prompt
        slot."""
        rows = schedule.prompt_slots(self.seed, step, self.prompts_per_step, len(self.rows))
        tasks = []
        for index, chunk in enumerate(schedule.task_chunks(self.prompts_per_step, self.prompts_per_task)):
            requests = [self._request(step, slot, self.rows[rows[slot]]) for slot in chunk]
            payload = RolloutTask(requests=requests, first_slot=chunk.start).model_dump()
            tasks.append(
                NewTask(step=step, slot=index, min_weight_version=min_weight_version, payload=payload)
            )
        return tasks

    def _request(self, step: int, slot: int, row: dict[str, Any]) -> RolloutRequest:
        return RolloutRequest(
            prompt=row["prompt"],
            row=row,
            num_generations=self.num_generations,
            seed=schedule.task_seed(self.seed, step, slot),
        )

    def enqueue(self, step: int, current_version: int) -> int:
        """Make sure the tasks of steps step..step+maxStaleness exist; returns how many were new."""
        new = 0
        for s in schedule.steps_to_enqueue(step, self.max_staleness, self.max_steps):
            if s not in self._enqueued:
                new += self.store.enqueue_tasks(self.worker, self.tasks_for(s, current_version))
                self._enqueued.add(s)
        if new:
            self.doorbell.ring(TASKS)
        return new

    def forget_from(self, step: int) -> None:
        """Delete the queue's tasks of steps >= step (a resume starts them again)."""
        self.store.reset_tasks(self.worker, from_step=step)
        self._enqueued = {s for s in self._enqueued if s < step}

    def collect(
        self,
        step: int,
        current_version: int,
        on_stop: Callable[[], None] = lambda: None,
        while_waiting: Callable[[], None] = lambda: None,
    ) -> StepBatch:
        """Wait until every task of `step` is done; StopRequested (after `on_stop`) if asked to stop.
        `while_waiting` is called at each look (the actor's check that its published weights are still
        held: WeightPublisher.ensure_held, which decides itself how often to look)."""
        while True:
            states = self.store.step_states(self.worker.run, step)  # polled: no payloads, no results
            if len(states) < self.tasks_per_step:  # deleted under us (a reset): ask again
                self.store.enqueue_tasks(self.worker, self.tasks_for(step, current_version))
                self.doorbell.ring(TASKS)
            elif all(state == "done" for state in states):
                rows = self.store.step_results(self.worker.run, step)  # once; a reset in between: look again
                if len(rows) == self.tasks_per_step and all(r.state == "done" for r in rows):
                    stale = [r for r in rows if _weight_version(r.result) < r.min_weight_version]
                    if not stale:
                        return self._flatten(rows)
                    self._requeue(step, current_version, len(stale))
            if self.stopping.is_set():
                on_stop()
                raise StopRequested(f"stopping while waiting for the rollouts of step {step}")
            while_waiting()
            self.doorbell.wait(self.poll_seconds)  # a rollout's RESULTS ring ends it at once

    def _requeue(self, step: int, current_version: int, n_stale: int) -> None:
        """Results older than their task allows (late answers to a task since reset): redo the step."""
        log.warning(
            "step %d: %d results came from weights older than their task asked for; redoing it", step, n_stale
        )
        self.store.add_event(
            self.worker.run,
            "Warning",
            STALE_ROLLOUTS,  # counted by describe's ledger
            f"step {step}: {n_stale} task(s) answered with weights older than asked; step queued again",
        )
        self.forget_from(step)
        self.store.enqueue_tasks(self.worker, self.tasks_for(step, current_version))
        self._enqueued.add(step)
        self.doorbell.ring(TASKS)

    def _flatten(self, rows: list[TaskRow]) -> StepBatch:
        batch = StepBatch()
        for row in rows:
            answer = RolloutAnswer.model_validate(row.result)
            task = RolloutTask.model_validate(row.payload)
            if len(answer.results) != len(task.requests):
                raise BadRollout(
                    f"step {row.step} task {row.slot}: {len(answer.results)} results for "
                    f"{len(task.requests)} prompts"
                )
            for offset, result in enumerate(answer.results):
                self._check(row.step, task.first_slot + offset, result)
                self._add(batch, task.requests[offset].prompt, result)
        return batch

    def _add(self, batch: StepBatch, prompt: Any, result: RolloutResult) -> None:
        for g in range(self.num_generations):
            prompt_ids = result.sample_prompt_ids[g] if result.sample_prompt_ids else result.prompt_ids
            batch.prompt_ids.append(list(prompt_ids))
            batch.completion_ids.append(list(result.completion_ids[g]))
            batch.logprobs.append(list(result.logprobs[g]))
            batch.rewards.append({name: result.rewards[name][g] for name in self.reward_names})
            batch.weight_versions.append(result.weight_version)
            batch.prompts.append(prompt)
            batch.completions.append(result.completions[g] if g < len(result.completions) else "")
            batch.extra.append(
                {column: values[g] for column, values in result.logged_extra.items() if g < len(values)}
            )
            if result.tool_masks is not None:
                batch.tool_masks.append(list(result.tool_masks[g]))
                batch.turns.append(result.turns[g])
                batch.tool_calls.append(result.tool_calls[g])
                batch.tool_failures.append(result.tool_failures[g])
        batch.generation_seconds += result.generation_seconds
        batch.reward_seconds += result.reward_seconds
        batch.weight_load_seconds = max(batch.weight_load_seconds, result.weight_load_seconds)
        for name, values in result.logged_metrics.items():
            batch.logged_metrics.setdefault(name, []).extend(values)

    def _check(self, step: int, slot: int, result: RolloutResult) -> None:
        g = self.num_generations
        where = f"step {step} slot {slot}"
        if len(result.completion_ids) != g or len(result.logprobs) != g:
            raise BadRollout(f"{where}: {len(result.completion_ids)} completions, expected {g}")
        for ids, logps in zip(result.completion_ids, result.logprobs, strict=True):
            if len(ids) != len(logps):
                raise BadRollout(f"{where}: {len(ids)} tokens but {len(logps)} logprobs")
        if result.tool_masks is not None:
            if len(result.tool_masks) != g or any(
                len(m) != len(ids) for m, ids in zip(result.tool_masks, result.completion_ids, strict=True)
            ):
                raise BadRollout(f"{where}: the tool masks do not have one entry per completion token")
            if not (len(result.turns) == len(result.tool_calls) == len(result.tool_failures) == g):
                raise BadRollout(f"{where}: turns or tool counts missing for some of the {g} completions")
        if result.sample_prompt_ids is not None and len(result.sample_prompt_ids) != g:
            raise BadRollout(f"{where}: {len(result.sample_prompt_ids)} per-completion prompts, expected {g}")
        for name in self.reward_names:
            if len(result.rewards.get(name, [])) != g:
                raise BadRollout(f"{where}: reward {name!r} has no score for each of the {g} completions")


def _weight_version(result: dict[str, Any] | None) -> int:
    """The weight version a task's answer was generated with (-1: none or unreadable)."""
    results = (result or {}).get("results") or [{}]
    return results[0].get("weight_version", -1)


def _single_message_text(completion: Any) -> str | None:
    """The content of [{'role': 'assistant', 'content': text}], a chat prompt's completion; None otherwise."""
    if isinstance(completion, list) and len(completion) == 1 and isinstance(completion[0], dict):
        content = completion[0].get("content")
        return content if isinstance(content, str) else None
    return None
