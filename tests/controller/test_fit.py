"""The pre-launch memory bound (mortal.controller.fit) and the parameter count it is given
(mortal.workers.models.count_parameters, from safetensors headers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mortal.controller.backends.gpus import gpu_memory
from mortal.controller.fit import certain_misfits
from mortal.specs import TrainingRun
from mortal.workers.models import count_parameters
from mortal.workers.sync.base import KEEP_VERSIONS

B = 10**9


def spec(**sections):
    doc = {"model": {"name": "some/model"}, "actor": {"gpu": "H100"}, "rollout": {"gpu": "H100"}}
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    return TrainingRun.model_validate({"metadata": {"name": "r"}, "spec": doc}).spec


def fake_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file's header only (what count_parameters reads), for shapes too large to write."""
    header = json.dumps(
        {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]} for name, shape in shapes.items()}
    ).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.parametrize(
    "sections, parameters, fields",
    [
        ({}, int(7.6 * B), []),  # 7.6B x 8 bytes = 61 GB < 80 GB: may fit, so nothing is said
        ({}, 14 * B, ["spec.actor.gpu"]),  # 112 GB of weights + grads + AdamW on an 80 GB H100
        ({"model": {"lora": {"r": 16}}}, 14 * B, []),  # LoRA: 28 GB of frozen weights
        (
            {"model": {"lora": {"r": 16}}},
            45 * B,
            ["spec.actor.gpu", "spec.rollout.gpu"],
        ),  # 90 GB of weights alone
        ({"rollout": {"colocate": True}}, int(7.6 * B), []),  # 76 GB: still not certain
        ({"rollout": {"colocate": True, "replicas": 2}}, int(7.6 * B), ["spec.actor.gpu"]),  # 91 GB
        ({"actor": {"gpu": "H200"}}, 14 * B, []),  # 141 GB
        ({"actor": {"gpu": "none"}, "rollout": {"gpu": "none"}}, 100 * B, []),  # CPU: not judged
        ({"actor": {"gpu": "MI300X"}}, 100 * B, ["spec.rollout.gpu"]),  # a type not in the table: not judged
        # rollout.gpuMemoryUtilization: a colocated rollout holds its share of the GPU, its weights inside it
        ({"rollout": {"colocate": True, "gpuMemoryUtilization": 0.3}}, int(1.5 * B), []),  # 12 GB + 24 GB
        (
            {"rollout": {"colocate": True, "gpuMemoryUtilization": 0.5}},
            7 * B,
            ["spec.actor.gpu"],
        ),  # 56 GB + 40 GB
        (
            {"rollout": {"colocate": True, "gpuMemoryUtilization": 0.05}},
            3 * B,  # 6 GB of weights in a 4 GB share
            ["spec.rollout.gpuMemoryUtilization"],
        ),
        (
            {"rollout": {"gpuMemoryUtilization": 0.1}},
            7 * B,
            ["spec.rollout.gpuMemoryUtilization"],
        ),  # 14 GB in 8 GB
        ({"rollout": {"gpuMemoryUtilization": 0.9}}, 7 * B, []),  # its own GPU: 14 GB in 72 GB
        # sync ipc (auto, for transformers rollouts on GPUs): + 3 snapshots of the weights on the actor's GPU
        ({"generation": {"engine": "transformers"}}, int(5.5 * B), []),  # 44 GB + 33 GB
        ({"generation": {"engine": "transformers"}}, 6 * B, ["spec.actor.gpu"]),  # 48 GB + 36 GB
        ({"generation": {"engine": "transformers"}, "sync": {"method": "volume"}}, 6 * B, []),  # no snapshots
        ({"generation": {"engine": "transformers"}, "sync": {"keepVersions": 2}}, 6 * B, []),  # 48 GB + 24 GB
        (
            {"generation": {"engine": "transformers"}, "model": {"lora": {"r": 16}}},
            30 * B,
            [],
        ),  # LoRA: a ring of factors
        # an actor of N ranks: each GPU holds 1/N of the weights, gradients and AdamW state
        ({"actor": {"count": 2}}, 14 * B, []),  # 56 GB a GPU
        ({"actor": {"count": 2}}, 24 * B, ["spec.actor.gpu"]),  # 96 GB a GPU
        ({"actor": {"count": 2, "cpuOffload": True}}, 24 * B, []),  # in host memory
        (
            {"actor": {"count": 2}, "sync": {"method": "ipc"}, "generation": {"engine": "transformers"}},
            9 * B,
            ["spec.actor.gpu"],
        ),  # 36 GB + 3 snapshots (54 GB) on rank 0's GPU
        (
            {"actor": {"count": 2}, "rollout": {"colocate": True, "replicas": 2}},
            12 * B,
            [],
        ),  # 48 + 24 GB a GPU
        # mixedPrecision: float32 master shards (4 bytes), rollouts and snapshots in bfloat16 (2 bytes)
        (
            {
                "model": {"dtype": "float32"},
                "actor": {"count": 2, "mixedPrecision": True},
                "rollout": {"colocate": True, "replicas": 2},
            },
            7 * B,
            [],
        ),  # 56 + 14 GB a GPU (float32 rollouts: 84)
        (
            {
                "model": {"dtype": "float32"},
                "actor": {"count": 2, "mixedPrecision": True},
                "rollout": {"colocate": True, "replicas": 2},
            },
            int(8.5 * B),
            ["spec.actor.gpu"],
        ),  # 68 + 17 GB
        (
            {"actor": {"count": 2}, "rollout": {"colocate": True, "replicas": 3}},
            12 * B,
            ["spec.actor.gpu"],
        ),  # 2 on one
        # strategy ddp: every rank holds the whole of it
        ({"actor": {"count": 2, "strategy": "ddp"}}, 9 * B, []),  # 72 GB a GPU (fsdp: 36)
        ({"actor": {"count": 2, "strategy": "ddp"}}, 11 * B, ["spec.actor.gpu"]),  # 88 GB a GPU (fsdp: 44)
        # reshardAfterForward false: + the whole model gathered, in the dtype it computes in, on every GPU
        ({"actor": {"count": 2, "reshardAfterForward": False}}, 12 * B, []),  # 48 + 24 GB a GPU
        ({"actor": {"count": 2, "reshardAfterForward": False}}, 14 * B, ["spec.actor.gpu"]),  # 56 + 28 GB
        (
            {
                "model": {"dtype": "float32"},
                "actor": {"count": 4, "mixedPrecision": True, "reshardAfterForward": False},
            },
            13 * B,
            [],
        ),  # 52 + 26 GB: the gathers in bfloat16 (in float32 they would be 52)
        (
            {
                "model": {"dtype": "float32"},
                "actor": {"count": 4, "mixedPrecision": True, "reshardAfterForward": False},
            },
            int(13.5 * B),
            ["spec.actor.gpu"],
        ),  # 54 + 27 GB
        # colocatedReplicas: the first N beside the actor, the others on GPUs of their own
        ({"rollout": {"colocatedReplicas": 1, "replicas": 3}}, int(7.6 * B), []),  # 61 + 15 GB on the actor's
        (
            {"rollout": {"colocatedReplicas": 2, "replicas": 3}},
            int(7.6 * B),
            ["spec.actor.gpu"],
        ),  # 61 + 30 GB
        (
            {"model": {"lora": {"r": 16}}, "rollout": {"colocatedReplicas": 1, "replicas": 2}},
            45 * B,
            ["spec.actor.gpu", "spec.rollout.gpu"],
        ),  # the other replica's 90 GB of weights on its own GPU
    ],
)
def test_refused_only_when_the_lower_bound_exceeds_the_gpu(sections, parameters, fields):
    assert [m.field for m in certain_misfits(spec(**sections), parameters)] == fields


