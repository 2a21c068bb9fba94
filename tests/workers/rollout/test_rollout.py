"""The rollout worker loop in-process against a real store: tasks answered, weights picked up, leases kept."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from rollout_helpers import (
    arith_task,
    assets_available,
    chunk_task,
    create_run,
    make_tiny_model,
    new_worker,
    only_result,
    task_results,
    task_seeds,
    training_spec,
)
from rollout_serving import Serving, wait_done

from mortal.specs.training import ModelSpec
from mortal.state import Store
from mortal.workers.data import load_rows
from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import encode_prompt, load_model, load_tokenizer
from mortal.workers.rollout import loop as rollout
from mortal.workers.rollout.engines import GenerationParams
from mortal.workers.rollout.engines.transformers_engine import TransformersEngine
from mortal.workers.runtime import WorkerContext
from mortal.workers.sync.publisher import WeightPublisher

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "other", seed=1)


def test_tasks_are_answered_with_ids_logprobs_and_rewards(store: Store, tiny_dir: Path) -> None:
    run = create_run(store, "r1", training_spec(str(tiny_dir)))
    actor = new_worker(store, run, "actor")
    rows = load_rows(run.spec.dataset)[:2]
    store.enqueue_tasks(actor, [arith_task(1, slot, row) for slot, row in enumerate(rows)])
    with Serving(store, run):
        done = wait_done(store, "r1", 1, 2)
    spec = ModelSpec(name=str(tiny_dir), dtype="float32")
    tokenizer = load_tokenizer(spec)
    reference = TransformersEngine.create(spec, tokenizer, device="cpu")
    for task, row in zip(done, rows, strict=True):
        result = only_result(task)
        assert result.weight_version == 0
        assert result.prompt_ids == encode_prompt(tokenizer, row["prompt"])
        assert list(result.rewards) == ["correct_answer", "short_answer"]
        assert all(len(v) == 4 for v in result.rewards.values())
        assert [len(ids) for ids in result.completion_ids] == [len(lp) for lp in result.logprobs]
        assert result.completions[0][0]["role"] == "assistant"  # chat prompt -> TRL's chat completion
        assert result.completions[0][0]["content"] == tokenizer.decode(
            result.completion_ids[0], skip_special_tokens=True
        )
        # The same (weights, prompt, seed) gives the same tokens in any process: a retried task is identical.
        [again] = reference.generate([result.prompt_ids], 4, task_seeds(task), GenerationParams(max_tokens=8))
        assert [c.ids for c in again] == result.completion_ids


def test_a_task_of_several_prompts_is_answered_with_one_result_per_prompt_in_order(
    sqlite_store: Store, tiny_dir: Path
) -> None:
    """One RolloutAnswer per task, its results in request order; on CPU each prompt's group is what generating
    that prompt alone with its own seed gives (so it does not matter which prompts share a task)."""
    store = sqlite_store
    run = create_run(store, "r6", training_spec(str(tiny_dir)))
    actor = new_worker(store, run, "actor")
    rows = load_rows(run.spec.dataset)[:3]
    store.enqueue_tasks(actor, [chunk_task(1, 0, rows, first_slot=0)])
    with Serving(store, run):
        [task] = wait_done(store, "r6", 1, 1)
    results = task_results(task)
    assert len(results) == 3
    tokenizer = load_tokenizer(run.spec.model)
    reference = TransformersEngine.create(run.spec.model, tokenizer, device="cpu")
    assert task_seeds(task) == [1000, 1001, 1002]
    for result, row, seed in zip(results, rows, task_seeds(task), strict=True):
        assert result.prompt_ids == encode_prompt(tokenizer, row["prompt"])
        assert result.weight_version == 0 and all(len(v) == 4 for v in result.rewards.values())
        [alone] = reference.generate([result.prompt_ids], 4, [seed], GenerationParams(max_tokens=8))
        assert [c.ids for c in alone] == result.completion_ids
        assert [c.logprobs for c in alone] == result.logprobs


def test_new_weight_versions_are_loaded_between_tasks(
    sqlite_store: Store, tiny_dir: Path, other_dir: Path
) -> None:
    store = sqlite_store
    run = create_run(store, "r2", training_spec(str(tiny_dir)))
    actor = new_worker(store, run, "actor")
    publisher = WeightPublisher(store, actor)
    spec = run.spec.model
    assert publisher.publish(load_model(spec, "cpu"), step=0) == 0
    row = load_rows(run.spec.dataset)[0]
    with Serving(store, run) as serving:
        store.enqueue_tasks(actor, [arith_task(1, 0, row, min_version=0)])
        wait_done(store, "r2", 1, 1)
        other_spec = ModelSpec(name=str(other_dir), dtype="float32")
        store.enqueue_tasks(actor, [arith_task(2, 0, row, min_version=2)])  # needs a version not there yet
        time.sleep(0.5)
        assert [t.state for t in store.step_results("r2", 2)] == ["queued"]
        assert publisher.publish(load_model(other_spec, "cpu"), step=1) == 1
        assert publisher.publish(load_model(other_spec, "cpu"), step=2) == 2
        [task] = wait_done(store, "r2", 2, 1)
        assert serving.worker.loaded_version == 2
    result = only_result(task)
    assert result.weight_version == 2
    reference = TransformersEngine.create(other_spec, load_tokenizer(other_spec), device="cpu")
    [expected] = reference.generate([result.prompt_ids], 4, task_seeds(task), GenerationParams(max_tokens=8))
    assert [c.ids for c in expected] == result.completion_ids


def test_each_task_and_weight_load_is_the_heartbeats_activity_for_the_watchdog(
    sqlite_store: Store, tiny_dir: Path
) -> None:
    store = sqlite_store
    run = create_run(store, "r7", training_spec(str(tiny_dir)))
    actor = new_worker(store, run, "actor")
    publisher = WeightPublisher(store, actor)
    assert publisher.publish(load_model(run.spec.model, "cpu"), step=0) == 0
    rows = load_rows(run.spec.dataset)[:2]
    store.enqueue_tasks(actor, [arith_task(1, slot, row) for slot, row in enumerate(rows)])
    serving = Serving(store, run)
    entered, activity = [], serving.ctx.activity

    def recording(what: str):
        entered.append(what)
        return activity(what)

    serving.ctx.activity = recording  # type: ignore[method-assign]
    with serving:
        wait_done(store, "r7", 1, 2)
    assert entered == ["weight-load v0", "task 1.0", "task 1.1"]


def test_a_slow_task_keeps_its_lease(sqlite_store: Store, tiny_dir: Path) -> None:
    store = sqlite_store
    annotations = {"mortal.dev/task-lease-seconds": "0.6"}
    run = create_run(store, "r3", training_spec(str(tiny_dir)), annotations=annotations)
    actor = new_worker(store, run, "actor")
    store.enqueue_tasks(actor, [arith_task(1, 0, load_rows(run.spec.dataset)[0])])
    ctx = WorkerContext(store, new_worker(store, run, "rollout"), run)
    ctx.check_fence()
    worker = rollout.RolloutWorker(ctx, engine=None, tokenizer=None, rewards=None)
    assert worker.lease_seconds == 0.6
    other = new_worker(store, run, "rollout", replica=1)
    task = store.lease_task(ctx.worker, worker.lease_seconds, max_weight_version=0)
    with worker.keep_leased(task):
        time.sleep(1.5)  # 2.5 leases long: without renewal the other replica would take it over
        assert store.lease_task(other, 5.0, max_weight_version=0) is None
    assert store.complete_task(ctx.worker, task.id, task.lease_token, {"ok": True})


def test_an_idle_rollout_exits_once_the_actor_succeeded_at_max_steps(
    sqlite_store: Store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing else would stop it when the controller is gone: no task can come once the actor is done."""
    monkeypatch.setattr(rollout, "FINISHED_CHECK_SECONDS", 0.1)
    run = create_run(sqlite_store, "done", training_spec(str(tiny_dir)))  # maxSteps 2
    actor = new_worker(sqlite_store, run, "actor")
    with Serving(sqlite_store, run) as serving:
        sqlite_store.heartbeat(actor, step=1)
        time.sleep(0.5)
        assert serving.thread.is_alive(), "it left while the actor was still training"
        sqlite_store.heartbeat(actor, step=2)
        sqlite_store.report_exit(actor, "Succeeded", 0)
        serving.thread.join(timeout=10)
        assert not serving.thread.is_alive(), "it is still waiting for tasks that cannot come"


