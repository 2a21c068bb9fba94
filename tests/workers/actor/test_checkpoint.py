"""mortal.workers.actor.checkpoint: complete or invisible, recorded after the files, pruned to `keep`.

The Trainer's own writer is replaced here by one that writes the same file names (the real one is
exercised in test_trl_seam.py and test_actor*.py); what is under test is atomicity and bookkeeping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from actor_helpers import create_run, worker_context

from mortal.state import paths
from mortal.workers.actor import checkpoint as checkpoint_module
from mortal.workers.actor import trl_seam
from mortal.workers.actor.checkpoint import Checkpointer, checkpoint_dir, is_complete, read_marker

SPEC = {
    "model": {"name": "/nonexistent/model"},
    "dataset": {"name": "builtin:arith"},
    "rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
}


class FakeTrainer:
    def __init__(self, step: int) -> None:
        self.state = type("State", (), {"global_step": step})()


def fake_save(trainer: Any, dest: Path) -> None:
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (dest / name).write_bytes(b"x" * 16)
    (dest / "trainer_state.json").write_text(json.dumps({"global_step": trainer.state.global_step}))


@pytest.fixture
def checkpointer(store, monkeypatch: pytest.MonkeyPatch) -> Checkpointer:
    monkeypatch.setattr(trl_seam, "save_checkpoint", fake_save)
    run = create_run(store, "c", SPEC)
    ctx = worker_context(store, run, "actor")
    fenced = []
    return Checkpointer(ctx.store, ctx.worker, every=2, keep=2, seed=5, fence=lambda: fenced.append(1))


def test_a_written_checkpoint_is_complete_recorded_and_marked(checkpointer: Checkpointer, store) -> None:
    path = checkpointer.write(FakeTrainer(4), step=4, weight_version=9)
    assert path == checkpoint_dir("c", 4) and is_complete(path)
    assert read_marker(path) == {"run": "c", "step": 4, "weight_version": 9, "seed": 5}
    row = store.latest_checkpoint("c")
    assert (row.step, row.path, row.weight_version, row.complete) == (4, str(path), 9, True)
    assert checkpointer.has(4) and not checkpointer.has(2)


def test_a_crash_mid_write_leaves_no_visible_checkpoint(
    checkpointer: Checkpointer, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpointer.write(FakeTrainer(2), step=2, weight_version=2)

    def crash(trainer: Any, dest: Path) -> None:
        (dest / "optimizer.pt").write_bytes(b"half")
        raise OSError("killed mid-write")

    monkeypatch.setattr(trl_seam, "save_checkpoint", crash)
    with pytest.raises(OSError):
        checkpointer.write(FakeTrainer(4), step=4, weight_version=4)
    assert [r.step for r in store.list_checkpoints("c")] == [2]
    assert sorted(p.name for p in paths.checkpoints_dir("c").iterdir()) == ["step-2"]
    assert checkpointer.resume_point().step == 2


def test_only_the_newest_keep_checkpoints_remain(checkpointer: Checkpointer, store) -> None:
    for step in (2, 4, 6, 8):
        checkpointer.write(FakeTrainer(step), step=step, weight_version=step)
    assert [r.step for r in store.list_checkpoints("c")] == [6, 8]
    assert sorted(p.name for p in paths.checkpoints_dir("c").iterdir()) == ["step-6", "step-8"]


def test_resume_point_skips_a_damaged_checkpoint_and_clears_leftovers(
    checkpointer: Checkpointer, store
) -> None:
    checkpointer.write(FakeTrainer(2), step=2, weight_version=2)
    newest = checkpointer.write(FakeTrainer(4), step=4, weight_version=4)
    (newest / "optimizer.pt").unlink()
    leftover = paths.checkpoints_dir("c") / ".tmp-step-6-abcd1234"
    leftover.mkdir()
    assert checkpointer.resume_point().step == 2
    assert [r.step for r in store.list_checkpoints("c")] == [2]
    assert not leftover.exists()


def test_a_checkpoint_left_unrecorded_by_a_crash_is_replaced(checkpointer: Checkpointer, store) -> None:
    stray = checkpoint_dir("c", 2)
    stray.mkdir(parents=True)
    (stray / "model.safetensors").write_bytes(b"old")
    path = checkpointer.write(FakeTrainer(2), step=2, weight_version=3)
    assert (path / "model.safetensors").read_bytes() == b"x" * 16 and read_marker(path)["weight_version"] == 3


def test_due_every_n_steps_and_at_the_last(checkpointer: Checkpointer) -> None:
    assert [s for s in range(7) if checkpointer.due(s, max_steps=7)] == [2, 4, 6]
    assert checkpointer.due(7, max_steps=7)
    assert checkpoint_module.MORTAL_FILE == "mortal.json"