def test_the_message_names_the_need_and_the_fixes():
    (misfit,) = certain_misfits(spec(), 14 * B)
    assert misfit.message.startswith(
        "H100 has 80 GB; a model of 14.00B parameters in bfloat16 (2 bytes each) needs at "
        "least 112.0 GB on it for weights, gradients and AdamW's two moments"
    )
    assert "model.lora" in misfit.message and "e.g. H200" in misfit.message


def test_a_sharded_actor_that_does_not_fit_is_told_to_shard_wider_or_offload():
    (misfit,) = certain_misfits(spec(actor={"count": 2}), 24 * B)
    assert "1/2 of the weights, gradients and AdamW's two moments (FSDP2 shards)" in misfit.message
    assert "actor.count: 4" in misfit.message and "model.lora" not in misfit.message


def test_a_replicated_actor_that_does_not_fit_is_told_to_shard():
    (misfit,) = certain_misfits(spec(actor={"count": 2, "strategy": "ddp"}), 11 * B)
    assert (
        "whole on each of 2 ranks (strategy ddp)" in misfit.message
        and "actor.strategy: fsdp" in misfit.message
    )
    assert "actor.count: 4" not in misfit.message


def test_keeping_the_gathered_model_through_the_step_is_counted_and_undoing_it_is_a_fix():
    (misfit,) = certain_misfits(spec(actor={"count": 2, "reshardAfterForward": False}), 14 * B)
    assert (
        "the whole model gathered from the forward to the backward (reshardAfterForward: false)"
        in misfit.message
    )
    assert "actor.reshardAfterForward: true" in misfit.message


