"""A run trained end to end under a real controller subprocess, for the GPU tests of weight sync."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mortal.specs import TrainingRun
from mortal.state import open_store
from mortal.state.store import Store

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


def train_through_controller(
    home: Path, name: str, spec: dict, gpus: str = "0", while_running: Callable[[Store], None] | None = None
) -> dict[int, float]:
    """Train `spec` to the end under a real controller given GPUs `gpus`; the loss by step.
    `while_running(store)` is called every half second until the run ends (to inject a failure)."""
    url = f"sqlite:///{home / 'state.db'}"
    store = open_store(url)
    store.apply_run(name, TrainingRun.model_validate({"metadata": {"name": name}, "spec": spec}).spec_dict())
    env = dict(
        os.environ,
        MORTAL_HOME=str(home),
        MORTAL_STATE_URL=url,
        CUDA_VISIBLE_DEVICES=gpus,
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join(
            [
                str(Path(__file__).parent),  # the test rewards
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    )
    with open(home / "controller.log", "ab") as log:
        controller = subprocess.Popen(
            [sys.executable, "-m", "mortal.controller"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 300
        while store.get_run(name).phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            if while_running is not None:
                while_running(store)
            time.sleep(0.5)
        row = store.get_run(name)
        assert row.phase == "Succeeded", (row.status, [e.message for e in store.list_events(name)])
        assert {w.method for w in store.list_weights(name)} == {spec["sync"]["method"]}
        return {m.step: m.value for m in store.list_metrics(name) if m.name == "loss"}
    finally:
        controller.terminate()
        controller.wait(timeout=30)
        store.close()
