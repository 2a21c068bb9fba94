"""Weight sync `ipc`: a version is a snapshot on the actor's GPU that another process on that GPU copies
bit for bit, the actor's later training does not change a shared version, and a spec says when ipc
is possible. The snapshot layout runs everywhere; sharing needs a CUDA GPU (skipped without one)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from actor_helpers import tensors_sha256
from rollout_helpers import assets_available, make_tiny_model

from mortal.specs import TrainingRun
from mortal.specs.errors import SpecError
from mortal.workers import ipc_weights
from mortal.workers.weights import load_published, plain_state_dict

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_assets = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


def test_a_snapshot_is_one_flat_buffer_per_dtype_and_its_slots_give_back_every_tensor() -> None:
    state = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "c": torch.full((2,), 7.0)}
    buffers, slots = ipc_weights.snapshot(state)
    assert sorted(buffers) == ["bfloat16", "float32"] and buffers["float32"].numel() == 8
    for slot in slots:
        view = buffers[slot.dtype][slot.offset : slot.offset + slot.numel].view(slot.shape)
        assert torch.equal(view, state[slot.name])
    state["a"].add_(1)  # the source changes after the snapshot: the snapshot does not
    assert buffers["float32"][0] == 0


def test_copy_into_writes_the_models_own_tensors_in_place() -> None:
    model = torch.nn.Linear(3, 2)
    weight = model.weight
    ipc_weights.copy_into(model, {"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert model.weight is weight and torch.equal(model.weight, torch.ones(2, 3))


@pytest.mark.parametrize(("newest", "whole"), [(5, True), (6, True), (7, False), (9, False)])
def test_a_copy_is_whole_unless_the_slot_may_have_been_written_again(tmp_path: Path, newest: int, whole: bool) -> None:
    """Version 5 in a ring of 3 shares its slot with 8, written only after 7 is recorded."""
    import pickle

    (tmp_path / ipc_weights.IPC_FILE).write_bytes(pickle.dumps({"version": 5, "ring": 3}))
    assert ipc_weights.intact(tmp_path, newest_recorded=newest) is whole


def _spec(**overrides) -> dict:
    spec = {"model": {"name": "m"}, "dataset": {"name": "builtin:arithmetic"},
            "rewards": [{"function": "mortal.workers.rewards.builtin:short_answer"}],
            "actor": {"gpu": "H100"}, "rollout": {"gpu": "H100", "colocate": True},
            "generation": {"engine": "transformers"}}
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "mortal/v1", "kind": "TrainingRun", "metadata": {"name": "r"}, "spec": spec}


@pytest.mark.parametrize(("overrides", "method"), [
    ({}, "ipc"),
    ({"rollout": {"colocate": False}}, "ipc"),
    ({"rollout": {"colocate": False, "gpu": "none"}}, "volume"),
    ({"generation": {"engine": "auto"}}, "volume"),
    ({"backend": "modal"}, "volume"),
    ({"sync": {"method": "volume"}}, "volume"),
])
def test_auto_picks_ipc_only_for_gpu_transformers_rollouts_on_the_local_backend(overrides, method) -> None:
    assert TrainingRun.model_validate(_spec(**overrides)).spec.sync_method() == method


def test_ipc_where_it_cannot_reach_the_rollouts_is_refused_naming_the_field() -> None:
    from mortal.specs.dump import dump_yaml
    from mortal.specs.loader import load_text

    text = dump_yaml([_spec(backend="modal", sync={"method": "ipc"})])
    with pytest.raises(SpecError, match=r"run\.yaml.*sync\.method.*same host"):
        load_text(text, "run.yaml")


def _load_in_child(model_dir: str, version_dir: str, queue) -> None:
    """Runs in a fresh process on the same GPU: load the shared version, report the tensors' digest."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    load_published(model, version_dir)
    queue.put(tensors_sha256({k: v.cpu() for k, v in model.state_dict().items()}))


@pytest.mark.gpu
@needs_cuda
@needs_assets
def test_another_process_copies_a_shared_version_bit_for_bit_while_the_actor_trains_on(tmp_path: Path) -> None:
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
    queue = context.Queue()
    child = context.Process(target=_load_in_child, args=(str(model_dir), str(dest), queue))
    child.start()
    digest = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0 and digest == expected


def _train_through_controller(home: Path, name: str, spec: dict, gpus: str = "0") -> dict[int, float]:
    """Train `spec` to the end under a real controller given GPUs `gpus`; the loss by step."""
    import os
    import subprocess
    import sys
    import time

    from mortal.state import open_store

    url = f"sqlite:///{home / 'state.db'}"
    store = open_store(url)
    store.apply_run(name, TrainingRun.model_validate({"metadata": {"name": name}, "spec": spec}).spec_dict())
    env = dict(os.environ, MORTAL_HOME=str(home), MORTAL_STATE_URL=url, CUDA_VISIBLE_DEVICES=gpus,
               WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),  # the test rewards
                                                                  os.environ.get("PYTHONPATH", "")]))
    with open(home / "controller.log", "ab") as log:
        controller = subprocess.Popen([sys.executable, "-m", "mortal.controller"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while store.get_run(name).phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            time.sleep(0.5)
        row = store.get_run(name)
        assert row.phase == "Succeeded", (row.status, [e.message for e in store.list_events(name)])
        assert {w.method for w in store.list_weights(name)} == {spec["sync"]["method"]}
        return {m.step: m.value for m in store.list_metrics(name) if m.name == "loss"}
    finally:
        controller.terminate()
        controller.wait(timeout=30)
        store.close()


needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs two CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [
    pytest.param("colocated", marks=needs_cuda),
    pytest.param("two-gpus", marks=needs_two_gpus),
])
@needs_assets
def test_a_run_with_sync_ipc_trains_the_same_loss_curve_as_volume(tmp_path: Path, layout: str) -> None:
    """One GPU shared (colocated), or the actor on GPU 0 and the rollout on GPU 1 (GPU-to-GPU copy)."""
    from actor_helpers import actor_spec

    model_dir = make_tiny_model(tmp_path / "model", seed=0)
    losses = {}
    for method in ("volume", "ipc"):
        spec = actor_spec(str(model_dir), model={"dtype": "float32"}, actor={"gpu": "H100"},
                          rollout={"gpu": "H100", "replicas": 1, "colocate": layout == "colocated"},
                          generation={"engine": "transformers"}, algorithm={"maxSteps": 4},
                          sync={"method": method}, checkpoint={"every": 10, "keep": 1})
        (tmp_path / method).mkdir()
        losses[method] = _train_through_controller(tmp_path / method, f"sync-{method}", spec,
                                                   gpus="0" if layout == "colocated" else "0,1")
    assert sorted(losses["ipc"]) == sorted(losses["volume"]) == [1, 2, 3, 4]
    for step, loss in losses["volume"].items():
        assert losses["ipc"][step] == pytest.approx(loss, rel=1e-3, abs=1e-5), (step, losses)
