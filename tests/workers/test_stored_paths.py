"""The actor removes and loads only what its run owns: checkpoint and weight rows pointing outside the run's
folder (or leaving its storage prefix), and symlinks in that folder that lead out, are refused with a Warning
event on the run when it prunes, and never resumed from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from actor_helpers import create_run, worker_context
from store_kinds import sqlite_only

from mortal.state import paths
from mortal.state.containment import REFUSED_REASON
from mortal.workers.actor import trl_seam
from mortal.workers.actor.checkpoint import Checkpointer, checkpoint_dir
from mortal.workers.actor.storage import CheckpointStorage
from mortal.workers.sync.publisher import WeightPublisher

pytestmark = sqlite_only  # the subject is the worker
SPEC = {
    "model": {"name": "/nonexistent/model"},
    "dataset": {"name": "builtin:arith"},
    "rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
}
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth")


class FakeTrainer:
    def __init__(self, step: int) -> None:
        self.state = type("State", (), {"global_step": step})()


def fake_save(trainer: Any, dest: Path) -> None:
    for name in FILES:
        (dest / name).write_bytes(b"x" * 16)
    (dest / "trainer_state.json").write_text(json.dumps({"global_step": trainer.state.global_step}))


def complete_checkpoint(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True)
    fake_save(FakeTrainer(step), folder)
    (folder / "mortal.json").write_text(
        json.dumps({"run": "c", "step": step, "weight_version": step, "seed": 5})
    )
    return folder


@pytest.fixture
def checkpointer(store, monkeypatch: pytest.MonkeyPatch) -> Checkpointer:
    monkeypatch.setattr(trl_seam, "save_checkpoint", fake_save)
    ctx = worker_context(store, create_run(store, "c", SPEC), "actor")
    return Checkpointer(ctx.store, ctx.worker, every=2, keep=1, seed=5)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    return complete_checkpoint(tmp_path / "victim", 8)


def refusals(store) -> list[str]:
    return [e.message for e in store.list_events("c") if e.type == "Warning" and e.reason == REFUSED_REASON]


def test_pruning_never_removes_a_checkpoint_row_pointing_outside(
    checkpointer: Checkpointer, store, victim
) -> None:
    store.record_checkpoint(checkpointer.worker, 2, str(victim), 2)
    checkpointer.write(FakeTrainer(4), step=4, weight_version=4)  # keep=1: prunes step 2
    assert (victim / "model.safetensors").is_file()
    assert [c.step for c in store.list_checkpoints("c")] == [4]
    [message] = refusals(store)
    assert message.startswith(
        f"pruning checkpoint step-2: {victim} is not inside {paths.checkpoints_dir('c')}"
    )


def test_pruning_never_follows_a_symlink_in_the_runs_folder(
    checkpointer: Checkpointer, store, victim
) -> None:
    link = checkpoint_dir("c", 2)
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    store.record_checkpoint(checkpointer.worker, 2, str(link), 2)
    checkpointer.write(FakeTrainer(4), step=4, weight_version=4)
    assert (victim / "model.safetensors").is_file()
    [message] = refusals(store)
    assert f"(it resolves to {victim})" in message


def test_pruning_a_storage_row_that_leaves_the_runs_prefix_removes_nothing(
    store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trl_seam, "save_checkpoint", fake_save)
    bucket = tmp_path / "bucket"
    other = complete_checkpoint(bucket / "other" / "step-2", 2)
    ctx = worker_context(
        store, create_run(store, "c", {**SPEC, "checkpoint": {"uri": f"file://{bucket}"}}), "actor"
    )
    checkpointer = Checkpointer(
        ctx.store, ctx.worker, every=2, keep=1, seed=5, storage=CheckpointStorage(f"file://{bucket}", "c")
    )
    store.record_checkpoint(ctx.worker, 2, f"file://{bucket}/c/../other/step-2", 2)
    checkpointer.write(FakeTrainer(4), step=4, weight_version=4)
    assert (other / "model.safetensors").is_file()
    assert len(refusals(store)) == 1 and (bucket / "c" / "step-4" / "mortal.json").is_file()


def test_resume_never_loads_a_checkpoint_row_pointing_outside(
    checkpointer: Checkpointer, store, victim
) -> None:
    own = checkpointer.write(FakeTrainer(2), step=2, weight_version=2)
    store.record_checkpoint(checkpointer.worker, 8, str(victim), 8)  # newer, complete, not the run's
    row = checkpointer.resume_point()
    assert row is not None and (row.step, row.path) == (2, str(own))
    assert [c.step for c in store.list_checkpoints("c")] == [2], "the forged row is forgotten"
    assert (victim / "model.safetensors").is_file()
    [message] = refusals(store)
    assert message.startswith("resuming from checkpoint step-8: ")


def test_resume_never_loads_a_checkpoint_holding_a_symlink_that_leads_out(
    checkpointer: Checkpointer, store, tmp_path: Path
) -> None:
    secret = tmp_path / "weights-of-someone-else"
    secret.write_bytes(b"y" * 16)
    folder = checkpointer.write(FakeTrainer(2), step=2, weight_version=2)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(secret)
    assert checkpointer.resume_point() is None
    [message] = refusals(store)
    assert "model.safetensors is not inside" in message


def test_weight_pruning_never_removes_a_version_row_pointing_outside(store, tmp_path: Path) -> None:
    ctx = worker_context(store, create_run(store, "c", SPEC), "actor")
    outside = tmp_path / "outside-v0"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"z")
    own = paths.weights_dir("c") / "v1-i1"
    own.mkdir(parents=True)
    store.publish_weights(ctx.worker, 0, 0, str(outside))
    store.publish_weights(ctx.worker, 1, 1, str(own))
    store.publish_weights(ctx.worker, 2, 2, str(paths.weights_dir("c") / "v2-i1"))
    WeightPublisher(ctx.store, ctx.worker, keep=1).prune()
    assert (outside / "model.safetensors").is_file() and not own.exists()
    assert [w.version for w in store.list_weights("c")] == [2]
    [message] = refusals(store)
    assert message.startswith(f"pruning weight version 0: {outside} is not inside")


def test_the_simulated_workload_never_resumes_from_a_checkpoint_row_pointing_outside(
    store, tmp_path: Path
) -> None:
    from mortal.workers import simulated
    from mortal.workers.errors import FatalWorkerError

    run = simulated.simulated_run("c")
    store.apply_run("c", run.spec_dict(), annotations=run.metadata.annotations)
    ctx = worker_context(store, store.get_run("c").document(), "actor")
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / simulated.STATE_FILE).write_text(json.dumps({"step": 99, "weight_version": 99}))
    store.record_checkpoint(ctx.worker, 99, str(forged), 99)
    with pytest.raises(FatalWorkerError) as refused:
        simulated.resume(ctx)
    assert refused.value.reason == "CheckpointRefused" and len(refusals(store)) == 1


class RecordingEngine:
    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.transports: list[object] = []

    def load_weights(self, path: str, transport: object = None) -> None:
        self.loaded.append(path)
        self.transports.append(transport)


def test_a_rollout_never_loads_a_weight_version_row_pointing_outside(store, tmp_path: Path) -> None:
    from mortal.workers.errors import FatalWorkerError
    from mortal.workers.rollout.loop import RolloutWorker

    run = create_run(store, "c", SPEC)
    actor = worker_context(store, run, "actor")
    forged = tmp_path / "forged-v0"
    forged.mkdir()
    store.publish_weights(actor.worker, 0, 0, str(forged))
    engine = RecordingEngine()
    rollout = RolloutWorker(worker_context(store, run, "rollout"), engine, tokenizer=None, rewards=None)
    with pytest.raises(FatalWorkerError) as refused:
        rollout.refresh_weights()
    assert refused.value.reason == "WeightsRefused" and engine.loaded == []
    [message] = refusals(store)
    assert message.startswith(f"loading weight version 0: {forged} is not inside")


def test_a_rollout_loads_a_relative_weight_row_from_the_run_s_folder_it_was_checked_in(
    store, tmp_path: Path, monkeypatch
) -> None:
    """The path checked is the path loaded: a relative row is not read against the worker's working folder."""
    from mortal.workers.rollout.loop import RolloutWorker

    run = create_run(store, "c", SPEC)
    actor = worker_context(store, run, "actor")
    owned = paths.weights_dir("c") / "v0"
    owned.mkdir(parents=True)
    (tmp_path / "elsewhere" / "v0").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere")
    store.publish_weights(actor.worker, 0, 0, "v0")
    engine = RecordingEngine()
    RolloutWorker(
        worker_context(store, run, "rollout"), engine, tokenizer=None, rewards=None
    ).refresh_weights()
    assert engine.loaded == [str(owned.resolve())]


def test_a_rollout_loads_a_version_the_way_its_row_says_and_refuses_a_method_no_transport_implements(
    store,
) -> None:
    from mortal.workers.errors import FatalWorkerError
    from mortal.workers.rollout.loop import RolloutWorker
    from mortal.workers.sync.volume import VolumeTransport

    run = create_run(store, "c", SPEC)
    actor = worker_context(store, run, "actor")
    (paths.weights_dir("c") / "v0").mkdir(parents=True)
    store.publish_weights(actor.worker, 0, 0, str(paths.weights_dir("c") / "v0"), method="volume")
    engine = RecordingEngine()
    rollout = RolloutWorker(worker_context(store, run, "rollout"), engine, tokenizer=None, rewards=None)
    rollout.refresh_weights()
    assert [type(t) for t in engine.transports] == [VolumeTransport]
    store.publish_weights(actor.worker, 1, 1, str(paths.weights_dir("c") / "v1"), method="carrier-pigeon")
    with pytest.raises(FatalWorkerError) as refused:
        rollout.refresh_weights()
    assert refused.value.reason == "WeightsRefused" and "carrier-pigeon" in str(refused.value)
    assert len(engine.loaded) == 1
