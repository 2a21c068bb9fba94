"""mortal.workers.schedule: which rows each step trains on, how a step is cut into tasks, and task seeds
(pure functions)."""

from __future__ import annotations

import pytest

from mortal.workers import schedule


def test_an_epoch_visits_every_row_once_and_epochs_differ() -> None:
    n, per_step = 10, 2
    first = [r for step in range(5) for r in schedule.prompt_slots(7, step, per_step, n)]
    second = [r for step in range(5, 10) for r in schedule.prompt_slots(7, step, per_step, n)]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert first != second and first != list(range(n))


def test_steps_straddle_epochs_when_the_batch_does_not_divide_the_rows() -> None:
    n, per_step = 5, 2
    flat = [r for step in range(5) for r in schedule.prompt_slots(1, step, per_step, n)]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:]) == list(range(5))


def test_the_order_is_a_function_of_seed_and_step_only() -> None:
    schedule.epoch_order.cache_clear()
    a = schedule.prompt_slots(3, 41, 4, 100)
    schedule.epoch_order.cache_clear()
    assert schedule.prompt_slots(3, 41, 4, 100) == a
    assert schedule.prompt_slots(4, 41, 4, 100) != a
    # pinned: a change of the algorithm would silently change every run's data order
    assert schedule.prompt_slots(0, 0, 4, 10) == list(schedule.epoch_order(0, 0, 10)[:4])
    assert schedule.task_seed(0, 0, 0) == schedule._digest(0, 0, 0) >> 1


def test_task_seeds_are_distinct_and_fit_torch() -> None:
    seeds = {schedule.task_seed(0, step, slot) for step in range(50) for slot in range(8)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)


def test_steps_to_enqueue_stop_at_max_steps() -> None:
    assert list(schedule.steps_to_enqueue(3, 0, 10)) == [3]
    assert list(schedule.steps_to_enqueue(3, 2, 10)) == [3, 4, 5]
    assert list(schedule.steps_to_enqueue(8, 3, 10)) == [8, 9]


def test_task_chunks_cover_every_slot_once_in_order() -> None:
    for per_step in range(1, 12):
        for per_task in range(1, 14):
            chunks = schedule.task_chunks(per_step, per_task)
            assert [slot for chunk in chunks for slot in chunk] == list(range(per_step))
            assert len(chunks) == -(-per_step // per_task)
            assert all(len(chunk) == per_task for chunk in chunks[:-1])
            assert 1 <= len(chunks[-1]) <= per_task


def test_task_chunks_are_consecutive_runs_and_the_last_may_be_shorter() -> None:
    assert schedule.task_chunks(8, 4) == [range(0, 4), range(4, 8)]
    assert schedule.task_chunks(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert schedule.task_chunks(3, 1) == [range(0, 1), range(1, 2), range(2, 3)]  # one prompt a task (CPU)
    assert schedule.task_chunks(3, 8) == [range(0, 3)]  # a task bigger than the step: one task


def test_task_chunks_refuse_a_task_of_no_prompts() -> None:
    for bad in (0, -1):
        with pytest.raises(ValueError, match="prompts_per_task"):
            schedule.task_chunks(4, bad)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        schedule.prompt_slots(0, 0, 2, 0)
    with pytest.raises(ValueError):
        schedule.prompt_slots(0, -1, 2, 5)
