"""algorithm.microBatchSize: the step's batch trained in micro-batches (gradient accumulation) is the same
optimizer step as the whole batch at once. Two runs of the real actor from the same tiny model and seed
get the same rollouts for step 1 (on-policy, CPU: exact); their gradient norms and losses agree to float
tolerance, and their weights after the step too, while the rollout_func is still called once per step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from actor_helpers import actor_spec, create_run, run_actor_with_rollout
from rollout_helpers import assets_available, make_tiny_model

from mortal.specs import TrainingRun
from mortal.workers.actor.training import training_args
from mortal.workers.runtime import EXIT_SUCCEEDED
from mortal.workers.sync.volume import read_published

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("micro") / "model")


def test_the_spec_maps_onto_trls_accumulation(tmp_path: Path, tiny_dir: Path) -> None:
    spec = TrainingRun.model_validate(
        {
            "metadata": {"name": "m"},
            "spec": actor_spec(str(tiny_dir), algorithm={"batchSize": 8, "microBatchSize": 2}),
        }
    ).spec
    args = training_args(spec, str(tmp_path), "cpu")
    assert (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.steps_per_generation,
        args.generation_batch_size,
    ) == (2, 4, 4, 8)
    whole = training_args(
        TrainingRun.model_validate({"metadata": {"name": "m"}, "spec": actor_spec(str(tiny_dir))}).spec,
        str(tmp_path),
        "cpu",
    )
    assert (
        whole.per_device_train_batch_size,
        whole.gradient_accumulation_steps,
        whole.generation_batch_size,
    ) == (8, 1, 8)


def _first_step(
    store, name: str, tiny_dir: Path, micro: int | None
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    algorithm = {"maxSteps": 1, "batchSize": 8, **({"microBatchSize": micro} if micro else {})}
    run = create_run(store, name, actor_spec(str(tiny_dir), algorithm=algorithm))
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    metrics = {m.name: m.value for m in store.list_metrics(name) if m.step == 1}
    return metrics, read_published(store.latest_weights(name).path)


def test_micro_batches_make_the_same_step_as_the_whole_batch(sqlite_store, tiny_dir: Path) -> None:
    whole, whole_weights = _first_step(sqlite_store, "whole", tiny_dir, None)
    split, split_weights = _first_step(sqlite_store, "split", tiny_dir, 2)
    assert split["completion_tokens"] == whole["completion_tokens"]  # the same rollouts
    assert whole["grad_norm"] > 0
    assert math.isclose(split["grad_norm"], whole["grad_norm"], rel_tol=1e-4), (
        split["grad_norm"],
        whole["grad_norm"],
    )
    assert math.isclose(split["loss"], whole["loss"], rel_tol=1e-4, abs_tol=1e-6), (
        split["loss"],
        whole["loss"],
    )
    assert whole_weights.keys() == split_weights.keys()
    # AdamW's first step moves each weight by about learningRate (1e-2) in the sign of its gradient: a
    # micro-batch left out or counted twice would move some 2e-2 the other way; float noise moves none 1e-4
    worst = max(float((split_weights[k] - whole_weights[k]).abs().max()) for k in whole_weights)
    assert worst < 1e-4, worst


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused_with_a_choice() -> None:
    from mortal.specs import SpecError
    from mortal.specs.loader import load_text

    with pytest.raises(SpecError) as refused:
        load_text(
            "apiVersion: mortal/v1\nkind: TrainingRun\nmetadata: {name: m}\nspec:\n  model: {name: x}\n"
            "  algorithm: {batchSize: 16, numGenerations: 4, microBatchSize: 5}\n",
            "run.yaml",
        )
    text = str(refused.value)
    assert "microBatchSize (5) must divide batchSize (16): try 4" in text and "run.yaml" in text


def test_the_controllers_micro_batch_reaches_trl_as_accumulation(tmp_path: Path, tiny_dir: Path) -> None:
    """The micro batch the controller chose after an out-of-memory
    (MORTAL_MICRO_BATCH_SIZE, mortal.specs.memory) is what the actor's TRL config splits
    the batch by: the same generation batch, more passes."""
    from mortal.specs.memory import MICRO_BATCH_ENV, applied

    run = TrainingRun.model_validate({"metadata": {"name": "m"}, "spec": actor_spec(str(tiny_dir))})
    args = training_args(applied(run, {MICRO_BATCH_ENV: "2"}).spec, str(tmp_path), "cpu")
    assert (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.steps_per_generation,
        args.generation_batch_size,
    ) == (2, 4, 4, 8)


def test_a_resume_with_a_smaller_micro_batch_makes_the_same_next_step(sqlite_store, tiny_dir: Path) -> None:
    """An actor healed after an out-of-memory resumes the checkpoint its predecessor wrote
    with the whole batch in one pass, now in passes of 2: its step 2 equals an
    uninterrupted run's (the trainer's own resume skips as many generation batches as
    steps done, whatever the accumulation: the prompts are mortal's, by step)."""
    from mortal.specs.memory import MICRO_BATCH_ENV, applied

    spec = actor_spec(
        str(tiny_dir), algorithm={"maxSteps": 2, "batchSize": 8}, checkpoint={"every": 1, "keep": 2}
    )
    straight = create_run(sqlite_store, "straight", spec)
    assert run_actor_with_rollout(sqlite_store, straight) == EXIT_SUCCEEDED
    healed = create_run(sqlite_store, "healed", spec)
    assert run_actor_with_rollout(sqlite_store, healed, stop_after_step=1) == EXIT_SUCCEEDED
    assert sqlite_store.latest_checkpoint("healed").step == 1  # step 2 is the resumed actor's, in passes of 2
    assert run_actor_with_rollout(sqlite_store, applied(healed, {MICRO_BATCH_ENV: "2"})) == EXIT_SUCCEEDED
    step2 = {
        run: {m.name: m.value for m in sqlite_store.list_metrics(run) if m.step == 2}
        for run in ("straight", "healed")
    }
    assert step2["healed"]["completion_tokens"] == step2["straight"]["completion_tokens"]
    assert math.isclose(step2["healed"]["grad_norm"], step2["straight"]["grad_norm"], rel_tol=1e-4), step2
    assert math.isclose(step2["healed"]["loss"], step2["straight"]["loss"], rel_tol=1e-4, abs_tol=1e-6), step2
    a, b = (read_published(sqlite_store.latest_weights(run).path) for run in ("straight", "healed"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4
