"""`backend: modal` end to end: a real controller, the Modal backend, the fake of the Modal calls it
makes (backends/modal_fake.py: each call's body and worker are real processes) and the HTTP store
(workers on Modal reach the store only over HTTP). A simulated run succeeds; a killed worker is
detected and relaunched; a restarted controller re-adopts the calls from the modal.Dict."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from realproc import FAST, Harness, harness, wait_for, wait_no_workers, worker_processes  # noqa: F401

from mortal.controller.backends import Backend, select_backend
from mortal.controller.backends.modal import ModalBackend
from mortal.controller.manager import Controller
from mortal.workers.simulated import simulated_run

sys.path.insert(0, str(Path(__file__).parent / "backends"))
from modal_fake import FakeModal  # noqa: E402

pytestmark = pytest.mark.parametrize("store_url", ["http"], indirect=True)


@pytest.fixture
def fake(mortal_home: Path) -> Iterator[FakeModal]:
    modal = FakeModal(volume=mortal_home)
    yield modal
    modal.shutdown()


def start(h: Harness, fake: FakeModal) -> Controller:
    """A controller whose modal backend is a new ModalBackend over the fake (a new controller process)."""
    def backends(name: str) -> Backend:
        return ModalBackend(modal=fake) if name == "modal" else select_backend(name)

    controller = Controller(h.store, h.url, FAST, backends=backends).start()
    h.controllers.append(controller)
    return controller


def modal_run(name: str, max_steps: int):
    return simulated_run(name, max_steps=max_steps, rollout_replicas=1, step_seconds=0.1,
                         spec={"backend": "modal", "restartPolicy": {"backoffSeconds": 0.5, "maxRestarts": 3},
                               "actor": {"gpu": "A100"}, "rollout": {"gpu": "A10G"}})


def test_a_modal_run_succeeds_through_the_controller(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    h = harness
    h.apply(modal_run("on-modal", max_steps=6))
    start(h, fake)
    final = h.wait_phase("on-modal", "Succeeded", timeout=40)
    assert final["step"] == 6 and final.get("restarts", 0) == 0
    assert sorted(gpu for _, gpu, _ in fake.spawned) == ["A100", "A10G"]
    rows = h.store.list_workers("on-modal")
    assert all(w.handle.startswith("modal:fc-") for w in rows) and len(rows) == 2
    wait_no_workers(h)
    [rollout] = [w for w in rows if w.role == "rollout"]
    box = fake.container(rollout.handle.removeprefix("modal:"))
    assert box.result.exists() and box.proc.returncode == 0, "stopped by cancellation, not by ending its container"
    ckpt = h.store.latest_checkpoint("on-modal")
    assert ckpt.step == 6 and Path(ckpt.path).is_relative_to(h.home / "runs" / "on-modal" / "checkpoints")


def test_a_killed_worker_is_detected_and_relaunched(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    h = harness
    h.apply(modal_run("kill", max_steps=24))
    start(h, fake)
    wait_for(lambda: (h.status("kill").get("step") or 0) >= 3, 30, "a few steps")
    [actor] = worker_processes(h.home, role="actor")
    os.kill(actor.pid, signal.SIGKILL)  # the worker process inside the call's container; the call returns -9
    final = h.wait_phase("kill", "Succeeded", timeout=45)
    actors = [w for w in h.store.list_workers("kill") if w.role == "actor"]
    assert [(w.state, w.exit_code) for w in actors] == [("Lost", -9), ("Succeeded", 0)]
    assert final["restarts"] == 1 and len(fake.spawned) == 3
    wait_no_workers(h)


def test_a_restarted_controller_readopts_the_calls(harness: Harness, fake: FakeModal) -> None:  # noqa: F811
    h = harness
    h.apply(modal_run("readopt", max_steps=24))
    first = start(h, fake)
    wait_for(lambda: (h.status("readopt").get("step") or 0) >= 3, 30, "a few steps")
    first.stop()  # workers keep running; nothing in memory survives, the Dict does
    start(h, fake)
    final = h.wait_phase("readopt", "Succeeded", timeout=45)
    assert len(fake.spawned) == 2, "no twin was launched"
    assert [w.state for w in h.store.list_workers("readopt") if w.role == "actor"] == ["Succeeded"]
    assert final.get("restarts", 0) == 0
    wait_no_workers(h)
