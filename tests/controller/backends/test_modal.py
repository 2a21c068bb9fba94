"""The Modal backend against the fake of the Modal calls it makes (modal_fake.py): launch, list,
re-adoption, exit codes, failures, stop. The controller driving it for real: test_lifecycle_modal.py."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from modal_fake import FakeModal
from polling import wait_for

from mortal.controller.backends import (
    BackendError,
    BackendUnavailable,
    LaunchFailed,
    WorkerLaunch,
    select_backend,
)
from mortal.controller.backends import modal as modal_backend
from mortal.controller.backends.modal import ModalBackend, UnsupportedGPU, modal_gpu

BODIES = {"worker": "modal_fake:exit_after", "rollout_vllm": "modal_fake:exit_after"}


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeModal]:
    modal = FakeModal(volume=tmp_path, functions=BODIES)
    yield modal
    modal.shutdown()


def spec(replica: int = 0, gpu: str = "none", sleep: float = 30, code: int = 0, **fields) -> WorkerLaunch:
    return WorkerLaunch(
        run="r",
        role="rollout",
        replica=replica,
        incarnation=replica + 1,
        worker_id=f"r/rollout-{replica}#{replica + 1}",
        state_url="https://store.example",
        mortal_home="/mortal",
        gpu=gpu,
        env={"SLEEP": str(sleep), "CODE": str(code)},
        **fields,
    )


def test_spec_gpu_names_become_modal_gpu_strings() -> None:
    assert [modal_gpu(g) for g in ("none", "A100", "a10g", "h100", "A100-80G", "l40s", "H100!")] == [
        None,
        "A100",
        "A10G",
        "H100",
        "A100-80GB",
        "L40S",
        "H100!",
    ]
    assert modal_gpu("H100", count=2) == "H100:2" and modal_gpu("A100:4") == "A100:4"
    with pytest.raises(UnsupportedGPU, match=r"'V100' is not a Modal GPU type; use one of .*H100"):
        modal_gpu("V100")


def test_select_backend_needs_the_package_and_a_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake: FakeModal
) -> None:
    monkeypatch.setitem(sys.modules, "modal", fake)
    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_IS_REMOTE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "absent.toml"))
    with pytest.raises(BackendUnavailable, match="modal token new"):
        select_backend("modal")
    (tmp_path / "modal.toml").write_text('[default]\ntoken_id = "ak-1"\ntoken_secret = "as-1"\n')
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "modal.toml"))
    assert isinstance(select_backend("modal"), ModalBackend)


def test_launch_is_recorded_idempotent_and_readopted_by_a_new_backend(fake: FakeModal) -> None:
    backend = ModalBackend(modal=fake)
    handle = backend.launch(spec(gpu="A100", engine="transformers"))
    assert handle.startswith("modal:fc-") and fake.spawned[0][:2] == ("worker", "A100")
    assert backend.launch(spec(gpu="A100")) == handle and len(fake.spawned) == 1, "the running call is reused"
    entry = fake.dicts["mortal-workers"]["r/rollout-0#1"]
    assert (
        entry["call_id"],
        entry["run"],
        entry["role"],
        entry["replica"],
        entry["incarnation"],
        entry["function"],
    ) == (handle.removeprefix("modal:"), "r", "rollout", 0, 1, "worker")

    restarted = ModalBackend(modal=fake)  # a new controller: nothing in memory, the Dict remembers
    [worker] = restarted.list("r")
    assert (worker.handle, worker.worker_id, worker.alive, worker.exit_code) == (
        handle,
        "r/rollout-0#1",
        True,
        None,
    )
    assert restarted.list("other") == []
    wait_for(lambda: fake.container(handle.removeprefix("modal:")).started, 20, "the body to run")
    restarted.stop(handle, grace_seconds=5)  # delivered to the running body as InputCancellation
    assert restarted.list() == [] and fake.dicts["mortal-workers"] == {}
    with pytest.raises(fake.exception.RemoteError, match="cancelled"):
        fake.FunctionCall.from_id(handle.removeprefix("modal:")).get(timeout=0)
    assert fake.container(handle.removeprefix("modal:")).result.exists(), "the body saw the cancellation"


def test_exit_codes_failures_and_expired_outputs(fake: FakeModal) -> None:
    backend = ModalBackend(modal=fake)
    done = backend.launch(spec(0, sleep=0, code=7))
    crashed = backend.launch(dataclasses.replace(spec(1), env={"CODE": "not a number"}))
    expired = backend.launch(spec(2, sleep=0, code=0))

    def settled():
        listed = {w.handle: w for w in backend.list()}
        return listed if not any(w.alive for w in listed.values()) else None

    wait_for(
        lambda: all(
            fake.calls[h.removeprefix("modal:")].proc.poll() is not None for h in (done, crashed, expired)
        ),
        20,
        "the three calls to end",
    )
    fake.expire(expired.removeprefix("modal:"))
    listed = wait_for(settled, 10, "every call listed as ended")
    assert {h: (w.alive, w.exit_code) for h, w in listed.items()} == {
        done: (False, 7),
        crashed: (False, None),
        expired: (False, None),
    }
    assert all(e["ended_at"] is not None for e in fake.dicts["mortal-workers"].values())


def test_an_unreachable_modal_never_reads_as_an_exit(fake: FakeModal) -> None:
    backend = ModalBackend(modal=fake)
    backend.launch(spec())
    fake.unreachable = True
    with pytest.raises(BackendError, match="could not connect"):
        backend.list()
    fake.unreachable = False
    assert [w.alive for w in backend.list()] == [True]


def test_ended_calls_are_listed_for_a_while_then_forgotten(fake: FakeModal) -> None:
    now = [1000.0]
    backend = ModalBackend(modal=fake, exited_ttl_seconds=60, clock=lambda: now[0])
    handle = backend.launch(spec(sleep=0, code=0))
    wait_for(lambda: not backend.list()[0].alive, 20, "the call to end")
    now[0] += 59
    assert [w.handle for w in backend.list()] == [handle]
    now[0] += 2
    assert backend.list() == [] and fake.dicts["mortal-workers"] == {}


def test_stop_ends_the_container_of_a_call_that_ignores_cancellation(
    fake: FakeModal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(modal_backend, "CANCEL_MARGIN_SECONDS", 0.2)
    fake.apps["mortal"]["worker"] = "modal_fake:ignore_cancellation"
    backend = ModalBackend(modal=fake)
    marker = tmp_path / "deaf"
    handle = backend.launch(dataclasses.replace(spec(), env={"MARKER": str(marker)}))
    wait_for(marker.exists, 20, "the body to ignore cancellation")
    backend.stop(handle, grace_seconds=0.3)
    assert fake.calls[handle.removeprefix("modal:")].proc.poll() is not None
    assert backend.list() == []


def test_launch_failures_say_the_fix(fake: FakeModal) -> None:
    backend = ModalBackend(modal=fake)
    with pytest.raises(LaunchFailed, match="MORTAL_STATE_URL=https://"):
        backend.launch(dataclasses.replace(spec(), state_url="sqlite:////tmp/state.db"))
    with pytest.raises(LaunchFailed, match="modal deploy -m mortal.client.modal_app"):
        ModalBackend(modal=fake, app_name="not-deployed").launch(spec())
    fake.unreachable = True
    with pytest.raises(BackendError):
        backend.launch(spec())
    assert fake.spawned == []


@pytest.mark.parametrize(
    "role, engine, gpu, function",
    [
        ("rollout", "vllm", "A10G", "rollout_vllm"),
        ("rollout", "auto", "H100", "rollout_vllm"),  # auto on a GPU is vLLM: the image must have it
        ("rollout", "auto", "none", "worker"),  # auto on the CPU is transformers
        ("rollout", "transformers", "A10G", "worker"),
        ("actor", "vllm", "H100", "worker"),  # the trainer never generates with vLLM
    ],
)
def test_each_launch_is_a_call_of_the_function_whose_image_it_needs(
    fake: FakeModal, role, engine, gpu, function
) -> None:
    backend = ModalBackend(modal=fake)
    launch = dataclasses.replace(spec(gpu=gpu), role=role, engine=engine, worker_id=f"r/{role}-0#1")
    handle = backend.launch(launch)
    assert fake.spawned[0][:2] == (function, modal_gpu(gpu))
    assert fake.dicts["mortal-workers"][f"r/{role}-0#1"]["function"] == function
    assert [w.handle for w in backend.list("r")] == [handle]


def test_purging_a_run_removes_its_folder_from_the_volume(fake: FakeModal, tmp_path: Path) -> None:
    """`delete --purge` of a Modal run: through the client library, from a controller anywhere."""
    for run in ("gone", "kept"):
        (tmp_path / "runs" / run / "checkpoints" / "step-1-i1").mkdir(parents=True)
        (tmp_path / "runs" / run / "logs").mkdir()
        (tmp_path / "runs" / run / "logs" / "actor-0-1.log").write_text("step 1\n")
    backend = ModalBackend(modal=fake)
    backend.remove_run_files("gone")
    assert not (tmp_path / "runs" / "gone").exists() and (tmp_path / "runs" / "kept" / "logs").is_dir()
    backend.remove_run_files("gone")  # already gone: no error (a pass retried after a lost answer)
    fake.unreachable = True
    with pytest.raises(BackendError, match="could not connect"):
        backend.remove_run_files("kept")
    assert (tmp_path / "runs" / "kept").is_dir()


def test_every_call_holds_gpus_of_its_own_for_gpu_time(fake: FakeModal) -> None:
    backend = ModalBackend(modal=fake)
    assert [
        backend.gpus_held(spec(gpu=g, colocate=c))
        for g, c in (("none", False), ("H100", False), ("H100", True))
    ] == [0, 1, 1]  # a colocated rollout is still a container with its own GPU on Modal
    assert backend.gpus_held(spec(gpu="A100", gpu_count=2)) == 2


def test_a_run_s_code_snapshot_is_uploaded_to_the_volume_once(fake: FakeModal, tmp_path: Path) -> None:
    """The controller's MORTAL_HOME is not the volume: the snapshot the worker imports from must travel."""
    from mortal.state import paths

    digest = "cd" * 32
    home = tmp_path / "controller-home"
    local = paths.code_dir("r", digest, home)
    (local / "pkg").mkdir(parents=True)
    (local / "pkg" / "__init__.py").write_text("def f(completions, **kw):\n    return [1.0]\n")
    (local / "model").symlink_to(tmp_path)  # a linked local model folder stays behind
    launch = dataclasses.replace(spec(), mortal_home=str(home), env={paths.CODE_SNAPSHOT_ENV: digest})
    backend = ModalBackend(modal=fake)
    backend.ship_code(launch)
    on_volume = fake.volume / "runs" / "r" / "code" / digest
    assert (on_volume / "pkg" / "__init__.py").read_text() == (local / "pkg" / "__init__.py").read_text()
    assert not (on_volume / "model").exists()
    ModalBackend(modal=fake).ship_code(launch)  # a new controller finds it there: no second upload (no force)
    missing = dataclasses.replace(launch, env={paths.CODE_SNAPSHOT_ENV: "ef" * 32})
    with pytest.raises(LaunchFailed, match="is not on the controller's machine"):
        backend.ship_code(missing)


