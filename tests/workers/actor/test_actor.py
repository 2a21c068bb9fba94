"""The actor end to end in one process: real actor `main(ctx)`, real rollout loop in a thread."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from actor_helpers import (
    RolloutThread,
    actor_spec,
    create_run,
    final_weights_hash,
    run_actor_with_rollout,
    worker_context,
)
from rollout_helpers import assets_available, make_tiny_model, task_results

from mortal.specs import TrainingRun
from mortal.workers.actor import loop as actor
from mortal.workers.actor import training, trl_seam
from mortal.workers.actor.checkpoint import read_marker
from mortal.workers.actor.feed import RolloutFeed
from mortal.workers.runtime import EXIT_SUCCEEDED
from mortal.workers.sync.base import WeightsError
from mortal.workers.sync.volume import is_adapter_version, load_published, read_adapters, read_published
from mortal.workers.sync.weights import plain_state_dict

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("actor") / "model")


@pytest.fixture
def store(sqlite_store):
    """SQLite only (tests/workers/conftest.py)."""
    return sqlite_store


def _metrics(store, run: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in store.list_metrics(run):
        out.setdefault(row.step, {})[row.name] = row.value
    return out


def test_the_trainer_does_not_wait_on_the_device_to_check_each_steps_loss(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """transformers' nan/inf filter reads every step's loss back before the optimizer step is queued."""
    spec = TrainingRun.model_validate({"metadata": {"name": "m"}, "spec": actor_spec(str(tiny_dir))}).spec
    assert training.training_args(spec, str(tmp_path), "cpu").logging_nan_inf_filter is False


def test_one_actor_under_mixed_precision_computes_in_bfloat16_over_float32_weights(
    store, tiny_dir: Path
) -> None:
    """actor.mixedPrecision with one actor: TRL's bf16 autocast over float32 weights. On the same rollouts,
    the step's gradient is the float32 step's up to bfloat16's rounding, and the weights it trains and
    publishes stay float32 (the rollouts cast them as they load, into their bfloat16 model)."""
    one_step = {"algorithm": {"maxSteps": 1, "batchSize": 8}}
    plain = create_run(store, "fp32", actor_spec(str(tiny_dir), **one_step))
    mixed = create_run(store, "mixed", actor_spec(str(tiny_dir), actor={"mixedPrecision": True}, **one_step))
    assert run_actor_with_rollout(store, plain) == EXIT_SUCCEEDED
    assert run_actor_with_rollout(store, mixed) == EXIT_SUCCEEDED
    a, b = _metrics(store, "fp32")[1], _metrics(store, "mixed")[1]
    assert a["completion_tokens"] == b["completion_tokens"] and a["grad_norm"] > 0
    off = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
    assert 1e-4 < off < 5e-2, (a["grad_norm"], b["grad_norm"])
    published = read_published(store.latest_weights("mixed").path)
    assert {t.dtype for t in published.values()} == {torch.float32}


def test_a_run_trains_publishes_every_step_checkpoints_and_reports(store, tiny_dir: Path) -> None:
    run = create_run(store, "basic", actor_spec(str(tiny_dir)))
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    versions = [(w.version, w.step) for w in store.list_weights("basic")]
    assert versions == [(1, 1), (2, 2), (3, 3)]  # v0 = the start, pruned to the newest 3
    checkpoints = store.list_checkpoints("basic")
    assert [c.step for c in checkpoints] == [2, 3]  # every 2 and the last, keep 2
    marker = read_marker(checkpoints[-1].path)
    assert {k: v for k, v in marker.items() if k != "provenance"} == {
        "run": "basic",
        "step": 3,
        "weight_version": 3,
        "seed": 0,
    }
    assert (
        marker["provenance"] == checkpoints[-1].provenance and marker["provenance"]["position"]["step"] == 3
    )
    metrics = _metrics(store, "basic")
    assert sorted(metrics) == [1, 2, 3]
    for name in (
        "reward",
        "reward_std",
        "rewards/parity_reward/mean",
        "rewards/correct_answer/mean",
        "loss",
        "entropy",
        "completions/mean_length",
        "tokens_per_second",
        "step_seconds",
        "staleness/mean",
        "clip_ratio/region_mean",
        "weight_version",
        "weights/publish_seconds",
    ):
        assert name in metrics[1], name
    assert metrics[3]["staleness/max"] == 0 and metrics[3]["weight_version"] == 3  # published after it
    for (
        step
    ) in metrics.values():  # a step's seconds in parts: the store's work, waiting, TRL's step, publishing
        parts = [step[f"actor/{p}_seconds"] for p in ("bookkeeping", "wait", "train")] + [
            step["weights/publish_seconds"]
        ]
        assert min(parts) >= 0 and sum(parts) <= step["step_seconds"] + 1e-6, (parts, step["step_seconds"])
        assert 0 <= step["actor/gc_seconds"] <= step["step_seconds"]
        # TRL's step in parts: its preparation of the batch after rollout_func, then the update (MFU's time)
        inside = [step["actor/prepare_seconds"], step["actor/update_seconds"]]
        assert min(inside) > 0 and sum(inside) <= step["actor/train_seconds"] + 1e-6, (inside, step)
    assert all(r.state == "done" for r in store.step_results("basic", 2))


def test_the_actor_reports_each_step_as_its_activity_for_the_watchdog(store, tiny_dir: Path) -> None:
    """Each optimizer step, waiting for its rollouts included, is the heartbeat's activity (its deadline is
    spec.deadlines.stepSeconds); between steps the actor reports none."""
    run = create_run(store, "doing", actor_spec(str(tiny_dir)))
    ctx = worker_context(store, run, "actor")
    ctx.check_fence()
    entered, activity = [], ctx.activity

    def recording(what: str):
        entered.append(what)
        return activity(what)

    ctx.activity = recording  # type: ignore[method-assign]
    with RolloutThread(store, run):
        assert actor.main(ctx) == EXIT_SUCCEEDED
    assert entered == ["step 1", "step 2", "step 3"]
    assert ctx._activities == []


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"])
def test_every_loss_type_trains(store, tiny_dir: Path, loss_type: str) -> None:
    spec = actor_spec(
        str(tiny_dir), algorithm={"lossType": loss_type, "maxSteps": 2}, checkpoint={"every": 10, "keep": 1}
    )
    run = create_run(store, f"loss-{loss_type.replace('_', '-')}", spec)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    metrics = _metrics(store, run.name)
    assert all(math.isfinite(metrics[s]["loss"]) for s in (1, 2))
    first, last = (
        read_published(w.path) for w in (store.list_weights(run.name)[0], store.list_weights(run.name)[-1])
    )
    assert any(not (first[k] == last[k]).all() for k in first), "training did not change the weights"


def test_lora_publishes_only_adapters_and_rollouts_apply_them_onto_the_base(store, tiny_dir: Path) -> None:
    """The seeds' LoRA hot-swap: a version holds A and B of each adapted module (not the whole
    model); a rollout writes base + B @ A * scale into its own weights, equal to peft's merge."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = actor_spec(
        str(tiny_dir),
        model={"lora": {"r": 4, "alpha": 8}, "gradientCheckpointing": True},
        algorithm={"maxSteps": 2},
    )
    run = create_run(store, "lora", spec)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    last = Path(store.latest_weights("lora").path)
    assert is_adapter_version(last) and not (last / "model.safetensors").exists()
    factors, scales = read_adapters(last)
    assert set(factors) == {f"{m}.lora_{ab}" for m in scales for ab in "AB"} and set(scales.values()) == {2.0}
    ckpt = Path(store.latest_checkpoint("lora").path)
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    trained = plain_state_dict(
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), ckpt)
    )
    rollout_model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    for row in store.list_weights("lora"):  # every kept version in turn, as a rollout sees them
        load_published(rollout_model, row.path)
    loaded = rollout_model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in trained.items())
    assert any(
        not torch.equal(
            loaded[f"{m}.weight"], AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()[f"{m}.weight"]
        )
        for m in scales
    ), "training did not move the weights"
    # step 1's tasks asked for v1 (the adapters after step 0): the rollout loaded it to answer them
    assert {res.weight_version for r in store.step_results("lora", 1) for res in task_results(r)} == {1}


