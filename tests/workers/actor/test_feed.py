"""mortal.workers.actor.feed: the actor's side of the task queue (enqueue ahead, collect in slot order).

A task is a RolloutTask, a fixed chunk of one step's prompts (`prompts_per_task` of them, 1 by
default; the last chunk may be shorter); its answer is a RolloutAnswer, one RolloutResult per request."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from actor_helpers import create_run, worker_context

from mortal.workers import schedule
from mortal.workers.actor.feed import BadRollout, RolloutFeed, StopRequested
from mortal.workers.doorbell import RESULTS, TASKS, Doorbell
from mortal.workers.messages import RolloutAnswer, RolloutResult, RolloutTask

SPEC = {
    "model": {"name": "/nonexistent/model"},
    "dataset": {"name": "builtin:arith"},
    "rewards": [{"function": "m:a"}, {"function": "m:b"}],
}
ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
G = 2


def _setup(store: Any, prompts_per_step: int, prompts_per_task: int) -> tuple[Any, RolloutFeed, Any]:
    run = create_run(store, "f", SPEC)
    actor = worker_context(store, run, "actor")
    rollout = worker_context(store, run, "rollout")
    feed = RolloutFeed(
        actor.store,
        actor.worker,
        ROWS,
        seed=3,
        prompts_per_step=prompts_per_step,
        num_generations=G,
        max_staleness=1,
        max_steps=4,
        reward_names=["a", "b"],
        stopping=threading.Event(),
        prompts_per_task=prompts_per_task,
        poll_seconds=0.01,
    )
    return store, feed, rollout


@pytest.fixture
def setup(store) -> tuple[Any, RolloutFeed, Any]:
    """Two prompts a step, one per task (the default, and what a CPU run uses)."""
    return _setup(store, prompts_per_step=2, prompts_per_task=1)


@pytest.fixture
def chunked(store) -> tuple[Any, RolloutFeed, Any]:
    """Five prompts a step in tasks of two: the chunks hold slots [0, 1], [2, 3] and [4]."""
    return _setup(store, prompts_per_step=5, prompts_per_task=2)


def _result(step: int, slot: int, version: int, completions: int = G) -> RolloutResult:
    """A recognizable result for the prompt of one step slot: prompt_ids [slot],
    completion g [step, slot, g]."""
    return RolloutResult(
        prompt_ids=[slot],
        completion_ids=[[step, slot, g] for g in range(completions)],
        logprobs=[[-0.1] * 3 for _ in range(completions)],
        completions=["x"] * completions,
        rewards={"a": [float(g) for g in range(completions)], "b": [None] * completions},
        weight_version=version,
        logged_metrics={"judge_calls": [float(slot + 1)]},
    )


def _answer_all(
    store: Any,
    rollout: Any,
    version: int,
    completions: int = G,
    reported_version: int | None = None,
    drop_last: bool = False,
) -> list[int]:
    """Lease and complete every claimable task as a rollout holding weights `version`; their steps.
    `drop_last`: answer each task of several prompts with one result too few (a broken rollout)."""
    steps = []
    while (task := store.lease_task(rollout.worker, 30, max_weight_version=version)) is not None:
        chunk = RolloutTask.model_validate(task.payload)
        for request in chunk.requests:
            assert request.num_generations == G and request.row["prompt"] == request.prompt
        reported = version if reported_version is None else reported_version
        slots = range(
            chunk.first_slot, chunk.first_slot + len(chunk.requests) - (drop_last and len(chunk.requests) > 1)
        )
        answer = RolloutAnswer(results=[_result(task.step, slot, reported, completions) for slot in slots])
        assert store.complete_task(rollout.worker, task.id, task.lease_token, answer.model_dump())
        steps.append(task.step)
    return steps


def test_tasks_follow_the_schedule_and_run_ahead_by_max_staleness(setup) -> None:
    store, feed, _ = setup
    assert feed.tasks_per_step == 2
    assert feed.enqueue(0, current_version=7) == 4  # steps 0 and 1, two prompts each
    assert feed.enqueue(0, current_version=7) == 0
    tasks = store.step_results("f", 1)
    assert [t.min_weight_version for t in tasks] == [7, 7]
    wanted = schedule.prompt_slots(3, 1, 2, len(ROWS))
    assert [t.payload["requests"][0]["prompt"] for t in tasks] == [ROWS[i]["prompt"] for i in wanted]
    assert [t.payload["requests"][0]["seed"] for t in tasks] == [schedule.task_seed(3, 1, s) for s in (0, 1)]
    assert [(t.slot, t.payload["first_slot"], len(t.payload["requests"])) for t in tasks] == [
        (0, 0, 1),
        (1, 1, 1),
    ]
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


def test_a_step_is_cut_into_fixed_chunks_whose_requests_follow_the_schedule(chunked) -> None:
    store, feed, _ = chunked
    assert feed.tasks_per_step == 3  # ceil(5 / 2)
    assert feed.enqueue(0, current_version=4) == 6  # steps 0 and 1, three tasks each
    for step in (0, 1):
        tasks = store.step_results("f", step)
        assert [t.slot for t in tasks] == [0, 1, 2]  # a task's slot is its chunk's index
        assert all(t.min_weight_version == 4 for t in tasks)
        chunks = [RolloutTask.model_validate(t.payload) for t in tasks]
        assert [(c.first_slot, len(c.requests)) for c in chunks] == [(0, 2), (2, 2), (4, 1)]
        requests = [r for c in chunks for r in c.requests]
        wanted = schedule.prompt_slots(3, step, 5, len(ROWS))
        assert [r.row for r in requests] == [ROWS[i] for i in wanted]
        assert [r.prompt for r in requests] == [ROWS[i]["prompt"] for i in wanted]
        assert [r.seed for r in requests] == [schedule.task_seed(3, step, slot) for slot in range(5)]
        assert all(r.num_generations == G for r in requests)


def test_the_tasks_of_a_step_are_the_same_whenever_they_are_made(chunked) -> None:
    """A chunk is one engine batch on a GPU: its prompts depend on (seed, step, spec) alone."""
    store, feed, _ = chunked
    first = [t.payload for t in feed.tasks_for(2, min_weight_version=0)]
    assert [t.payload for t in feed.tasks_for(2, min_weight_version=9)] == first


def test_collect_flattens_chunked_answers_in_slot_order(chunked) -> None:
    store, feed, rollout = chunked
    feed.enqueue(0, current_version=0)
    assert sorted(_answer_all(store, rollout, version=0)) == [0, 0, 0, 1, 1, 1]
    batch = feed.collect(1, current_version=1)
    assert batch.prompt_ids == [[slot] for slot in range(5) for _ in range(G)]
    assert batch.completion_ids == [[1, slot, g] for slot in range(5) for g in range(G)]
    assert batch.rewards == [{"a": float(g), "b": None} for _ in range(5) for g in range(G)]
    assert batch.weight_versions == [0] * 5 * G
    assert batch.metrics(step=1, weights_step=lambda version: version)["judge_calls"] == 3.0  # mean of 1..5


def test_an_answer_without_one_result_per_request_is_refused(chunked) -> None:
    store, feed, rollout = chunked
    feed.enqueue(0, current_version=0)
    _answer_all(store, rollout, version=0, drop_last=True)
    with pytest.raises(BadRollout, match="step 0 task 0: 1 results for 2 prompts"):
        feed.collect(0, current_version=0)


def test_a_chunked_result_of_the_wrong_shape_names_its_step_slot(chunked) -> None:
    store, feed, rollout = chunked
    feed.enqueue(0, current_version=0)
    _answer_all(store, rollout, version=0, completions=1)
    with pytest.raises(BadRollout, match="step 0 slot 0: 1 completions, expected 2"):
        feed.collect(0, current_version=0)


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
    assert store.task_tally(feed.worker.run).stale_drops == 1  # what describe's ledger counts


def test_a_chunked_answer_older_than_its_task_allows_is_redone(chunked) -> None:
    store, feed, rollout = chunked
    feed.enqueue(0, current_version=2)
    assert sorted(_answer_all(store, rollout, version=2, reported_version=1)) == [0, 0, 0, 1, 1, 1]
    answered: list[int] = []

    def answer_again() -> None:
        while not answered:
            answered.extend(_answer_all(store, rollout, version=2))

    helper = threading.Timer(0.2, answer_again)
    helper.start()
    batch = feed.collect(0, current_version=2)
    helper.join()
    assert batch.weight_versions == [2] * 5 * G and sorted(answered) == [0, 0, 0]


def test_a_result_of_the_wrong_shape_is_refused(setup) -> None:
    store, feed, rollout = setup
    feed.enqueue(0, current_version=0)
    while (task := store.lease_task(rollout.worker, 30, max_weight_version=0)) is not None:
        result = RolloutResult(
            prompt_ids=[1],
            completion_ids=[[1]],
            logprobs=[[0.0]],
            completions=["x"],
            rewards={"a": [1.0], "b": [1.0]},
            weight_version=0,
        )
        answer = RolloutAnswer(results=[result])
        store.complete_task(rollout.worker, task.id, task.lease_token, answer.model_dump())
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


def test_the_wait_polls_states_and_reads_the_results_once_all_are_done(setup, monkeypatch) -> None:
    """A task done early is not read again at every look while the others run (a step's results are the
    largest rows: every token id and logprob of its completions)."""
    store, feed, rollout = setup
    feed.enqueue(0, current_version=0)
    first = store.lease_task(rollout.worker, 30)
    answer = RolloutAnswer(results=[_result(0, first.slot, 0)])
    assert store.complete_task(rollout.worker, first.id, first.lease_token, answer.model_dump())
    looks, reads = [], []
    monkeypatch.setattr(store, "step_states", lambda *a, _f=store.step_states: looks.append(1) or _f(*a))
    monkeypatch.setattr(store, "step_results", lambda *a, _f=store.step_results: reads.append(1) or _f(*a))

    def answer_the_rest_after_some_looks() -> None:
        deadline = time.monotonic() + 5.0
        while len(looks) + len(reads) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        _answer_all(store, rollout, 0)

    helper = threading.Thread(target=answer_the_rest_after_some_looks)
    helper.start()
    batch = feed.collect(0, current_version=0)
    helper.join()
    assert len(looks) >= 5 and len(reads) == 1
    assert len(batch.completion_ids) == 2 * G


def test_forget_from_deletes_the_tasks_of_later_steps(setup) -> None:
    store, feed, _ = setup
    feed.enqueue(0, current_version=0)
    feed.enqueue(1, current_version=0)
    feed.forget_from(1)
    assert len(store.step_results("f", 0)) == 2 and store.step_results("f", 1) == []
    assert feed.enqueue(1, current_version=5) == 4


def test_a_chunked_step_deleted_under_collect_is_enqueued_again(chunked) -> None:
    """A reset deletes a step's tasks while the actor waits: collect notices fewer than
    tasks_per_step rows."""
    store, feed, rollout = chunked
    feed.enqueue(0, current_version=0)
    feed.forget_from(0)
    assert store.step_results("f", 0) == []
    answered: list[int] = []

    def answer() -> None:
        while not answered:
            answered.extend(_answer_all(store, rollout, version=0))

    helper = threading.Timer(0.2, answer)
    helper.start()
    batch = feed.collect(0, current_version=0)
    helper.join()
    assert len(store.step_results("f", 0)) == 3
    assert batch.prompt_ids == [[slot] for slot in range(5) for _ in range(G)]


def test_tool_metrics_count_calls_per_completion_and_the_completions_that_called() -> None:
    from mortal.workers.actor.feed import StepBatch

    batch = StepBatch(turns=[1, 3, 2, 1], tool_calls=[0, 2, 1, 0], tool_failures=[0, 1, 0, 0])
    assert batch._tool_metrics() == {
        "tools/call_frequency": 0.75,
        "tools/failure_frequency": 1 / 3,
        "tools/call_rate": 0.5,
        "tools/turns": 1.75,
    }
    assert StepBatch()._tool_metrics() == {}  # a run without tools reports none


def test_a_results_ring_ends_the_wait_before_the_next_poll(store, tmp_path) -> None:
    """With a doorbell the actor's wait ends when a rollout rings, not at its poll (here 30 s away);
    enqueueing rings the rollouts."""
    _, feed, rollout = _setup(store, prompts_per_step=2, prompts_per_task=1)
    feed.poll_seconds = 30
    feed.doorbell = Doorbell(tmp_path, listens_for=RESULTS)
    rollouts_hear = Doorbell(tmp_path, listens_for=TASKS)
    feed.enqueue(0, current_version=0)
    assert rollouts_hear.wait(5)

    def answer_and_ring() -> None:
        _answer_all(store, rollout, version=0)
        Doorbell(tmp_path).ring(RESULTS)

    threading.Timer(0.3, answer_and_ring).start()
    started = time.monotonic()
    batch = feed.collect(0, current_version=0)
    assert len(batch.completion_ids) == 2 * G and time.monotonic() - started < 10
    feed.doorbell.close()
    rollouts_hear.close()


def test_a_batchs_decoded_texts_are_its_completions_texts_and_none_for_tool_calling_rollouts() -> None:
    """What the actor hands TRL in place of a second decode (trl_seam.reuse_rollout_texts)."""
    from mortal.workers.actor.feed import StepBatch

    plain = StepBatch(completions=["12", "13"])
    chat = StepBatch(
        completions=[[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": ""}]]
    )
    assert plain.decoded_texts() == ["12", "13"] and chat.decoded_texts() == ["12", ""]
    tools = StepBatch(
        completions=[[{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]],
        tool_masks=[[1, 0]],
    )
    assert tools.decoded_texts() is None
    several = StepBatch(
        completions=["12", [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]]
    )
    assert several.decoded_texts() is None  # one completion not a single decode: TRL decodes them all
