"""mortal.workers.actor.samples and what feeds it: a step's completions as the store and W&B keep them.

Pure pieces here (text, totals, the bound, log_extra columns); the feed carrying prompts, texts and
log_extra through the queue; the reporter writing to the store and to a fake wandb's Table. The real
actor recording them end to end: test_actor_completions.py.
"""

from __future__ import annotations

import math
import sys
import threading
import types
from typing import Any

import pytest
from actor_helpers import create_run, worker_context

from mortal.state import NewCompletion
from mortal.workers.actor.feed import RolloutFeed, StepBatch
from mortal.workers.actor.metrics import COMPLETIONS_KEY, STEP_KEY, MetricsReporter
from mortal.workers.actor.samples import as_text, step_completions, total_reward
from mortal.workers.messages import RolloutAnswer, RolloutResult, extra_columns

SPEC = {
    "model": {"name": "/nonexistent/model"},
    "dataset": {"name": "builtin:arith"},
    "rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def _batch(groups: int = 2, g: int = 4) -> StepBatch:
    """`groups` prompts x `g` completions; completion i scores i % 3 on `a` and nothing on `b`."""
    batch = StepBatch()
    for i in range(groups * g):
        batch.completion_ids.append([i])
        batch.prompts.append(f"prompt {i // g}")
        batch.completions.append([{"role": "assistant", "content": f"answer {i}"}])
        batch.rewards.append({"a": float(i % 3), "b": None})
        batch.weight_versions.append(7)
        batch.extra.append({"seen": i})
    return batch


def test_text_is_the_string_the_single_message_or_role_blocks() -> None:
    assert as_text("plain") == "plain"
    assert as_text([{"role": "assistant", "content": "4"}]) == "4"
    assert as_text(CHAT) == "system: Be brief.\n\nuser: What is 2 + 2?"


def test_a_tool_calling_completion_shows_each_turn() -> None:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 2"}}}
    turns = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    assert as_text(turns) == (
        "assistant:\n  -> calculator(expression='2 + 2')\n\ntool calculator: 4\n\nassistant: 4"
    )
    assert as_text(turns[:1]) == "assistant:\n  -> calculator(expression='2 + 2')"


def test_the_total_is_trl_s_weighted_sum_and_none_when_nothing_scored() -> None:
    assert total_reward({"a": 1.0, "b": 0.5}, {"a": 1.0, "b": 0.2}) == pytest.approx(1.1)
    assert total_reward({"a": 1.0, "b": None}, {"a": 2.0}) == 2.0
    assert total_reward({"a": None, "b": math.nan}, {}) is None


def test_the_first_n_completions_are_kept_whole_groups_first() -> None:
    batch = _batch()
    kept = step_completions(batch, [0.1 * i for i in range(8)], {"a": 1.0, "b": 1.0}, limit=5)
    assert [c.sample for c in kept] == [0, 1, 2, 3, 4]
    first = kept[1]
    assert (
        first.prompt,
        first.completion,
        first.rewards,
        first.reward,
        first.weight_version,
        first.extra,
    ) == ("prompt 0", "answer 1", {"a": 1.0, "b": None}, 1.0, 7, {"seen": 1})
    assert first.advantage == pytest.approx(0.1)
    assert len(step_completions(batch, None, {}, limit=64)) == 8
    assert step_completions(batch, None, {}, limit=0) == []


def test_advantages_that_do_not_fit_the_batch_are_left_out() -> None:
    kept = step_completions(_batch(), [1.0, 2.0], {}, limit=8)
    assert all(c.advantage is None for c in kept)


def test_log_extra_columns_get_one_plain_value_per_completion() -> None:
    logged = {"short": ["x"], "long": [1, 2, 3, 4], "odd": [math.nan, {"k": 1}, None]}
    assert extra_columns(logged, 3) == {
        "short": ["x", None, None],
        "long": [1, 2, 3],
        "odd": [None, "{'k': 1}", None],
    }


def test_the_feed_carries_each_completion_s_prompt_text_and_log_extra(store) -> None:
    run = create_run(store, "f", SPEC)
    actor, rollout = worker_context(store, run, "actor"), worker_context(store, run, "rollout")
    feed = RolloutFeed(
        actor.store,
        actor.worker,
        [{"prompt": CHAT, "answer": "4"}],
        seed=0,
        prompts_per_step=1,
        num_generations=2,
        max_staleness=0,
        max_steps=1,
        reward_names=["a"],
        stopping=threading.Event(),
    )
    feed.enqueue(0, current_version=0)
    task = store.lease_task(rollout.worker, 30)
    result = RolloutResult(
        prompt_ids=[1],
        completion_ids=[[2], [3]],
        logprobs=[[-0.1], [-0.2]],
        completions=["four", "five"],
        rewards={"a": [1.0, 0.0]},
        weight_version=0,
        logged_extra={"parsed": ["4", "5"]},
    )
    store.complete_task(
        rollout.worker, task.id, task.lease_token, RolloutAnswer(results=[result]).model_dump()
    )
    batch = feed.collect(0, current_version=0)
    assert batch.prompts == [CHAT, CHAT] and batch.completions == ["four", "five"]
    assert batch.extra == [{"parsed": "4"}, {"parsed": "5"}]


class FakeWandb(types.ModuleType):
    """The slice of wandb the reporter uses for completions: Table and a run's log."""

    class Table:
        def __init__(self, columns: list[str], data: list[list[Any]]) -> None:
            self.columns, self.data = columns, data

    def __init__(self) -> None:
        super().__init__("wandb")
        self.logged: list[dict[str, Any]] = []

    def log(self, values: dict[str, Any]) -> None:
        self.logged.append(values)


def _samples() -> list[NewCompletion]:
    return [
        NewCompletion(
            sample=i,
            prompt="p",
            completion=f"c{i}",
            rewards={"a": float(i), "prompt": None},
            reward=float(i),
            advantage=i - 0.5,
            weight_version=2,
            extra={"note": "n"},
        )
        for i in range(2)
    ]


def test_the_reporter_writes_the_store_and_a_wandb_table(store, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    ctx = worker_context(store, create_run(store, "m", SPEC), "actor")
    MetricsReporter(ctx.store, ctx.worker, fake).report_completions(3, _samples())
    assert [(c.step, c.completion) for c in store.list_completions("m")] == [(3, "c0"), (3, "c1")]
    [logged] = fake.logged
    table = logged[COMPLETIONS_KEY]
    assert logged[STEP_KEY] == 3
    assert table.columns == [
        "step",
        "sample",
        "prompt",
        "completion",
        "reward",
        "a",
        "extra/prompt",
        "advantage",
        "weight_version",
        "note",
    ]
    assert table.data[1] == [3, 1, "p", "c1", 1.0, 1.0, None, 0.5, 2, "n"]


def test_no_samples_write_nothing(store, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    ctx = worker_context(store, create_run(store, "m", SPEC), "actor")
    MetricsReporter(ctx.store, ctx.worker, fake).report_completions(3, [])
    assert store.completion_steps("m") == [] and fake.logged == []
