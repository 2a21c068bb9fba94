"""The local backend with real processes: launch, heartbeat, list, re-adopt, stop whole groups, GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from polling import wait_for

from mortal.controller.backends import (
    BackendUnavailable,
    InsufficientGPUs,
    UnknownBackend,
    WaitingForActorGPU,
    WorkerLaunch,
    select_backend,
)
from mortal.controller.backends.gpus import parse_nvidia_smi_list
from mortal.controller.backends.local import LocalBackend, parse_handle
from mortal.state import Store, WorkerRef, open_store, paths
from mortal.state.auth import launch_token
from mortal.workers import doorbell
from mortal.workers.simulated import simulated_run

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
EXIT_7 = [sys.executable, "-c", "import sys; sys.exit(7)"]
# Ignores SIGTERM and starts a grandchild that ignores it too; prints the grandchild's pid.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'\n"
    "child = subprocess.Popen([sys.executable, '-c', code])\n"
    "print('grandchild', child.pid, flush=True)\n"
    "time.sleep(600)\n",
]


# Starts a descendant in a session of its own (out of the worker's process group); prints its pid. As the
# worker does first thing (mortal.workers.main), it marks what its children inherit as not the worker.
ESCAPER = [
    sys.executable,
    "-c",
    "import os, subprocess, sys, time\n"
    "os.environ['MORTAL_WORKER_LEADER'] = '0'\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
    "start_new_session=True)\n"
    "print('escaped', child.pid, flush=True)\n"
    "time.sleep(600)\n",
]


def launch_spec(
    home: Path,
    run: str = "r",
    role: str = "rollout",
    replica: int = 0,
    incarnation: int = 1,
    state_url: str = "sqlite:///unused.db",
    run_uid: str = "",
    **kw: object,
) -> WorkerLaunch:
    ref = WorkerRef(run, role, replica, incarnation, run_uid=run_uid or None)
    return WorkerLaunch(
        run=run,
        role=role,
        replica=replica,
        incarnation=incarnation,
        worker_id=ref.process_id,
        state_url=state_url,
        mortal_home=str(home),
        run_uid=run_uid,
        **kw,
    )  # type: ignore[arg-type]


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie another parent (init) has yet to reap.

    A zombie that is *our* child is not gone: the backend must reap what it launched.
    """
    try:
        proc = psutil.Process(pid)
        return proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() != os.getpid()
    except psutil.NoSuchProcess:
        return True


def pid_of(handle: str) -> int:
    return parse_handle(handle)[0]


@pytest.fixture
def cleanup(mortal_home: Path) -> Iterator[None]:
    """Whatever a test leaves running in its home is stopped after it (no orphans between tests)."""
    yield
    backend = LocalBackend(mortal_home)
    for worker in backend.list():
        backend.stop(worker.handle, grace_seconds=0.5)


def test_launched_worker_heartbeats_is_listed_and_stops(
    store_url: str, mortal_home: Path, cleanup: None
) -> None:
    store = open_store(store_url)
    run = simulated_run("hb", max_steps=1000)
    store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
    row = store.create_worker(run.name, "rollout", 0, "local", lease_seconds=5.0)
    backend = LocalBackend(mortal_home)
    ref = WorkerRef(run.name, "rollout", 0, row.incarnation)
    handle = backend.launch(
        launch_spec(
            mortal_home,
            run.name,
            incarnation=row.incarnation,
            state_url=store_url,
            heartbeat_seconds=0.2,
            state_token=launch_token(store_url, ref),
        )
    )

    first = wait_for(lambda: _row(store, row.id).heartbeat_at, what="first heartbeat")
    wait_for(lambda: _row(store, row.id).heartbeat_at > first, what="a second heartbeat")
    assert _row(store, row.id).state == "Running"
    [listed] = backend.list(run.name)
    assert (listed.handle, listed.alive, listed.role, listed.incarnation) == (
        handle,
        True,
        "rollout",
        row.incarnation,
    )
    assert listed.worker_id == WorkerRef(run.name, "rollout", 0, row.incarnation).id
    assert backend.list("other-run") == []

    backend.stop(handle, grace_seconds=5.0)
    assert gone(pid_of(handle))
    assert backend.list(run.name) == []
    log = paths.worker_log(run.name, "rollout", 0, row.incarnation).read_text()
    assert "SIGTERM" in log and "stopped on request" in log
    backend.stop(handle)  # idempotent
    store.close()


