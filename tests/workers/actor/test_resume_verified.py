"""Verified resume end to end on a tiny CPU model (the real actor `main(ctx)`, the real rollout loop in a
thread): checkpoints and weight versions record what made them; a dataset file rewritten under an unchanged
spec is a refused resume that leaves the checkpoint as it was; the same change made through the spec is
allowed, with a Warning event, and training goes on from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from actor_helpers import actor_spec, create_run, file_sha256, run_actor_with_rollout
from rollout_helpers import assets_available, make_tiny_model

from mortal.workers.actor.checkpoint import read_marker
from mortal.workers.errors import FatalWorkerError
from mortal.workers.runtime import EXIT_SUCCEEDED

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")

ARITH = Path(__file__).resolve().parents[3] / "workers" / "builtin_data" / "arith.jsonl"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("resume") / "model")


def _end_workers(store, run: str) -> None:
    """What the controller does once an in-process worker 'exited': end its row."""
    for row in store.list_workers(run, live_only=True):
        store.end_worker(row.id, "Stopped")


def _checkpoint_files(path: str) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(Path(path).iterdir())}


def test_a_resume_is_verified_against_what_made_the_checkpoint(
    sqlite_store, tmp_path: Path, tiny_dir: Path
) -> None:
    store = sqlite_store
    data = tmp_path / "prompts.jsonl"
    lines = ARITH.read_text().splitlines()[:16]
    data.write_text("\n".join(lines) + "\n")
    spec = actor_spec(
        str(tiny_dir),
        dataset={"name": str(data)},
        algorithm={"maxSteps": 4},
        checkpoint={"every": 2, "keep": 3},
    )
    run = create_run(store, "verified", spec)
    assert run_actor_with_rollout(store, run, stop_after_step=2) == EXIT_SUCCEEDED
    _end_workers(store, "verified")

    # 1. what made the checkpoint of step 2 and each weight version, in the row and in the folder
    [ckpt] = store.list_checkpoints("verified")
    made = ckpt.provenance
    assert (
        made["specGeneration"] == 1 and made["dataset"]["rows"] == 16 and made["dataset"]["name"] == str(data)
    )
    assert made["position"] == {
        "step": 2,
        "promptsPerStep": 2,
        "seed": 0,
        "consumed": 4,
        "epoch": 0,
        "index": 4,
    }
    assert set(made["rewards"]) == {"parity_reward", "correct_answer"} and len(made["rewardCode"]) == 64
    assert read_marker(ckpt.path)["provenance"] == made
    weights = store.list_weights("verified")
    assert [w.provenance["position"]["step"] for w in weights] == [w.step for w in weights]
    assert all(w.provenance["dataset"] == made["dataset"] for w in weights)

    # 2. a row rewritten under the same spec: refused, and the checkpoint is left as it was
    before = _checkpoint_files(ckpt.path)
    data.write_text("\n".join([*lines[:15], lines[15].replace('"answer": "', '"answer": "1')]) + "\n")
    with pytest.raises(FatalWorkerError) as refused:
        run_actor_with_rollout(store, run)
    _end_workers(store, "verified")
    assert refused.value.reason == "ResumeRefused"
    assert "spec.dataset did not" in refused.value.message and str(data) in refused.value.message
    assert _checkpoint_files(ckpt.path) == before
    assert [c.step for c in store.list_checkpoints("verified")] == [2]
    assert max(w.step for w in store.list_weights("verified")) == 2  # it trained nothing

    # 3. the same rows chosen through the spec (a new generation): allowed, with a Warning event, from step 2
    changed = create_run(store, "verified", {**spec, "dataset": {"name": str(data), "maxSamples": 16}})
    assert run_actor_with_rollout(store, changed) == EXIT_SUCCEEDED
    events = [(e.type, e.reason) for e in store.list_events("verified")]
    assert ("Warning", "DatasetChanged") in events and ("Warning", "ResumeRefused") not in events
    steps = sorted(int(m.step) for m in store.list_metrics("verified", name="loss"))
    assert steps == [1, 2, 3, 4]  # steps 3 and 4 trained once, after step 2's checkpoint
    last = store.latest_checkpoint("verified")
    assert last.step == 4 and last.provenance["specGeneration"] == 2
    assert last.provenance["dataset"]["sha256"] != made["dataset"]["sha256"]
    assert (
        json.loads((Path(last.path) / "mortal.json").read_text())["provenance"]["position"]["consumed"] == 8
    )