def test_a_rollout_waits_on_while_the_actor_stopped_early_is_to_be_relaunched(
    sqlite_store: Store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor that Succeeded before maxSteps (stopped for a suspend or a relaunch) is not the run's end."""
    monkeypatch.setattr(rollout, "FINISHED_CHECK_SECONDS", 0.1)
    run = create_run(sqlite_store, "early", training_spec(str(tiny_dir)))
    actor = new_worker(sqlite_store, run, "actor")
    sqlite_store.heartbeat(actor, step=1)
    sqlite_store.report_exit(actor, "Succeeded", 0)
    with Serving(sqlite_store, run) as serving:
        time.sleep(0.5)
        assert serving.thread.is_alive()


def test_the_rollout_loop_runs_with_its_startup_objects_frozen(
    sqlite_store: Store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """main(): model, engine and imports are out of the collector's full collections while it serves."""
    import gc

    run = create_run(sqlite_store, "frozen", training_spec(str(tiny_dir)))
    ctx = WorkerContext(sqlite_store, new_worker(sqlite_store, run, "rollout"), run)
    ctx.check_fence()
    built = rollout.build(ctx)
    seen: list[int] = []
    monkeypatch.setattr(built, "run", lambda: seen.append(gc.get_freeze_count()))
    monkeypatch.setattr(rollout, "build", lambda ctx: built)
    assert rollout.main(ctx) == 0
    assert seen and seen[0] > 10_000 and gc.get_freeze_count() == 0


def test_a_wrong_reward_path_fails_before_the_model_loads(sqlite_store: Store) -> None:
    spec = training_spec("/no/such/model", rewards=[{"function": "reward_fixtures:missing"}])
    run = create_run(sqlite_store, "r4", spec)
    ctx = WorkerContext(sqlite_store, new_worker(sqlite_store, run, "rollout"), run)
    with pytest.raises(FatalWorkerError, match="module reward_fixtures has no attribute missing"):
        rollout.build(ctx)


def test_a_bad_task_lease_annotation_is_fatal(sqlite_store: Store, tiny_dir: Path) -> None:
    run = create_run(
        sqlite_store, "r5", training_spec(str(tiny_dir)), {"mortal.dev/task-lease-seconds": "soon"}
    )
    ctx = WorkerContext(sqlite_store, new_worker(sqlite_store, run, "rollout"), run)
    with pytest.raises(FatalWorkerError, match="is not a number"):
        rollout.task_lease_seconds(ctx)


def test_generation_max_num_seqs_caps_the_rows_the_engine_decodes_at_once(
    sqlite_store: Store, tiny_dir: Path, monkeypatch
) -> None:
    """spec.generation.maxNumSeqs reaches the engine the worker builds (the refilling
    decoder's row budget)."""
    spec = training_spec(str(tiny_dir), generation={"maxTokens": 4, "maxNumSeqs": 8})
    run = create_run(sqlite_store, "r6", spec)
    built: list[dict] = []
    create = TransformersEngine.create.__func__

    def recording_create(cls, *args, **kwargs):
        built.append(kwargs)
        return create(cls, *args, **kwargs)

    monkeypatch.setattr(TransformersEngine, "create", classmethod(recording_create))
    ctx = WorkerContext(sqlite_store, new_worker(sqlite_store, run, "rollout"), run)
    worker = rollout.build(ctx)
    assert built[0]["max_num_seqs"] == 8 and worker.engine.max_rows == 8


@pytest.mark.parametrize("count", [1, 2])
def test_under_mixed_precision_the_rollout_generates_in_bfloat16_as_the_actor_computes(
    sqlite_store: Store, tiny_dir: Path, count: int
) -> None:
    """An actor with float32 master weights (actor.mixedPrecision, one autocasting or two sharded): its
    rollouts load the model in bfloat16, not in the float32 of model.dtype (TrainingSpec.rollout_model)."""
    run = create_run(
        sqlite_store, "r7", training_spec(str(tiny_dir), actor={"count": count, "mixedPrecision": True})
    )
    ctx = WorkerContext(sqlite_store, new_worker(sqlite_store, run, "rollout"), run)
    worker = rollout.build(ctx)
    assert {p.dtype for p in worker.engine.model.parameters()} == {torch.bfloat16}


def test_the_engine_ready_line_gives_the_seconds_of_each_part_of_the_start(
    sqlite_store: Store, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU the engine was ready about 10 s after the workload's import while its own load took 1.2 s: the
    line says where the rest goes (rewards, device, the engine's module, tokenizer), each part once."""
    run = create_run(sqlite_store, "phases", training_spec(str(tiny_dir)))
    ctx = WorkerContext(sqlite_store, new_worker(sqlite_store, run, "rollout"), run)
    with caplog.at_level("INFO"):
        rollout.build(ctx)
    line = next(r.getMessage() for r in caplog.records if " ready in " in r.getMessage())
    parts = line.split(" ready in ", 1)[1].split("(", 1)[1].split(")", 1)[0]
    assert [p.rsplit(" ", 2)[0] for p in parts.split(", ")] == [
        "rewards",
        "device",
        "engine module",
        "tokenizer",
        "engine",
    ]
    assert all(float(p.rsplit(" ", 2)[1]) >= 0 for p in parts.split(", "))


def test_phases_are_consecutive_parts_each_from_the_end_of_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter([10.0, 10.5, 13.0])
    monkeypatch.setattr(rollout.time, "monotonic", lambda: next(clock))
    phases = rollout.Phases()
    assert phases.end("tokenizer") == 0.5 and phases.end("engine") == 2.5
    assert str(phases) == "tokenizer 0.5 s, engine 2.5 s"


def test_a_prompt_longer_than_the_model_takes_fails_the_task_naming_the_row_and_the_numbers(
    sqlite_store: Store, tiny_dir: Path
) -> None:
    """The tiny model takes 512 positions: a prompt of more tokens is refused with PromptTooLong before the
    engine sees it, never generated past the model's positions (which trains on noise, silently)."""
    from mortal.workers.rollout.multiturn import PromptTooLong

    store = sqlite_store
    run = create_run(store, "long", training_spec(str(tiny_dir)))
    actor = new_worker(store, run, "actor")
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "one " * 600, "answer": "0"}]
    store.enqueue_tasks(actor, [chunk_task(1, 0, rows)])
    ctx = WorkerContext(store, new_worker(store, run, "rollout"), run)
    worker = rollout.build(ctx)
    task = store.lease_task(ctx.worker, worker.lease_seconds, max_weight_version=0)
    with pytest.raises(PromptTooLong) as caught:
        worker.answer(task)
    message = caught.value.message
    assert (
        "a prompt of 60" in message and "tokens and generation.maxTokens 8 exceed the 512 tokens" in message
    )
    assert "(the dataset row whose prompt's last message is 'one one one" in message
    assert message.endswith("columns answer, prompt); shorten or drop the row")
