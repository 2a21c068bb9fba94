"""The spec's normal form (what the store compares), defaults, and round trips through YAML/JSON."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mortal.specs import (
    EXAMPLES_DIR,
    Phase,
    SpecError,
    TrainingRun,
    TrainingSpec,
    dump_runs,
    load_file,
    load_text,
    to_yaml,
)

MINIMAL = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata: {name: demo}
spec:
  model: {name: tiny}
  dataset: {name: builtin:arith}
  rewards: [{function: "my_rewards:score"}]
"""

SAME_SPELLED_OUT = """\
kind: TrainingRun           # keys in another order, flow vs block style, defaults written out
apiVersion: "mortal/v1"
metadata:
  name: demo
spec:
  rewards:
    - weight: 1.0
      function: my_rewards:score
  dataset:
    split: train
    name: "builtin:arith"
  model:
    dtype: auto
    name: tiny
  algorithm: {numGenerations: 4, batchSize: 8, lossType: dapo, learningRate: 0.000005}
  rollout: {replicas: 1}
  backend: local
"""


def one(text: str) -> TrainingRun:
    [run] = load_text(text)
    return run


def test_defaults_are_filled_in():
    spec = one(MINIMAL).spec
    assert spec.algorithm.loss_type == "dapo" and spec.algorithm.num_generations == 4
    assert spec.algorithm.batch_size == 8 and spec.algorithm.learning_rate == 5e-6
    assert spec.algorithm.prompts_per_step == 2
    assert spec.generation.max_tokens == 256 and spec.generation.temperature == 1.0
    assert spec.model.dtype == "auto" and spec.model.lora is None
    assert spec.dataset.split == "train" and spec.dataset.prompt_column == "prompt"
    assert (spec.actor.gpu, spec.actor.count, spec.rollout.gpu, spec.rollout.replicas) == (
        "none",
        1,
        "none",
        1,
    )
    assert (spec.sync.method, spec.checkpoint.every, spec.checkpoint.keep) == ("auto", 10, 3)
    assert spec.restart_policy.max_restarts == 10 and spec.restart_policy.backoff_seconds == 5.0
    assert (spec.backend, spec.suspend, spec.secrets) == ("local", False, [])
    assert spec.logging.wandb.project == "mortal" and spec.rewards[0].sandbox.memory_mb == 512


def with_rollout(block: str) -> TrainingRun:
    return one(MINIMAL + f"  rollout: {block}\n")


def test_prompts_per_task_is_optional_and_read_from_yaml():
    assert one(MINIMAL).spec.rollout.prompts_per_task is None
    assert with_rollout("{promptsPerTask: 3}").spec.rollout.prompts_per_task == 3


def test_task_size_on_cpu_defaults_to_one_prompt_per_task():
    """On CPU each prompt is generated alone, so one prompt a task: any idle replica can take the next."""
    rollout = one(MINIMAL).spec.rollout
    assert rollout.gpu == "none"
    assert [rollout.task_size(p) for p in (1, 2, 8)] == [1, 1, 1]
    assert with_rollout("{replicas: 4}").spec.rollout.task_size(8) == 1


def test_task_size_on_a_gpu_defaults_to_one_chunk_per_replica():
    assert with_rollout("{gpu: H100, replicas: 2}").spec.rollout.task_size(8) == 4
    assert with_rollout("{gpu: H100, replicas: 3}").spec.rollout.task_size(8) == 3  # ceil: chunks 3, 3, 2
    assert with_rollout("{gpu: H100, replicas: 1}").spec.rollout.task_size(8) == 8
    assert with_rollout("{gpu: H100, replicas: 16}").spec.rollout.task_size(8) == 1
    assert (
        with_rollout("{gpu: H100, replicas: 0}").spec.rollout.task_size(8) == 8
    )  # paused: as if one replica


def test_an_explicit_prompts_per_task_wins_capped_at_the_steps_prompts():
    assert with_rollout("{promptsPerTask: 2}").spec.rollout.task_size(8) == 2  # on CPU too
    assert with_rollout("{gpu: H100, replicas: 2, promptsPerTask: 3}").spec.rollout.task_size(8) == 3
    assert with_rollout("{gpu: H100, promptsPerTask: 64}").spec.rollout.task_size(8) == 8


def test_empty_lora_block_means_lora_with_default_settings():
    run = one(MINIMAL.replace("{name: tiny}", "{name: tiny, lora: {}}"))
    assert (run.spec.model.lora.r, run.spec.model.lora.alpha, run.spec.model.lora.target_modules) == (
        16,
        32,
        "all-linear",
    )


def test_a_new_run_starts_pending_with_an_empty_status():
    status = one(MINIMAL).status
    assert status.phase is Phase.PENDING and status.step == 0 and status.conditions == []