def test_the_snapshot_ring_is_the_actors_kept_versions():
    """The spec's default is what a WeightPublisher keeps when not told (fit.py counts the spec's)."""
    assert spec().sync.keep_versions == KEEP_VERSIONS


def test_a_ring_that_does_not_fit_names_it_a_smaller_ring_and_the_volume_fix():
    (misfit,) = certain_misfits(spec(generation={"engine": "transformers"}), 6 * B)
    assert "+ 3 snapshots of the weights for sync ipc" in misfit.message
    assert "sync.keepVersions: 2" in misfit.message and "sync.method: volume" in misfit.message
    (of_two,) = certain_misfits(spec(generation={"engine": "transformers"}, sync={"keepVersions": 2}), 7 * B)
    assert "+ 2 snapshots of the weights" in of_two.message and "sync.keepVersions" not in of_two.message


def test_gpu_memory_table():
    assert gpu_memory("h100") == 80 * B and gpu_memory("A10G") == 24 * B
    assert gpu_memory("none") is None and gpu_memory("MI300X") is None


def test_parameters_are_counted_from_safetensors_headers(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-00001.safetensors"))
    fake_safetensors(tmp_path / "model-00002.safetensors", {"c": [1000, 2000]})
    assert count_parameters(str(tmp_path)) == 12 + 5 + 2_000_000


def test_unknown_models_have_no_count(tmp_path):
    assert count_parameters(str(tmp_path)) is None  # a folder without safetensors
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    assert count_parameters(str(tmp_path)) is None
    assert count_parameters("no-such-org/no-such-model-xyz") is None  # not in the cache; no network


def test_a_share_too_small_for_the_weights_says_the_least_share_that_holds_them():
    (misfit,) = certain_misfits(spec(rollout={"gpuMemoryUtilization": 0.1}), 7 * B)
    assert misfit.message.startswith(
        "0.1 of H100's 80 GB is 8.0 GB; the rollout's copy of a model of 7.00B "
        "parameters needs at least 14.0 GB of it"
    )
    assert "(at least 0.17)" in misfit.message


def test_a_colocated_share_that_crowds_out_the_actor_names_the_share_among_the_fixes():
    (misfit,) = certain_misfits(spec(rollout={"colocate": True, "gpuMemoryUtilization": 0.5}), 7 * B)
    assert (
        "needs at least 96.0 GB on it for weights, gradients and AdamW's two moments + 0.5 of the GPU for 1 "
        "colocated rollout," in misfit.message
    )
    assert "a smaller rollout.gpuMemoryUtilization" in misfit.message


# -- the micro batch chosen before launch (fit.fitting_micro_batch) ------------------------------------------
QWEN_3B = {
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
}  # Qwen2.5-3B's shape with SmolLM2's vocabulary (the bench's)
QWEN_3B_PARAMETERS = 2_880_000_000


def bench_spec(**sections):
    """The GPU bench's defaults: 8 prompts x 8 completions of 256 tokens, one colocated rollout, on an
    H100."""
    base = {
        "algorithm": {"numGenerations": 8, "batchSize": 64},
        "generation": {"maxTokens": 256},
        "rollout": {"colocate": True},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return spec(**base)


def test_the_3b_bench_is_estimated_not_to_fit_in_one_pass_and_gets_the_largest_micro_batch_that_does():
    from mortal.controller.fit import ModelShape, _actor_bound, activation_bytes, fitting_micro_batch

    s, shape = bench_spec(), ModelShape.from_config(QWEN_3B)
    assert certain_misfits(s, QWEN_3B_PARAMETERS) == []  # it may fit: only the activations are in question
    choice = fitting_micro_batch(s, QWEN_3B_PARAMETERS, shape)
    assert choice is not None and 64 % choice.size == 0 and choice.size < 64
    held, capacity = _actor_bound(s, QWEN_3B_PARAMETERS).need, gpu_memory("H100")
    assert (
        held + activation_bytes(s, shape, choice.size)
        <= capacity
        < held + activation_bytes(s, shape, choice.size * 2)
    )
    assert choice.reason.startswith(f"actor micro batch 64 -> {choice.size} before launch: H100's 80 GB hold")
    assert choice.reason.endswith("gradients accumulated: the same step")


def test_activations_scale_with_the_micro_batch_and_checkpointing_keeps_one_tensor_a_layer():
    from mortal.controller.fit import ModelShape, activation_bytes

    shape = ModelShape.from_config(QWEN_3B)
    s, checkpointed = bench_spec(), bench_spec(model={"gradientCheckpointing": True})
    head = 4 * shape.vocab * shape.hidden
    assert activation_bytes(s, shape, 32) - head == 2 * (activation_bytes(s, shape, 16) - head)
    assert activation_bytes(checkpointed, shape, 64) < activation_bytes(s, shape, 64) / 10


@pytest.mark.parametrize(
    "sections",
    [
        {
            "algorithm": {"microBatchSize": 64}
        },  # the user chose: theirs runs (an out-of-memory still heals it)
        {"actor": {"gpu": "none"}, "rollout": {"gpu": "none", "colocate": False}},  # a CPU: no GPU to fit
        {
            "actor": {"gpu": "H200"},
            "rollout": {"gpu": "H200"},
            "generation": {"maxTokens": 32},
        },  # it fits as it is
    ],
)
def test_no_micro_batch_is_chosen_where_the_user_chose_or_it_fits_or_there_is_no_gpu(sections):
    from mortal.controller.fit import ModelShape, fitting_micro_batch

    assert (
        fitting_micro_batch(bench_spec(**sections), QWEN_3B_PARAMETERS, ModelShape.from_config(QWEN_3B))
        is None
    )


def test_a_config_without_the_fields_has_no_shape():
    from mortal.controller.fit import ModelShape

    assert ModelShape.from_config({"model_type": "mamba", "d_model": 2048}) is None
    assert ModelShape.from_config({**QWEN_3B, "head_dim": 128}).kv_width == 256


def test_apply_annotates_a_run_whose_batch_does_not_fit_and_leaves_its_spec(tmp_path, capsys):
    """`mortalctl apply` reads config.json and the safetensors headers of a local model, and annotates the run
    with the micro batch the controller starts from (heal.FITTED_ANNOTATION); the spec stays the user's."""
    from mortal.client.apply import fit_micro_batches
    from mortal.controller.heal import FITTED_ANNOTATION

    (tmp_path / "config.json").write_text(json.dumps(QWEN_3B))
    fake_safetensors(tmp_path / "model.safetensors", {"w": [QWEN_3B_PARAMETERS // 1000, 1000]})
    doc = {
        "model": {"name": str(tmp_path)},
        "actor": {"gpu": "H100"},
        "rollout": {"gpu": "H100", "colocate": True},
        "algorithm": {"numGenerations": 8, "batchSize": 64},
        "generation": {"maxTokens": 256},
    }
    run = TrainingRun.model_validate(
        {"metadata": {"name": "big", "annotations": {"team": "rl"}}, "spec": doc}
    )
    [fitted] = fit_micro_batches([run])
    assert (
        fitted.metadata.annotations["team"] == "rl"
        and int(fitted.metadata.annotations[FITTED_ANNOTATION]) < 64
    )
    assert fitted.spec == run.spec
    assert "note: trainingrun/big: actor micro batch 64 -> " in capsys.readouterr().err
    doc["algorithm"]["microBatchSize"] = 32  # the user's choice: no annotation, a stale one dropped
    stale = {"metadata": {"name": "big", "annotations": {FITTED_ANNOTATION: "8"}}, "spec": doc}
    assert fit_micro_batches([TrainingRun.model_validate(stale)])[0].metadata.annotations == {}
