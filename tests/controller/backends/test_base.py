"""WorkerLaunch.environ puts torch.compile's caches in MORTAL_HOME's compile-cache folder, shared by every
run, unless the user chose their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from mortal.controller.backends import WorkerLaunch
from mortal.controller.backends.base import own_run_folder, torch_default_cache_dir
from mortal.controller.backends.local import LocalBackend
from mortal.state import paths
from mortal.state.containment import PathOutside


def launch(**kw: object) -> WorkerLaunch:
    return WorkerLaunch(
        run="r",
        role="rollout",
        replica=0,
        incarnation=3,
        worker_id="r/rollout-0#3",
        state_url="sqlite:///unused.db",
        mortal_home="/home/m",
        **kw,
    )  # type: ignore[arg-type]


def test_compile_caches_are_in_the_homes_folder_shared_by_runs_with_both_caches_on() -> None:
    env = launch().environ({}, None)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/home/m/compile-cache/inductor"
    assert env["TRITON_CACHE_DIR"] == "/home/m/compile-cache/triton"
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1" and env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == paths.compile_cache_dir("/home/m")
    other_run = WorkerLaunch(
        run="other",
        role="actor",
        replica=0,
        incarnation=0,
        worker_id="other/actor-0#0",
        state_url="sqlite:///unused.db",
        mortal_home="/home/m",
    ).environ({}, None)
    assert other_run["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]


def test_a_modal_container_keeps_them_on_its_own_mount_of_the_volume() -> None:
    env = launch().environ({}, None, mortal_home="/vol")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/vol/compile-cache/inductor"
    assert env["TRITON_CACHE_DIR"] == "/vol/compile-cache/triton"


def test_what_the_user_set_wins_each_variable_on_its_own() -> None:
    inherited = {"TORCHINDUCTOR_CACHE_DIR": "/mine/inductor", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    env = launch().environ(inherited, None)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/mine/inductor" and env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
    assert env["TRITON_CACHE_DIR"] == "/home/m/compile-cache/triton"
    # the spec's env (secrets, extra variables) is the user's too
    env = launch(env={"TRITON_CACHE_DIR": "/spec/triton"}).environ({}, None)
    assert env["TRITON_CACHE_DIR"] == "/spec/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/home/m/compile-cache/inductor"


def test_torchs_own_default_written_back_by_a_launcher_that_imported_torch_is_no_users_choice() -> None:
    env = launch().environ({"TORCHINDUCTOR_CACHE_DIR": torch_default_cache_dir()}, None)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/home/m/compile-cache/inductor"


def test_the_default_is_computed_as_torch_computes_it() -> None:
    cache_dir_utils = pytest.importorskip("torch._inductor.runtime.cache_dir_utils")
    assert torch_default_cache_dir() == cache_dir_utils.default_cache_dir()


def test_delete_purge_of_a_run_leaves_the_shared_compile_cache_to_the_others(mortal_home: Path) -> None:
    entry = paths.compile_cache_dir() / "inductor" / "fxgraph" / "entry"
    entry.parent.mkdir(parents=True)
    entry.write_text("compiled")
    paths.run_dir("r").mkdir(parents=True)
    LocalBackend(mortal_home).remove_run_files("r")
    assert not paths.run_dir("r").exists()
    assert entry.read_text() == "compiled"


NEEDED = [
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "CUDA_HOME",
    "HF_HOME",
    "WANDB_MODE",
    "TOKENIZERS_PARALLELISM",
    "MODAL_IS_REMOTE",
    "MORTAL_THREADS",
    "NCCL_DEBUG",
]
CREDENTIALS = [
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "MODAL_TOKEN_ID",
    "MODAL_TOKEN_SECRET",
    "MORTAL_STATE_TOKEN",
    "MORTAL_STATE_PREVIOUS_TOKENS",
    "AWS_SECRET_ACCESS_KEY",
    "OPENAI_API_KEY",
    "MORTAL_STORE_BACKING_URL",
    "GITHUB_TOKEN",
    "DATABASE_URL",
    "SSH_AUTH_SOCK",
]


def test_a_worker_keeps_what_it_needs_to_run_and_none_of_the_launchers_credentials() -> None:
    env = launch(env={"OPENAI_API_KEY": "from-the-spec"}, state_token="its-own").environ(
        {name: "launcher's" for name in NEEDED + CREDENTIALS}, None
    )
    assert all(env[name] == "launcher's" for name in NEEDED)
    assert [name for name in CREDENTIALS if name in env] == ["MORTAL_STATE_TOKEN", "OPENAI_API_KEY"]
    assert (env["MORTAL_STATE_TOKEN"], env["OPENAI_API_KEY"]) == ("its-own", "from-the-spec")
    assert "its-own" not in repr(launch(state_token="its-own")) and "from-the-spec" not in repr(
        launch(env={"OPENAI_API_KEY": "from-the-spec"})
    )
    assert "MORTAL_STATE_TOKEN" not in launch().environ({"MORTAL_STATE_TOKEN": "admin"}, None), (
        "a SQL store's worker"
    )


def test_a_run_s_own_settings_come_from_its_launch_never_from_the_launcher_s_environment() -> None:
    stray = {"MORTAL_CODE_SNAPSHOT": "ab" * 32, "MORTAL_MICRO_BATCH_SIZE": "1", "MORTAL_ROLLOUT_SHARE": "0.1"}
    env = launch().environ(stray, None)
    assert not set(stray) & set(env), "a run without a snapshot or a memory choice gets none"
    chosen = {"MORTAL_CODE_SNAPSHOT": "cd" * 32, "MORTAL_MICRO_BATCH_SIZE": "2"}
    assert launch(env=chosen).environ(stray, None).items() >= chosen.items()


def test_a_deleted_runs_kept_folder_is_moved_aside_by_its_uid(mortal_home: Path) -> None:
    log = paths.worker_log("r", "actor", 0, 1)
    log.parent.mkdir(parents=True)
    log.write_text("the old run's line\n")
    backend = LocalBackend(mortal_home)
    backend.set_aside_run_folder("r", "uid-1")
    assert not paths.run_dir("r").exists()
    assert (paths.kept_run_dir("r", "uid-1") / "logs" / log.name).read_text() == "the old run's line\n"
    backend.set_aside_run_folder("r", "uid-1")  # a pass retried after the move: nothing left to move
    assert paths.kept_run_dir("r", "uid-1").is_dir()


def test_a_deleted_runs_folder_is_not_moved_through_a_link_out_of_mortal_home(
    mortal_home: Path, tmp_path
) -> None:
    """$MORTAL_HOME/deleted that is a link elsewhere is refused (PathOutside: the run's rows are purged and
    its files left where they are, with a warning), never followed."""
    log = paths.worker_log("r", "actor", 0, 1)
    log.parent.mkdir(parents=True)
    log.write_text("the old run's line\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    paths.kept_runs_dir().symlink_to(outside)
    with pytest.raises(PathOutside):
        LocalBackend(mortal_home).set_aside_run_folder("r", "uid-1")
    assert list(outside.iterdir()) == [] and log.is_file()


def test_a_runs_folder_that_links_to_another_runs_folder_is_not_its_own(mortal_home: Path) -> None:
    """Inside runs/ but not the run's own: moving or removing it would take the other run's files."""
    other = paths.checkpoints_dir("other")
    other.mkdir(parents=True)
    paths.run_dir("r").symlink_to(paths.run_dir("other"))
    backend = LocalBackend(mortal_home)
    for refused in (
        own_run_folder,
        backend.remove_run_folder,
        lambda run: backend.set_aside_run_folder(run, "u"),
    ):
        with pytest.raises(PathOutside, match="as a folder of its own"):
            refused("r")
    assert other.is_dir() and paths.run_dir("r").is_symlink()
    assert own_run_folder("other") == paths.run_dir("other").resolve()
