"""Live on Modal: deploy the app (as `mortal-test`, its own volumes and secret), then run a tiny simulated
run, and a sharded actor training a real model on CPUs, end to end: a controller here, workers as Modal calls,
the store behind the deployed endpoint, the checkpoint on the volume. Runs only with MODAL_TOKEN_ID (and
MODAL_TOKEN_SECRET) set; the first deploy builds the image, which takes several minutes.

    export MODAL_TOKEN_ID=... MODAL_TOKEN_SECRET=...
    pytest -m modal_live tests/controller/backends/test_modal_live.py
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from polling import wait_for

from mortal.controller.backends.modal import ModalBackend
from mortal.controller.manager import Controller
from mortal.state.http_store import HttpStore
from mortal.workers.simulated import simulated_run

pytestmark = [
    pytest.mark.modal_live,
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("MODAL_TOKEN_ID"), reason="talks to Modal: set MODAL_TOKEN_ID/SECRET"
    ),
]
APP = "mortal-test"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def deployed() -> tuple[str, str]:
    """(store URL, token): the secret written, the app deployed, the store endpoint answering."""
    modal = pytest.importorskip("modal")
    token = os.environ.get("MORTAL_STATE_TOKEN") or secrets.token_hex(24)
    env = {**os.environ, "MORTAL_MODAL_APP": APP}
    modal_cli = [sys.executable, "-m", "modal"]
    subprocess.run(
        [*modal_cli, "secret", "create", f"{APP}-state", f"MORTAL_STATE_TOKEN={token}", "--force"],
        env=env,
        check=True,
        cwd=REPO,
    )
    subprocess.run(
        [*modal_cli, "deploy", "-m", "mortal.client.modal_app"], env=env, check=True, cwd=REPO, timeout=1800
    )
    url = modal.Function.from_name(APP, "store").get_web_url()
    store = HttpStore(url, token=token, retry_seconds=300)
    store.list_runs()  # waits out the endpoint's cold start
    store.close()
    return url, token


def _finished_on_modal(store: HttpStore, url: str, name: str) -> tuple[Controller, dict]:
    """A controller here, the run's workers as Modal calls, until the run ends: the controller (the caller
    stops it after purging) and the run's final status."""
    import modal

    controller = Controller(
        store, url, holder=f"live-test-{name}", backends=lambda _: ModalBackend(modal=modal, app_name=APP)
    ).start()
    final = wait_for(
        lambda: (s := store.get_run(name).status).get("phase") in ("Succeeded", "Failed") and s,
        900,
        f"{name} to finish on Modal",
        interval=2.0,
    )
    return controller, final


def _purge(store: HttpStore, name: str) -> None:
    store.mark_deleted(name, purge=True)
    wait_for(lambda: name not in {r.name for r in store.list_runs()}, 300, f"{name} purged")


def test_a_simulated_run_succeeds_on_modal(
    deployed: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import modal

    url, token = deployed
    monkeypatch.setenv("MORTAL_STATE_TOKEN", token)
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path))  # the workers' home is the volume, whatever this is
    name = f"live-{uuid.uuid4().hex[:8]}"
    run = simulated_run(name, max_steps=4, rollout_replicas=1, step_seconds=0.2, spec={"backend": "modal"})
    store = HttpStore(url, token=token)
    store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
    controller = None
    try:
        controller, final = _finished_on_modal(store, url, name)
        assert final["phase"] == "Succeeded", final
        assert final["step"] == 4
        rows = store.list_workers(name)
        assert rows and all(w.handle.startswith("modal:fc-") for w in rows)
        ckpt = store.latest_checkpoint(name)
        volume = modal.Volume.from_name(f"{APP}-data")
        entries = volume.listdir(f"/runs/{name}/checkpoints")
        assert Path(ckpt.path).name in {Path(e.path).name for e in entries}, "the checkpoint was committed"
        [actor] = [w for w in rows if w.role == "actor"]
        log = b"".join(volume.read_file(f"runs/{name}/logs/actor-0-{actor.incarnation}.log")).decode()
        assert "actor done at step 4" in log, "the worker function committed the worker's log"
    finally:
        _purge(store, name)
        if controller is not None:
            controller.stop()
        store.close()
    gone = [
        e.path for e in _listed(modal.Volume.from_name(f"{APP}-data"), "runs") if e.path == f"runs/{name}"
    ]
    assert gone == [], "the purge removed the run's folder from the volume"


def test_a_sharded_actor_trains_a_real_model_in_one_container(
    deployed: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """actor {count: 2} on Modal's CPUs (no GPU bill): one call whose rank 0 starts rank 1 in its container, a
    real model from the hub (Modal's containers reach it), and each checkpoint on the volume holding both
    ranks' shards (docs/fsdp.md)."""
    import json

    import modal

    from mortal.specs import TrainingRun

    url, token = deployed
    monkeypatch.setenv("MORTAL_STATE_TOKEN", token)
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path))
    name = f"live-fsdp-{uuid.uuid4().hex[:8]}"
    run = TrainingRun.model_validate(
        {
            "metadata": {"name": name},
            "spec": {
                "backend": "modal",
                "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "dtype": "float32"},
                "dataset": {"name": "builtin:arith"},
                "rewards": [{"function": "mortal.workers.rewards.builtin:correct_answer"}],
                "actor": {"count": 2},
                "rollout": {"replicas": 1},
                "generation": {"engine": "transformers", "maxTokens": 8},
                "algorithm": {"numGenerations": 4, "batchSize": 8, "maxSteps": 2},
                "checkpoint": {"every": 1, "keep": 2},
            },
        }
    )
    store = HttpStore(url, token=token)
    store.apply_run(run.name, run.spec_dict())
    controller = None
    try:
        controller, final = _finished_on_modal(store, url, name)
        assert final["phase"] == "Succeeded" and final["step"] == 2, final
        volume = modal.Volume.from_name(f"{APP}-data")
        for row in store.list_checkpoints(name):
            folder = f"runs/{name}/checkpoints/{Path(row.path).name}"
            marker = json.loads(b"".join(volume.read_file(f"{folder}/mortal.json")))
            assert marker["ranks"] == 2, marker
            assert ".metadata" in {Path(e.path).name for e in volume.listdir(f"{folder}/dcp")}
    finally:
        _purge(store, name)
        if controller is not None:
            controller.stop()
        store.close()


def _listed(volume, path: str) -> list:
    try:
        return volume.listdir(path)
    except Exception:  # noqa: BLE001 - whatever a missing folder raises live (NotFoundError, FileNotFoundError)
        return []