def test_spec_dict_is_camel_case_json_with_every_default():
    spec = one(MINIMAL).spec_dict()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["algorithm"]["numGenerations"] == 4 and spec["restartPolicy"]["maxRestarts"] == 10
    assert spec["rewards"][0]["sandbox"] == {"timeoutSeconds": 10.0, "memoryMB": 512, "backend": "local"}
    assert "baseURL" in spec["rewards"][0] and "num_generations" not in spec["algorithm"]


def test_spec_dict_ignores_key_order_formatting_and_spelled_out_defaults():
    assert one(MINIMAL).spec_dict() == one(SAME_SPELLED_OUT).spec_dict()


def test_spec_dict_differs_when_a_value_differs():
    changed = MINIMAL + "  rollout: {replicas: 2}\n"
    assert one(MINIMAL).spec_dict() != one(changed).spec_dict()


def test_spec_dict_reads_back_into_an_equal_spec():
    run = one(MINIMAL)
    assert TrainingSpec.model_validate(run.spec_dict()) == run.spec


def test_from_record_rebuilds_the_run_the_store_keeps():
    run = one(MINIMAL)
    status = {
        "phase": "Running",
        "step": 7,
        "weightVersion": 7,
        "reward": 0.5,
        "replicas": {"rollout": {"ready": 1, "desired": 2}},
        "conditions": [{"type": "WorkersReady", "status": "False", "reason": "RolloutLost"}],
    }
    back = TrainingRun.from_record(
        "demo",
        run.spec_dict(),
        status,
        labels={"team": "rl"},
        annotations={"note": "x"},
        generation=3,
        resource_version=9,
    )
    assert back.spec == run.spec and back.metadata.labels == {"team": "rl"}
    assert back.metadata.annotations == {"note": "x"} and back.metadata.generation == 3
    assert back.status.phase is Phase.RUNNING and back.status.replicas.rollout.desired == 2
    assert back.status.condition("WorkersReady").reason == "RolloutLost"
    assert back.status_dict()["weightVersion"] == 7


def test_from_record_with_a_stored_spec_that_no_longer_validates_is_a_spec_error():
    spec = one(MINIMAL).spec_dict()
    spec["algorithm"]["numGenerations"] = 1
    with pytest.raises(SpecError, match=r"<store: run demo>: spec.algorithm.numGenerations"):
        TrainingRun.from_record("demo", spec)


def test_yaml_round_trip_gives_an_equal_run():
    run = TrainingRun.from_record(
        "demo",
        one(SAME_SPELLED_OUT).spec_dict(),
        {"phase": "Succeeded", "step": 30},
        labels={"a": "b"},
        uid="u-1",
        generation=2,
    )
    text = to_yaml(run)
    assert one(text) == run
    assert one(to_yaml(one(text))) == run


def test_get_output_applies_again_unchanged_in_both_formats():
    runs = load_file(EXAMPLES_DIR / "quickstart.yaml") + load_file(EXAMPLES_DIR / "gpu.yaml")
    assert load_text(dump_runs(runs, "yaml")) == runs
    assert load_text(dump_runs(runs, "json")) == runs
    assert load_text(dump_runs(runs[:1], "json")) == runs[:1]


def test_dumped_yaml_is_camel_case_and_leaves_out_nulls():
    text = to_yaml(one(MINIMAL), include_status=False)
    assert "numGenerations: 4" in text and "restartPolicy:" in text and "memoryMB: 512" in text
    assert "null" not in text and "status:" not in text and "num_generations" not in text


def test_single_json_run_is_an_object_and_several_are_a_list():
    run = one(MINIMAL)
    assert json.loads(dump_runs([run], "json"))["kind"] == "TrainingRun"
    listed = json.loads(dump_runs([run, run.model_copy(update={})], "json"))
    assert listed["kind"] == "TrainingRunList" and len(listed["items"]) == 2


def test_python_callers_use_snake_case_and_assignment_is_validated():
    spec = TrainingSpec(model={"name": "m"}, dataset={"name": "d"}, rewards=[{"function": "a:b"}])
    spec.rollout.replicas = 4
    assert spec.rollout.replicas == 4
    with pytest.raises(ValidationError):
        spec.rollout.replicas = -1


@pytest.mark.parametrize("quote", ["'", ""])
def test_timestamps_survive_the_round_trip_quoted_or_not(quote):
    status = {
        "phase": "Running",
        "startTime": "2025-01-31T12:00:00.5+02:00",
        "lastCheckpoint": {"step": 5, "path": "/ckpt/5", "time": "2025-01-31T12:00:00Z"},
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2025-01-31T12:00:01Z"}],
    }
    run = TrainingRun.from_record("demo", one(MINIMAL).spec_dict(), status)
    text = (
        to_yaml(run) if quote else to_yaml(run).replace("'20", "20").replace("Z'", "Z").replace("00'", "00")
    )
    back = one(text)
    assert back == run and back.status.start_time.utcoffset().total_seconds() == 7200
