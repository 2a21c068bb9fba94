"""Fork and rollback end to end on a tiny CPU model: `mortalctl fork` / `mortalctl rollback` (CliRunner)
around the real actor `main(ctx)` with the real rollout loop in a thread (actor_helpers).

A fork of a finished run at step 2 trains steps 3.. from that checkpoint: its first published weights
are bit-for-bit the parent's at step 2, and with the parent's spec it ends with the parent's final
weights (it resumed exactly as a preempted run would); with --set learningRate it trains at the new
rate. A rollback forgets the later steps and trains them again from its checkpoint, bit-for-bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from actor_helpers import actor_spec, create_run, final_weights_hash, run_actor_with_rollout, tensors_sha256
from rollout_helpers import assets_available, make_tiny_model
from typer.testing import CliRunner

from mortal.client.cli.main import app
from mortal.specs import TrainingRun
from mortal.state import paths
from mortal.workers.runtime import EXIT_SUCCEEDED
from mortal.workers.sync.volume import read_published

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fork") / "model")


@pytest.fixture
def cli(sqlite_store, mortal_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MORTAL_NO_CONTROLLER", "1")
    monkeypatch.setenv("COLUMNS", "250")
    # the runs' reward (actor_helpers) is importable where mortal runs, as an installed package's would be:
    # a fork's admission imports it in a child process
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    runner = CliRunner()

    def invoke(*args: str):
        result = runner.invoke(app, ["--state-url", f"sqlite:///{mortal_home / 'state.db'}", *args])
        assert result.exit_code == 0, result.output
        return result.output

    return invoke


def _document(store, name: str) -> TrainingRun:
    row = store.get_run(name)
    return TrainingRun.from_record(row.name, row.spec, row.status, annotations=row.annotations, uid=row.uid)


def _weights_at(store, run: str, step: int) -> str:
    [row] = [w for w in store.list_weights(run) if w.step == step][:1]
    return tensors_sha256(read_published(row.path))


def _metric(store, run: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in store.list_metrics(run) if m.name == name}


def _end_workers(store, run: str) -> None:
    """What the controller does once an in-process worker 'exited': end its row."""
    for row in store.list_workers(run, live_only=True):
        store.end_worker(row.id, "Stopped")


def test_fork_of_a_finished_run_trains_on_from_its_checkpoint(sqlite_store, cli, tiny_dir: Path) -> None:
    store = sqlite_store
    spec = actor_spec(str(tiny_dir), algorithm={"maxSteps": 4}, checkpoint={"every": 2, "keep": 3})
    parent = create_run(store, "parent", spec)
    assert run_actor_with_rollout(store, parent) == EXIT_SUCCEEDED
    _end_workers(store, "parent")
    assert [c.step for c in store.list_checkpoints("parent")] == [2, 4]

    out = cli("fork", "parent:step-2", "child")
    assert "trainingrun/child created, forked from parent at step 2 (first step 3)" in out
    cli("fork", "parent:step-2", "child-lr", "--set", "spec.algorithm.learningRate=5e-3")
    ckpt = store.list_checkpoints("child")
    assert [(c.step, c.path) for c in ckpt] == [(2, str(paths.checkpoints_dir("child") / "step-2"))]
    assert "Forked from:" in cli("describe", "run", "child") and "parent at step 2" in cli(
        "describe", "run", "child"
    )

    assert run_actor_with_rollout(store, _document(store, "child")) == EXIT_SUCCEEDED
    assert sorted(_metric(store, "child", "loss")) == [3, 4]  # NEW's first step is N+1
    first = store.list_weights("child")[0]
    assert first.step == 2 and tensors_sha256(read_published(first.path)) == _weights_at(store, "parent", 2)
    assert final_weights_hash(store, "child") == final_weights_hash(store, "parent")  # an exact resume

    assert run_actor_with_rollout(store, _document(store, "child-lr")) == EXIT_SUCCEEDED
    parent_lr, child_lr = (
        _metric(store, "parent", "learning_rate"),
        _metric(store, "child-lr", "learning_rate"),
    )
    assert sorted(child_lr) == [3, 4]
    assert child_lr[3] == pytest.approx(
        parent_lr[3] * 5e-3 / 1e-2
    )  # the spec's rate, at the schedule's point
    assert final_weights_hash(store, "child-lr") != final_weights_hash(store, "parent")


def test_rollback_forgets_later_steps_and_trains_them_again_from_the_checkpoint(
    sqlite_store, cli, tiny_dir: Path
) -> None:
    store = sqlite_store
    spec = actor_spec(str(tiny_dir), algorithm={"maxSteps": 5}, checkpoint={"every": 2, "keep": 5})
    run = create_run(store, "r", spec)
    assert run_actor_with_rollout(store, run, stop_after_step=4) == EXIT_SUCCEEDED
    _end_workers(store, "r")
    assert [c.step for c in store.list_checkpoints("r")] == [2, 4]
    loss_before = _metric(store, "r", "loss")
    assert sorted(loss_before) == [1, 2, 3, 4]

    out = cli("rollback", "r", "--to", "step-2")
    assert (
        "trainingrun/r rolled back to step 2; later checkpoints: step-4 (kept in " in out and "resumed" in out
    )
    assert [c.step for c in store.list_checkpoints("r")] == [2]
    assert sorted(_metric(store, "r", "loss")) == [1, 2]
    [kept] = (paths.run_dir("r") / "rolled-back").glob("*/step-4")
    assert (kept / "model.safetensors").is_file() and not (paths.checkpoints_dir("r") / "step-4").exists()
    assert [e.reason for e in store.list_events("r")][-1] == "RolledBack"
    assert store.get_run("r").spec["suspend"] is False
    assert {w.step for w in store.list_workers("r") if w.step is not None} == {2}  # none claims a later step

    assert run_actor_with_rollout(store, _document(store, "r")) == EXIT_SUCCEEDED
    actor = [w for w in store.list_workers("r") if w.role == "actor"][-1]
    assert actor.step == 5
    loss_after = _metric(store, "r", "loss")
    assert sorted(loss_after) == [1, 2, 3, 4, 5]
    assert [loss_after[s] for s in (3, 4)] == [
        loss_before[s] for s in (3, 4)
    ]  # steps 3, 4 trained again alike
    assert [c.step for c in store.list_checkpoints("r")] == [2, 4, 5]