def test_worker_environment_and_log_file(mortal_home: Path, cleanup: None) -> None:
    printer = [
        sys.executable,
        "-c",
        "import os; print({k: v for k, v in os.environ.items() "
        "if k.startswith(('MORTAL_', 'CUDA', 'SECRET', 'TORCHINDUCTOR_', 'TRITON_'))})",
    ]
    backend = LocalBackend(mortal_home, command=printer)
    spec = launch_spec(mortal_home, "envrun", role="actor", incarnation=4, env={"SECRET_TOKEN": "s3"})
    handle = backend.launch(spec)
    wait_for(lambda: not backend.list("envrun")[0].alive, what="exit")
    assert paths.worker_log("envrun", "actor", 0, 4).stat().st_mode & 0o777 == 0o600  # its owner's only
    env = eval(paths.worker_log("envrun", "actor", 0, 4).read_text())
    assert env["MORTAL_WORKER_ID"] == "envrun/actor-0#4" and env["MORTAL_INCARNATION"] == "4"
    assert env["MORTAL_HOME"] == str(mortal_home) and env["SECRET_TOKEN"] == "s3"
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # gpu "none"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(paths.compile_cache_dir() / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(paths.compile_cache_dir() / "triton")
    assert env[doorbell.DOORBELLS_ENV] == "1"  # the run's processes share this machine: they ring
    backend.stop(handle)


def test_a_log_path_linked_outside_the_run_is_refused_never_written_through(
    mortal_home: Path, cleanup: None, tmp_path: Path
) -> None:
    """The run's own code can plant links at the log paths of its later incarnations: the launch fails
    (LaunchFailed, the controller's backoff and events as for any failed start) and the file they point
    to is untouched."""
    from mortal.controller.backends.base import LaunchFailed

    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("ORIGINAL\n")
    backend = LocalBackend(mortal_home, command=[sys.executable, "-c", "print('written')"])
    log = paths.worker_log("linked", "actor", 0, 5)
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    with pytest.raises(LaunchFailed, match="linked/actor-0#5"):
        backend.launch(launch_spec(mortal_home, "linked", role="actor", incarnation=5))
    paths.logs_dir("moved").parent.mkdir(parents=True)
    paths.logs_dir("moved").symlink_to(outside, target_is_directory=True)  # the whole folder
    with pytest.raises(LaunchFailed):
        backend.launch(launch_spec(mortal_home, "moved", role="actor", incarnation=1))
    assert victim.read_text() == "ORIGINAL\n" and sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


CONTROLLERS_OWN = {
    "MODAL_TOKEN_ID": "ak-1",
    "MODAL_TOKEN_SECRET": "as-1",
    "HF_TOKEN": "hf_1",
    "MORTAL_STATE_TOKEN": "admin-1",
    "AWS_SECRET_ACCESS_KEY": "aws-1",
    "MORTAL_STORE_BACKING_URL": "postgresql://u:pw@db/m",
    "UNRELATED": "x",
}


