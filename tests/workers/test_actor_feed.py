"""mortal.workers.feed: the actor's side of the task queue (enqueue ahead, collect in slot order)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from actor_helpers import create_run, worker_context

from mortal.workers import schedule
from mortal.workers.feed import BadRollout, RolloutFeed, StopRequested
from mortal.workers.messages import RolloutRequest, RolloutResult

SPEC = {
    "model": {"name": "/nonexistent/model"},
    "dataset": {"name": "builtin:arith"},
    "rewards": [{"function": "m:a"}, {"function": "m:b"}],
}
ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
G = 2


@pytest.fixture
def setup(store) -> tuple[Any, RolloutFeed, Any]:
    run = create_run(store, "f", SPEC)
    actor = worker_context(store, run, "actor")
    rollout = worker_context(store, run, "rollout")
    feed = RolloutFeed(actor.store, actor.worker, ROWS, seed=3, prompts_per_step=2, num_generations=G,
                       max_staleness=1, max_steps=4, reward_names=["a", "b"], stopping=threading.Event(),
                       poll_seconds=0.01)
    return store, feed, rollout


def _answer_all(store: Any, rollout: Any, version: int, completions: int = G,
                reported_version: int | None = None) -> list[int]:
    """Lease and complete every claimable task as a rollout holding weights `version`; their steps."""
    steps = []
    while (task := store.lease_task(rollout.worker, 30, max_weight_version=version)) is not None:
        request = RolloutRequest.model_validate(task.payload)
        result = RolloutResult(
            prompt_ids=[task.slot], completion_ids=[[task.step, task.slot, g] for g in range(completions)],
            logprobs=[[-0.1] * 3 for _ in range(completions)], completions=["x"] * completions,
            rewards={"a": [float(g) for g in range(completions)], "b": [None] * completions},
            weight_version=version if reported_version is None else reported_version,
            logged_metrics={"judge_calls": [float(task.slot + 1)]},
        )
        assert request.num_generations == G and request.row["prompt"] == request.prompt
        assert store.complete_task(rollout.worker, task.id, task.lease_token, result.model_dump())
        steps.append(task.step)
    return steps


def test_tasks_follow_the_schedule_and_run_ahead_by_max_staleness(setup) -> None:
    store, feed, _ = setup
    assert feed.enqueue(0, current_version=7) == 4  # steps 0 and 1, two prompts each
    assert feed.enqueue(0, current_version=7) == 0
    tasks = store.step_results("f", 1)
    assert [t.min_weight_version for t in tasks] == [7, 7]
    wanted = schedule.prompt_slots(3, 1, 2, len(ROWS))
    assert [t.payload["prompt"] for t in tasks] == [ROWS[i]["prompt"] for i in wanted]
    assert [t.payload["seed"] for t in tasks] == [schedule.task_seed(3, 1, s) for s in (0, 1)]
    assert feed.enqueue(3, current_version=9) == 2  # step 3 is the last: nothing beyond it


def test_collect_flattens_groups_in_slot_order_with_their_versions(setup) -> None:
    store, feed, rollout = setup
    feed.enqueue(0, current_version=0)
    assert sorted(_answer_all(store, rollout, version=0)) == [0, 0, 1, 1]
    batch = feed.collect(1, current_version=1)
    assert batch.completion_ids == [[1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
    assert batch.prompt_ids == [[0], [0], [1], [1]]
    assert batch.rewards == [{"a": 0.0, "b": None}, {"a": 1.0, "b": None}] * 2
    assert batch.weight_versions == [0] * 4
    metrics = batch.metrics(step=1, weights_step=lambda version: version)
    assert metrics["staleness/mean"] == 1.0 and metrics["staleness/max"] == 1.0
    assert metrics["completion_tokens"] == 12.0
    assert metrics["judge_calls"] == 1.5, "a reward's log_metric values are averaged over the step, as in TRL"


def test_a_result_older_than_its_task_allows_is_redone(setup) -> None:
    store, feed, rollout = setup
    feed.enqueue(0, current_version=2)
    # a late answer from weights v1 (e.g. to a task deleted by a resume, then enqueued again for v2)
    assert sorted(_answer_all(store, rollout, version=2, reported_version=1)) == [0, 0, 1, 1]
    answered: list[int] = []

    def answer_again() -> None:
        while not answered:
            answered.extend(_answer_all(store, rollout, version=2))

    helper = threading.Timer(0.2, answer_again)
    helper.start()
    batch = feed.collect(0, current_version=2)
    helper.join()
    assert batch.weight_versions == [2] * 4 and answered


def test_a_result_of_the_wrong_shape_is_refused(setup) -> None:
    store, feed, rollout = setup
    feed.enqueue(0, current_version=0)
    while (task := store.lease_task(rollout.worker, 30, max_weight_version=0)) is not None:
        result = RolloutResult(prompt_ids=[1], completion_ids=[[1]], logprobs=[[0.0]], completions=["x"],
                               rewards={"a": [1.0], "b": [1.0]}, weight_version=0)
        store.complete_task(rollout.worker, task.id, task.lease_token, result.model_dump())
    with pytest.raises(BadRollout, match="1 completions, expected 2"):
        feed.collect(0, current_version=0)


def test_a_stop_request_ends_the_wait_after_the_stop_hook(setup) -> None:
    _, feed, _ = setup
    feed.enqueue(0, current_version=0)
    feed.stopping.set()
    hooked = []
    with pytest.raises(StopRequested):
        feed.collect(0, current_version=0, on_stop=lambda: hooked.append(True))
    assert hooked == [True]


def test_forget_from_deletes_the_tasks_of_later_steps(setup) -> None:
    store, feed, _ = setup
    feed.enqueue(0, current_version=0)
    feed.enqueue(1, current_version=0)
    feed.forget_from(1)
    assert len(store.step_results("f", 0)) == 2 and store.step_results("f", 1) == []
    assert feed.enqueue(1, current_version=5) == 4
