"""Weight sync `ipc`: a version is a snapshot on the actor's GPU that another process on that GPU copies
bit for bit, the actor's later training does not change a shared version, and a spec says when ipc
is possible. The spec checks run everywhere; sharing needs a CUDA GPU (skipped without one). The ring
itself is in test_ring."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from actor_helpers import tensors_sha256
from rollout_helpers import assets_available, make_tiny_model
from run_helpers import needs_two_gpus, train_through_controller

from mortal.specs import TrainingRun
from mortal.specs.errors import SpecError
from mortal.workers.sync import ipc as ipc_weights
from mortal.workers.sync.ipc import IpcTransport
from mortal.workers.sync.weights import plain_state_dict

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_assets = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


def _spec(**overrides) -> dict:
    spec = {
        "model": {"name": "m"},
        "dataset": {"name": "builtin:arithmetic"},
        "rewards": [{"function": "mortal.workers.rewards.builtin:short_answer"}],
        "actor": {"gpu": "H100"},
        "rollout": {"gpu": "H100", "colocate": True},
        "generation": {"engine": "transformers"},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "mortal/v1", "kind": "TrainingRun", "metadata": {"name": "r"}, "spec": spec}


@pytest.mark.parametrize(
    ("overrides", "method"),
    [
        ({}, "ipc"),
        ({"rollout": {"colocate": False}}, "ipc"),
        ({"rollout": {"colocate": False, "gpu": "none"}}, "volume"),
        ({"generation": {"engine": "auto"}}, "volume"),
        ({"backend": "modal"}, "volume"),
        ({"sync": {"method": "volume"}}, "volume"),
        ({"model": {"lora": {"r": 16}}}, "ipc"),  # the ring holds only the adapters' factors
        ({"model": {"lora": {"r": 16}}, "sync": {"method": "volume"}}, "volume"),  # asked for: kept
    ],
)
def test_auto_picks_ipc_only_for_gpu_transformers_rollouts_on_the_local_backend(overrides, method) -> None:
    assert TrainingRun.model_validate(_spec(**overrides)).spec.sync_method() == method


def test_ipc_where_it_cannot_reach_the_rollouts_is_refused_naming_the_field() -> None:
    from mortal.specs.dump import dump_yaml
    from mortal.specs.loader import load_text

    text = dump_yaml([_spec(backend="modal", sync={"method": "ipc"})])
    with pytest.raises(SpecError, match=r"run\.yaml.*sync\.method.*same host"):
        load_text(text, "run.yaml")


def _load_in_child(model_dir: str, version_dir: str, queue, go_on) -> None:
    """Runs in a fresh process on the same GPU: load the shared version, report the tensors' digest and
    whether the slot still holds the version; once the actor has written on, whether it still does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    IpcTransport().load(model, version_dir)
    queue.put(
        (
            tensors_sha256({k: v.cpu() for k, v in model.state_dict().items()}),
            ipc_weights.slot_holds(version_dir),
        )
    )
    go_on.wait(120)
    queue.put(ipc_weights.slot_holds(version_dir))


@pytest.mark.gpu
@needs_cuda
@needs_assets
def test_another_process_copies_a_shared_version_bit_for_bit_while_the_actor_trains_and_sees_its_slot_reused(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "model", seed=1)
    actor_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    with torch.no_grad():
        for p in actor_model.parameters():
            p.add_(0.01)
    sharer = ipc_weights.IpcWeightSharer(ring=2)
    dest = sharer.share(plain_state_dict(actor_model), tmp_path / "v1", version=1, step=1)
    expected = tensors_sha256({k: v.cpu() for k, v in actor_model.state_dict().items()})
    with torch.no_grad():  # training goes on after publishing: the shared version must not move
        for p in actor_model.parameters():
            p.add_(1.0)
    context = multiprocessing.get_context("spawn")
    queue, go_on = context.Queue(), context.Event()
    child = context.Process(target=_load_in_child, args=(str(model_dir), str(dest), queue, go_on))
    child.start()
    digest, held = queue.get(timeout=120)
    for version in (2, 3):  # a ring of 2: version 3 is written into version 1's slot
        sharer.share(plain_state_dict(actor_model), tmp_path / f"v{version}", version=version, step=version)
    go_on.set()
    held_after = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0 and digest == expected
    assert held and not held_after


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("layout", "method", "lora"),
    [
        pytest.param("colocated", "ipc", False, marks=needs_cuda),
        pytest.param("colocated", "ipc", True, marks=needs_cuda),
        pytest.param("two-gpus", "ipc", False, marks=needs_two_gpus),
        pytest.param("two-gpus", "nccl", False, marks=needs_two_gpus),
        pytest.param("mixed", "ipc", False, marks=needs_two_gpus),
    ],
)
@needs_assets
def test_a_run_with_in_memory_sync_trains_the_same_loss_curve_as_volume(
    tmp_path: Path, layout: str, method: str, lora: bool
) -> None:
    """One GPU shared (colocated, ipc; with LoRA, the ring holding the adapters alone), or the actor on GPU 0
    and the rollout on GPU 1 (ipc: a GPU-to-GPU copy from the mapped ring; nccl: the actor sends the ring's
    slot), or both (mixed: rollout-0 beside the actor, rollout-1 on GPU 1, rollout.colocatedReplicas 1; one
    prompt a task, so which rollout answers a task changes nothing)."""
    from actor_helpers import actor_spec

    model_dir = make_tiny_model(tmp_path / "model", seed=0)
    losses = {}
    for sync in ("volume", method):
        spec = actor_spec(
            str(model_dir),
            model={"dtype": "float32", **({"lora": {"r": 4}} if lora else {})},
            actor={"gpu": "H100"},
            rollout={
                "gpu": "H100",
                "replicas": 2 if layout == "mixed" else 1,
                "colocate": layout == "colocated",
                **({"colocatedReplicas": 1, "promptsPerTask": 1} if layout == "mixed" else {}),
            },
            generation={"engine": "transformers"},
            algorithm={"maxSteps": 4},
            sync={"method": sync},
            checkpoint={"every": 10, "keep": 1},
        )
        (tmp_path / sync).mkdir()
        losses[sync] = train_through_controller(
            tmp_path / sync, f"sync-{sync}", spec, gpus="0" if layout == "colocated" else "0,1"
        )
    assert sorted(losses[method]) == sorted(losses["volume"]) == [1, 2, 3, 4]
    for step, loss in losses["volume"].items():
        assert losses[method][step] == pytest.approx(loss, rel=1e-3, abs=1e-5), (step, losses)