def test_an_adapter_that_does_not_fit_the_model_is_refused(tmp_path: Path, tiny_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    (tmp_path / "v1").mkdir()
    save_file(
        {
            "model.layers.0.self_attn.q_proj.lora_A": torch.zeros(2, 3),
            "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(5, 2),
        },
        str(tmp_path / "v1" / "adapter.safetensors"),
        metadata={"scales": '{"model.layers.0.self_attn.q_proj": 1.0}'},
    )
    with pytest.raises(WeightsError, match="the adapter of 'model.layers.0.self_attn.q_proj' does not fit"):
        load_published(model, tmp_path / "v1")


def test_on_cpu_prompts_per_task_cuts_steps_into_chunks_without_changing_training(
    store, tiny_dir: Path
) -> None:
    """rollout.promptsPerTask reaches the feed (3 prompts a step in tasks of 2: two tasks a step); on the CPU
    each prompt is still generated alone with its own seed, so the trained weights are bit for bit those
    of one prompt a task."""
    algorithm = {"batchSize": 12, "maxSteps": 2}
    single = create_run(store, "single", actor_spec(str(tiny_dir), algorithm=algorithm))
    assert run_actor_with_rollout(store, single) == EXIT_SUCCEEDED
    chunked = create_run(
        store, "chunked", actor_spec(str(tiny_dir), algorithm=algorithm, rollout={"promptsPerTask": 2})
    )
    assert run_actor_with_rollout(store, chunked) == EXIT_SUCCEEDED
    for step in (0, 1):
        tasks = store.step_results("chunked", step)
        assert [(t.slot, t.payload["first_slot"], len(t.payload["requests"])) for t in tasks] == [
            (0, 0, 2),
            (1, 2, 1),
        ]
        assert [len(task_results(t)) for t in tasks] == [2, 1]
        assert len(store.step_results("single", step)) == 3
    assert final_weights_hash(store, "chunked") == final_weights_hash(store, "single")


def test_beta_trains_against_a_reference_model(store, tiny_dir: Path) -> None:
    run = create_run(store, "beta", actor_spec(str(tiny_dir), algorithm={"beta": 0.1, "maxSteps": 2}))
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    metrics = _metrics(store, "beta")
    assert metrics[1]["kl"] == 0.0 and metrics[2]["kl"] > 0.0  # the policy moved away from the reference


def test_the_actor_trains_with_its_startup_objects_frozen_and_puts_them_back_after(
    store, tiny_dir: Path
) -> None:
    """runtime.startup_objects_frozen around trainer.train(): full collections skip what start-up made.
    The in-process rollout thread runs its loop without main(), so only the actor freezes here."""
    import gc

    import actor_helpers

    actor_helpers.FREEZE_COUNTS.clear()
    spec = actor_spec(
        str(tiny_dir), rewards=[{"function": "actor_helpers:freeze_probe_reward"}], algorithm={"maxSteps": 2}
    )
    assert run_actor_with_rollout(store, create_run(store, "frozen", spec)) == EXIT_SUCCEEDED
    assert actor_helpers.FREEZE_COUNTS and min(actor_helpers.FREEZE_COUNTS) > 10_000, (
        actor_helpers.FREEZE_COUNTS
    )
    assert gc.get_freeze_count() == 0


def test_stale_rollouts_are_recorded_and_importance_corrected(store, tiny_dir: Path) -> None:
    spec = actor_spec(str(tiny_dir), algorithm={"maxStaleness": 2, "maxSteps": 4})
    run = create_run(store, "stale", spec)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    metrics = _metrics(store, "stale")
    staleness = [metrics[s]["staleness/max"] for s in sorted(metrics)]
    assert max(staleness) >= 1 and max(staleness) <= 2, staleness
    assert all("sampling/importance_sampling_ratio/mean" in metrics[s] for s in metrics)


def test_a_stopped_actor_checkpoints_and_a_resume_is_bit_for_bit(store, tiny_dir: Path) -> None:
    spec = actor_spec(str(tiny_dir), algorithm={"maxSteps": 4}, checkpoint={"every": 10, "keep": 2})
    straight = create_run(store, "straight", spec)
    assert run_actor_with_rollout(store, straight) == EXIT_SUCCEEDED
    expected = final_weights_hash(store, "straight")

    stopped = create_run(store, "stopped", spec)
    assert run_actor_with_rollout(store, stopped, stop_after_step=2) == EXIT_SUCCEEDED
    assert [c.step for c in store.list_checkpoints("stopped")] == [2]  # at the boundary, not "every"
    assert run_actor_with_rollout(store, stopped) == EXIT_SUCCEEDED
    assert final_weights_hash(store, "stopped") == expected
    assert store.latest_weights("stopped").version > store.latest_weights("straight").version


def test_a_stop_while_waiting_for_rollouts_checkpoints_that_boundary_exactly(
    store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while the rollouts are gone (suspend): the checkpoint is written from inside the wait
    for step 2's rollouts, and equals one written at the end of step 1's training."""
    spec = actor_spec(str(tiny_dir), algorithm={"maxSteps": 3}, checkpoint={"every": 10, "keep": 2})
    straight = create_run(store, "straight", spec)
    assert run_actor_with_rollout(store, straight) == EXIT_SUCCEEDED

    run = create_run(store, "waiting", spec)
    ctx = worker_context(store, run, "actor")
    rollout = RolloutThread(store, run)
    real_collect = RolloutFeed.collect

    def collect(
        feed: RolloutFeed, step: int, current_version: int, on_stop=lambda: None, while_waiting=lambda: None
    ):
        if step == 2:  # the rollouts are gone before step 2's tasks are answered, then SIGTERM comes
            rollout.stop()
            ctx.stopping.set()
        return real_collect(feed, step, current_version, on_stop, while_waiting)

    monkeypatch.setattr(RolloutFeed, "collect", collect)
    with rollout:
        assert actor.main(ctx) == EXIT_SUCCEEDED
    assert [c.step for c in store.list_checkpoints("waiting")] == [2]
    assert store.latest_weights("waiting").step == 2
    monkeypatch.setattr(RolloutFeed, "collect", real_collect)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    assert final_weights_hash(store, "waiting") == final_weights_hash(store, "straight")


def _validated_spec(tiny_dir: Path, gpu: str, **actor_fields: object) -> object:
    """actor_spec with actor and rollout on `gpu`, as the workers read it (validated, defaults filled in)."""
    from mortal.specs import TrainingRun

    return TrainingRun.model_validate(
        {
            "metadata": {"name": "r"},
            "spec": actor_spec(str(tiny_dir), actor={"gpu": gpu, **actor_fields}, rollout={"gpu": gpu}),
        }
    ).spec


def test_only_gpu_rollouts_get_their_first_tasks_before_the_trainer_is_built(tiny_dir: Path) -> None:
    """A GPU rollout compiles its decode step at its first task, so that task comes as early as it can."""
    assert actor.queues_ahead(_validated_spec(tiny_dir, "H100"))
    assert not actor.queues_ahead(_validated_spec(tiny_dir, "none"))


def test_tasks_queued_before_the_trainer_are_answered_by_the_loaded_model_as_version_0(
    store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh run's first tasks, queued before the trainer is built, answered by a rollout that has not seen
    a published version (its own load of the model is version 0), train the same weights as a run whose
    rollout loaded the actor's version 0 first. The rollout answers them in the actor's thread before the
    trainer is built, as a rollout process would while the actor builds it."""
    spec = actor_spec(str(tiny_dir))
    assert run_actor_with_rollout(store, create_run(store, "straight", spec)) == EXIT_SUCCEEDED

    run = create_run(store, "ahead", spec)
    ctx = worker_context(store, run, "actor")
    ctx.check_fence()
    rollout = RolloutThread(store, run)
    answered: list[int] = []
    real_build = actor.build_trainer

    def build_after_the_first_tasks_are_answered(ctx, spec, loop):
        assert store.latest_weights("ahead") is None  # nothing published yet
        while rollout.worker.serve_one():
            answered.append(rollout.worker.loaded_version)
        rollout.thread.start()
        return real_build(ctx, spec, loop)

    monkeypatch.setattr(actor, "queues_ahead", lambda spec: True)
    monkeypatch.setattr(actor, "build_trainer", build_after_the_first_tasks_are_answered)
    try:
        assert actor.main(ctx) == EXIT_SUCCEEDED
    finally:
        rollout.stop()
    first = store.step_results("ahead", 0)
    assert answered == [0] * len(first) and all(task.min_weight_version == 0 for task in first)
    assert final_weights_hash(store, "ahead") == final_weights_hash(store, "straight")


def test_a_resumed_runs_tasks_queued_early_wait_for_the_resumed_weights(
    store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a resume the tasks queued before the trainer is built ask for the version the actor publishes first,
    so a rollout that still holds the stopped actor's last version cannot answer them with it."""
    spec = actor_spec(str(tiny_dir), algorithm={"maxSteps": 4}, checkpoint={"every": 10, "keep": 2})
    assert run_actor_with_rollout(store, create_run(store, "straight", spec)) == EXIT_SUCCEEDED
    run = create_run(store, "resumed", spec)
    assert run_actor_with_rollout(store, run, stop_after_step=2) == EXIT_SUCCEEDED
    stopped_at = store.latest_weights("resumed").version

    monkeypatch.setattr(actor, "queues_ahead", lambda spec: True)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    resumed_first = min(w.version for w in store.list_weights("resumed") if w.version > stopped_at)
    assert [task.min_weight_version for task in store.step_results("resumed", 2)] == [resumed_first] * len(
        store.step_results("resumed", 2)
    )
    assert final_weights_hash(store, "resumed") == final_weights_hash(store, "straight")


def test_the_actors_warm_up_while_it_waits_for_its_first_rollouts_changes_no_weight(
    store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one GPU the actor runs a placeholder forward and backward while the first step's rollouts are
    generated (trl_seam.warm_up_training); the run's weights are bit for bit those of a run without it. Here
    on the CPU, the warm-up waiting until the in-process rollout has answered the step (in separate processes
    they overlap; in one, the two would swap the process's RNG state under each other)."""
    spec = actor_spec(str(tiny_dir))
    assert run_actor_with_rollout(store, create_run(store, "plain", spec)) == EXIT_SUCCEEDED
    real_warm_up, warmed = trl_seam.warm_up_training, []

    def warm_up_once_answered(trainer):
        step = trainer.state.global_step
        while set(store.step_states("warmed", step)) != {"done"}:
            time.sleep(0.01)
        warmed.append(step)
        real_warm_up(trainer)

    monkeypatch.setattr(actor, "warms_up", lambda spec, world: True)
    monkeypatch.setattr(trl_seam, "warm_up_training", warm_up_once_answered)
    assert run_actor_with_rollout(store, create_run(store, "warmed", spec)) == EXIT_SUCCEEDED
    assert warmed == [0]  # once, at the first step
    assert final_weights_hash(store, "warmed") == final_weights_hash(store, "plain")


def test_only_a_single_gpu_eager_actor_warms_up(tiny_dir: Path) -> None:
    assert actor.warms_up(_validated_spec(tiny_dir, "H100"), world=1)
    assert not actor.warms_up(_validated_spec(tiny_dir, "H100"), world=2)
    assert not actor.warms_up(_validated_spec(tiny_dir, "H100", compile=True), world=1)
    assert not actor.warms_up(_validated_spec(tiny_dir, "none"), world=1)


def test_the_actor_keeps_as_many_weight_versions_as_the_spec_says(store, tiny_dir: Path) -> None:
    """sync.keepVersions: 2 keeps the newest two versions (rows and directories); the default keeps three."""
    run = create_run(store, "two", actor_spec(str(tiny_dir), sync={"keepVersions": 2}))
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    rows = store.list_weights("two")
    assert [(w.version, w.step) for w in rows] == [(2, 2), (3, 3)]
    assert sorted(path.name for path in Path(rows[0].path).parent.iterdir()) == sorted(
        Path(w.path).name for w in rows
    )


def test_weights_published_every_n_steps_are_importance_corrected(store, tiny_dir: Path) -> None:
    spec = actor_spec(str(tiny_dir), algorithm={"maxSteps": 3}, sync={"every": 2})
    run = create_run(store, "every", spec)
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    assert [(w.version, w.step) for w in store.list_weights("every")] == [(0, 0), (1, 2), (2, 3)]
    metrics = _metrics(store, "every")
    assert [metrics[s]["staleness/max"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]  # step 1 trains on v0
    assert "sampling/importance_sampling_ratio/mean" in metrics[2]


def test_a_spec_with_only_a_model_trains_with_the_seeds_defaults(store, tiny_dir: Path) -> None:
    """No dataset, no rewards: code execution in the sandbox on builtin:mbpp-mini (the seeds' default)."""
    spec = {
        "model": {"name": str(tiny_dir)},
        "algorithm": {"maxSteps": 1, "numGenerations": 2, "batchSize": 4},
        "generation": {"maxTokens": 8},
        "logging": {"wandb": {"mode": "disabled"}},
    }
    run = create_run(store, "seed", spec)
    assert run.spec.dataset.name == "builtin:mbpp-mini" and [r.env for r in run.spec.rewards] == [
        "code-execution"
    ]
    assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
    names = {row.name for row in store.list_metrics("seed")}
    assert "loss" in names and any(name.startswith("rewards/code-execution") for name in names), sorted(names)


@pytest.mark.parametrize("scope", ["model", "layer"])
def test_a_compiled_actor_trains_as_the_eager_one_does(store, tiny_dir: Path, monkeypatch, scope) -> None:
    """actor.compile runs the training step through torch.compile (TRL's torch_compile), the whole model or
    each decoder layer (actor.compileScope): the first step (same weights, same completions) has the eager
    run's gradient norm, and the run completes and publishes.
    Compiled here with the aot_eager backend: dynamo's capture and AOT autograd's joint
    graph (where a step that will not compile fails) as on a GPU, without inductor's C++
    code generation on the CPU, which made this test slow on CI's two cores (inductor's
    kernels are torch's, and differ from the GPU's Triton anyway)."""
    from torch._dynamo.utils import counters

    _compiled_on_aot_eager(monkeypatch)
    make_trainer, regional, labelled_only = training.make_trainer, [], []

    def recording(*args, **kwargs):  # the dynamo plugin's settings as the trainer was built
        trainer = make_trainer(*args, **kwargs)
        regional.append(trainer.accelerator.state.dynamo_plugin.use_regional_compilation)
        labelled_only.append(getattr(trl_seam.patched_model(trainer).forward, "labelled_only", False))
        return trainer

    monkeypatch.setattr(training, "make_trainer", recording)
    torch._dynamo.reset()
    counters.clear()
    grad_norms = {}  # step 1's: its loss is about 0 on-policy (the advantages sum to 0), its gradient is not
    for name, compiled in (("eager", False), ("compiled", True)):
        spec = actor_spec(
            str(tiny_dir), actor={"compile": compiled, "compileScope": scope}, algorithm={"maxSteps": 2}
        )
        run = create_run(store, name, spec)
        assert run_actor_with_rollout(store, run) == EXIT_SUCCEEDED
        grad_norms[name] = _metrics(store, name)[1]["grad_norm"]
        assert [w.step for w in store.list_weights(name)][-1] == 2
        if not compiled:
            assert counters["frames"]["ok"] == 0  # the eager actor compiled nothing
    assert counters["frames"]["ok"] > 0
    assert counters["aot_autograd"]["ok"] > 0 and not counters["inductor"]  # aot_eager's: no inductor lookups
    assert grad_norms["eager"] > 0.01
    assert grad_norms["compiled"] == pytest.approx(grad_norms["eager"], rel=1e-4)
    assert regional[-1] == (scope == "layer")  # the compiled run's: the scope reached accelerate
    assert labelled_only == [True, True]  # on the CPU both scored the completions only (trl_seam, 13)


def _compiled_on_aot_eager(monkeypatch) -> None:
    """The actor's torch_compile with the aot_eager backend (the test above says why)."""
    training_args = training.training_args

    def aot_eager_args(*args, **kwargs):
        config = training_args(*args, **kwargs)
        if config.torch_compile:  # a backend set alone turns compiling on (TrainingArguments)
            config.torch_compile_backend = "aot_eager"
        return config

    monkeypatch.setattr(training, "training_args", aot_eager_args)


def _width_recompiles() -> list[str]:
    """dynamo's reasons for compiling a function again because a tensor's size changed (the batch's width:
    the model's forward under compileScope model, a decoder layer's under layer)."""
    from torch._dynamo.utils import guard_failures

    return [
        str(reason)
        for reasons in guard_failures.values()
        for reason in reasons
        if "size mismatch" in str(reason)
    ]


@pytest.mark.parametrize("environment", [None, "0"])
def test_a_compiled_actor_compiles_its_forward_once_for_every_batch_width(
    store, tiny_dir: Path, monkeypatch, environment
) -> None:
    """Steps of different widths (prompts and completions vary) reuse the first compile of the default scope
    (a decoder layer); with static shapes asked for (ACCELERATE_DYNAMO_USE_DYNAMIC=0, which the actor leaves
    as it is) a new width compiles again. (The model scope takes the same setting: test_trl_seam.)"""
    from torch._dynamo.utils import guard_failures

    _compiled_on_aot_eager(monkeypatch)
    if environment is not None:
        monkeypatch.setenv(trl_seam.DYNAMIC_SHAPES_ENV, environment)
    torch._dynamo.reset()
    guard_failures.clear()
    spec = actor_spec(
        str(tiny_dir),
        actor={"compile": True},
        algorithm={"maxSteps": 3},
        generation={"maxTokens": 8, "temperature": 1.0},
    )
    assert (
        run_actor_with_rollout(store, create_run(store, f"widths-{environment or 'default'}", spec))
        == EXIT_SUCCEEDED
    )
    assert bool(_width_recompiles()) == (environment == "0"), _width_recompiles()