def test_a_worker_sees_its_secrets_and_own_token_and_nothing_else_of_the_controllers(
    mortal_home: Path, cleanup: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        **CONTROLLERS_OWN,
        "WANDB_API_KEY": "wandb-1",
        "HF_HOME": "/hf",
        "LC_ALL": "C.UTF-8",
    }.items():
        monkeypatch.setenv(name, value)
    printer = [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"]
    backend = LocalBackend(mortal_home, command=printer)
    spec = launch_spec(
        mortal_home,
        "envrun",
        env={"WANDB_API_KEY": "wandb-1"},
        state_token="scoped-1",
        state_url="http://127.0.0.1:1",
    )
    handle = backend.launch(spec)
    wait_for(lambda: not backend.list("envrun")[0].alive, what="exit")
    env = json.loads(paths.worker_log("envrun", "rollout", 0, 1).read_text())
    assert env["WANDB_API_KEY"] == "wandb-1", "the spec's secrets"
    assert env["MORTAL_STATE_TOKEN"] == "scoped-1", "its own token, not the controller's"
    assert not set(CONTROLLERS_OWN) - {"MORTAL_STATE_TOKEN"} & set(env), sorted(env)
    assert not [v for v in env.values() if v in CONTROLLERS_OWN.values()]
    assert (env["PATH"], env["HF_HOME"], env["LC_ALL"]) == (os.environ["PATH"], "/hf", "C.UTF-8"), (
        "what it needs to run"
    )
    assert env["MORTAL_STATE_URL"] == "http://127.0.0.1:1" and env["MORTAL_RUN"] == "envrun"
    backend.stop(handle)


def test_exited_child_is_reaped_with_its_exit_code(mortal_home: Path, cleanup: None) -> None:
    backend = LocalBackend(mortal_home, command=EXIT_7)
    handle = backend.launch(launch_spec(mortal_home))
    worker = wait_for(lambda: next((w for w in backend.list() if not w.alive), None), what="exit")
    assert (worker.handle, worker.exit_code) == (handle, 7)
    assert gone(pid_of(handle)), "the exited child must be reaped, not left a zombie"
    backend.stop(handle)
    assert backend.list() == []


def test_stop_kills_the_whole_group_including_grandchildren(mortal_home: Path, cleanup: None) -> None:
    backend = LocalBackend(mortal_home, command=STUBBORN)
    handle = backend.launch(launch_spec(mortal_home))
    log = paths.worker_log("r", "rollout", 0, 1)
    line = wait_for(lambda: log.exists() and log.read_text().strip(), what="grandchild pid")
    grandchild = int(str(line).split()[1])
    assert psutil.pid_exists(grandchild)

    started = time.monotonic()
    backend.stop(handle, grace_seconds=0.5)
    assert time.monotonic() - started < 5
    assert gone(pid_of(handle)) and gone(grandchild)


def test_descendants_that_left_the_group_are_neither_listed_nor_left_behind(
    mortal_home: Path, cleanup: None
) -> None:
    backend = LocalBackend(mortal_home, command=ESCAPER)
    handle = backend.launch(launch_spec(mortal_home))
    log = paths.worker_log("r", "rollout", 0, 1)
    escaped = int(str(wait_for(lambda: log.exists() and log.read_text().strip(), what="pid")).split()[1])
    wait_for(lambda: psutil.Process(escaped).environ(), what="the descendant's environment")
    assert [w.handle for w in backend.list()] == [handle], "a descendant is not another worker"
    backend.stop(handle, grace_seconds=1.0)
    assert gone(pid_of(handle)) and gone(escaped)


def test_stopping_a_worker_killed_outright_kills_what_it_left(mortal_home: Path, cleanup: None) -> None:
    """A worker killed with SIGKILL (or crashed) leaves its children: its group and the descendants that left
    it. Once it is listed as exited the controller stops its handle (plan: every ended process), which
    kills them."""
    backend = LocalBackend(mortal_home, command=ESCAPER)
    handle = backend.launch(launch_spec(mortal_home))
    log = paths.worker_log("r", "rollout", 0, 1)
    escaped = int(str(wait_for(lambda: log.exists() and log.read_text().strip(), what="pid")).split()[1])
    wait_for(lambda: psutil.Process(escaped).environ(), what="the descendant's environment")
    backend.list()  # seen alive (the controller's pass lists before it judges)
    os.kill(pid_of(handle), signal.SIGKILL)
    wait_for(lambda: [w.alive for w in backend.list()] == [False], what="listed as exited")
    assert not gone(escaped)
    backend.stop(handle, grace_seconds=0.0)
    assert gone(escaped)


def test_launch_is_idempotent_per_worker_id(mortal_home: Path, cleanup: None) -> None:
    backend = LocalBackend(mortal_home, command=SLEEPER)
    first = backend.launch(launch_spec(mortal_home))
    assert backend.launch(launch_spec(mortal_home)) == first
    assert len(backend.list()) == 1


def test_a_run_applied_again_under_its_name_gets_processes_of_its_own(
    mortal_home: Path, cleanup: None
) -> None:
    """The same run, role, replica and incarnation, another uid: a straggler of the deleted run is not the new
    run's worker, in the launch or in the listing (each says which run it belongs to)."""
    backend = LocalBackend(mortal_home, command=SLEEPER)
    old = backend.launch(launch_spec(mortal_home, run_uid="old-uid"))
    new = backend.launch(launch_spec(mortal_home, run_uid="new-uid"))
    assert new != old
    listed = {w.handle: (w.worker_id, w.run_uid) for w in LocalBackend(mortal_home).list("r")}
    assert listed == {old: ("r/rollout-0#1@old-uid", "old-uid"), new: ("r/rollout-0#1@new-uid", "new-uid")}


def test_a_new_controller_readopts_workers_of_a_dead_one(mortal_home: Path, cleanup: None) -> None:
    """A worker launched by a controller process that then died is found by scanning, and stopped."""
    script = (
        "import sys\n"
        "from mortal.controller.backends.local import LocalBackend\n"
        "from mortal.controller.backends.base import WorkerLaunch\n"
        f"b = LocalBackend(command={SLEEPER!r})\n"
        "print(b.launch(WorkerLaunch(run='adopt', role='actor', replica=0, incarnation=9, "
        f"worker_id='adopt/actor-0#9', state_url='sqlite:///x.db', mortal_home={str(mortal_home)!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    handle = out.stdout.strip()

    backend = LocalBackend(mortal_home)
    [adopted] = backend.list("adopt")
    assert (adopted.handle, adopted.alive, adopted.incarnation, adopted.exit_code) == (handle, True, 9, None)
    assert LocalBackend(mortal_home.parent / "elsewhere").list() == [], "another home's workers are not ours"

    os.kill(pid_of(handle), signal.SIGKILL)  # dies behind our back: known, exited, code unknown
    worker = wait_for(lambda: next((w for w in backend.list("adopt") if not w.alive), None), what="death")
    assert worker.exit_code is None
    backend.stop(handle)
    assert backend.list("adopt") == []


def test_gpus_are_handed_out_from_the_live_listing(mortal_home: Path, cleanup: None) -> None:
    def devices() -> list[str]:
        return ["0", "1"]

    backend = LocalBackend(mortal_home, detect_gpus=devices, command=SLEEPER)
    a = backend.launch(launch_spec(mortal_home, replica=0, gpu="A100"))
    b = backend.launch(launch_spec(mortal_home, replica=1, gpu="A100"))
    assert {_visible(a), _visible(b)} == {"0", "1"}

    with pytest.raises(InsufficientGPUs) as busy:
        backend.launch(launch_spec(mortal_home, replica=2, gpu="A100"))
    assert not busy.value.permanent and busy.value.free == 0
    with pytest.raises(InsufficientGPUs) as too_many:
        LocalBackend(mortal_home, detect_gpus=devices).launch(
            launch_spec(mortal_home, replica=3, gpu="H100", gpu_count=3)
        )
    assert too_many.value.permanent and "has 2" in str(too_many.value)

    freed = _visible(a)
    backend.stop(a)
    fresh = LocalBackend(
        mortal_home, detect_gpus=devices, command=SLEEPER
    )  # a restarted controller recomputes
    c = fresh.launch(launch_spec(mortal_home, replica=2, gpu="A100"))
    assert _visible(c) == freed
    cpu = fresh.launch(launch_spec(mortal_home, replica=4, gpu="none"))
    assert _visible(cpu) == ""


def test_colocated_rollouts_share_the_actors_gpu_and_a_relaunched_actor_returns_to_it(
    mortal_home: Path, cleanup: None
) -> None:
    def one_gpu() -> list[str]:
        return ["0"]

    backend = LocalBackend(mortal_home, detect_gpus=one_gpu, command=SLEEPER)
    with pytest.raises(WaitingForActorGPU) as waiting:  # nothing to share yet: retried, not a failure
        backend.launch(launch_spec(mortal_home, replica=0, gpu="H100", colocate=True))
    assert isinstance(waiting.value, InsufficientGPUs) and not waiting.value.permanent
    actor = backend.launch(launch_spec(mortal_home, role="actor", gpu="H100"))
    rollouts = [
        backend.launch(launch_spec(mortal_home, replica=i, gpu="H100", colocate=True, incarnation=2 + i))
        for i in range(2)
    ]
    assert [_visible(h) for h in (actor, *rollouts)] == ["0", "0", "0"]
    with pytest.raises(InsufficientGPUs):  # the GPU is the actor's: another run cannot take it
        backend.launch(launch_spec(mortal_home, run="other", role="actor", gpu="H100"))

    backend.stop(actor)  # the rollouts live on and hold nothing: the new actor gets the same GPU
    fresh = LocalBackend(mortal_home, detect_gpus=lambda: ["1", "0"], command=SLEEPER)
    again = fresh.launch(launch_spec(mortal_home, role="actor", gpu="H100", incarnation=9))
    assert _visible(again) == "0", "a relaunched actor goes back to the GPU its colocated rollouts use"


def test_a_sharded_actor_holds_a_gpu_per_rank_and_its_colocated_rollouts_take_them_in_turn(
    mortal_home: Path, cleanup: None
) -> None:
    def three_gpus() -> list[str]:
        return ["0", "1", "2"]

    backend = LocalBackend(mortal_home, detect_gpus=three_gpus, command=SLEEPER)
    actor = backend.launch(launch_spec(mortal_home, role="actor", gpu="H100", gpu_count=2))
    assert (
        _visible(actor) == "0,1" and backend.gpus_held(launch_spec(mortal_home, gpu="H100", gpu_count=2)) == 2
    )
    colocated = [
        backend.launch(
            launch_spec(
                mortal_home, replica=i, gpu="H100", colocate=True, sees_actor_gpus=True, incarnation=2 + i
            )
        )
        for i in range(3)
    ]
    # each on one of the actor's GPUs, seeing the others (the weights' ring is on rank 0's), holding none
    assert [_visible(h) for h in colocated] == ["0,1", "1,0", "0,1"]
    assert [_environ(h)["MORTAL_GPU_PEERS"] for h in colocated] == ["1", "0", "1"]
    own = backend.launch(launch_spec(mortal_home, replica=3, gpu="H100", sees_actor_gpus=True, incarnation=5))
    assert (_visible(own), _environ(own)["MORTAL_GPU_PEERS"]) == ("2,0,1", "0,1")

    backend.stop(
        actor
    )  # a restarted controller: the colocated rollouts hold nothing, the relaunch takes 0 and 1
    fresh = LocalBackend(mortal_home, detect_gpus=three_gpus, command=SLEEPER)
    again = fresh.launch(launch_spec(mortal_home, role="actor", gpu="H100", gpu_count=2, incarnation=9))
    assert _visible(again) == "0,1"


def test_a_rollout_that_syncs_over_ipc_sees_the_actors_gpu_after_its_own_without_holding_it(
    mortal_home: Path, cleanup: None
) -> None:
    def two_gpus() -> list[str]:
        return ["0", "1"]

    backend = LocalBackend(mortal_home, detect_gpus=two_gpus, command=SLEEPER)
    with pytest.raises(WaitingForActorGPU):  # no actor GPU to show yet: retried, not a failure
        backend.launch(launch_spec(mortal_home, gpu="H100", sees_actor_gpus=True))
    actor = backend.launch(launch_spec(mortal_home, role="actor", gpu="H100"))
    rollout = backend.launch(launch_spec(mortal_home, gpu="H100", sees_actor_gpus=True, incarnation=2))
    assert (_visible(actor), _visible(rollout)) == ("0", "1,0")  # its own GPU is its cuda:0
    assert _environ(rollout)["MORTAL_GPU_PEERS"] == "0"

    backend.stop(actor)  # a restarted controller sees the rollout holding GPU 1 only: GPU 0 is free again
    fresh = LocalBackend(mortal_home, detect_gpus=two_gpus, command=SLEEPER)
    again = fresh.launch(launch_spec(mortal_home, role="actor", gpu="H100", incarnation=9))
    assert _visible(again) == "0"


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(select_backend("local"), LocalBackend)
    monkeypatch.setitem(sys.modules, "modal", None)  # `import modal` fails, as where it is not installed
    with pytest.raises(BackendUnavailable, match=r"pip install 'mortal\[cloud\]'"):
        select_backend("modal")
    with pytest.raises(UnknownBackend):
        select_backend("k8s")


def test_parse_nvidia_smi_list() -> None:
    text = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n"
        "  MIG 1g.10gb Device 0: (UUID: MIG-cccc)\n"
    )
    assert parse_nvidia_smi_list(text) == ["0", "1"]
    assert parse_nvidia_smi_list("") == []


def _environ(handle: str) -> dict[str, str]:
    """The worker's environment (waiting out the instant after exec when /proc shows none)."""
    return wait_for(lambda: psutil.Process(pid_of(handle)).environ(), what="environment")


def _visible(handle: str) -> str:
    return _environ(handle).get("CUDA_VISIBLE_DEVICES", "")  # psutil drops empty values


def _row(store: Store, worker_id: int):  # noqa: ANN202
    return next(w for w in store.list_workers() if w.id == worker_id)