def test_two_runs_of_the_same_code_each_get_their_snapshot_on_the_volume(
    fake: FakeModal, tmp_path: Path
) -> None:
    """The snapshot lies under each run's folder: one run's upload does not stand for another's."""
    from mortal.state import paths

    digest = "ab" * 32
    home = tmp_path / "controller-home"
    for run in ("first", "second"):
        (paths.code_dir(run, digest, home) / "pkg").mkdir(parents=True)
        (paths.code_dir(run, digest, home) / "pkg" / "__init__.py").write_text("X = 1\n")
    backend = ModalBackend(modal=fake)
    for run in ("first", "second"):
        backend.ship_code(
            dataclasses.replace(spec(), run=run, mortal_home=str(home), env={paths.CODE_SNAPSHOT_ENV: digest})
        )
    for run in ("first", "second"):
        assert (fake.volume / "runs" / run / "code" / digest / "pkg" / "__init__.py").is_file(), run
    backend.remove_run_folder("first")  # delete --purge, then the same run applied again
    backend.ship_code(
        dataclasses.replace(spec(), run="first", mortal_home=str(home), env={paths.CODE_SNAPSHOT_ENV: digest})
    )
    assert (fake.volume / "runs" / "first" / "code" / digest / "pkg" / "__init__.py").is_file()
