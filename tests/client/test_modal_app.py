"""The Modal app module built by the real `modal` library, offline (no network, no token).

What the library builds from mortal.client.modal_app: the names the backend looks up, each
function's volumes, secrets, timeout, retries, schedule, web endpoint and concurrency (Function.info()),
the options the library is handed where info() has no field (one store container, serialized=True),
and the image's recipe. The same in the editable install the README sets up and in a built wheel,
and `modal deploy -m mortal.client.modal_app` from a checkout getting as far as the token. Functions
ship by value: unpickled where the app module cannot be imported, the store endpoint still answers.
What only a live deploy can show is in backends/test_modal_live.py.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import modal
import pytest
from modal._serialization import Pickler  # the pickler modal deploys serialized functions with
from modal_offline import APP_MODULE, REFUSAL, RefusingModalAPI, describe

from mortal.controller.backends.modal import APP_NAME, VLLM_FUNCTION, WORKER_FUNCTION
from mortal.controller.reconciler import ControllerConfig

REPO = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("modal_offline.py")
RECORDED = {modal.App: ("function",), modal.Image: ("pip_install", "add_local_dir", "run_commands", "env")}
FUNCTIONS = {WORKER_FUNCTION, VLLM_FUNCTION, "execute", "store", "controller"}


def _recording(original: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> Any:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[1:], kwargs))  # without self
        return original(*args, **kwargs)

    return record


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The app module freshly imported with the real library; `built.handed[name]` holds the arguments
    the module handed to modal's App.function and Image builders (the library still does the building)."""
    handed: dict[str, list[Any]] = defaultdict(list)
    for cls, names in RECORDED.items():
        for name in names:
            monkeypatch.setattr(cls, name, _recording(getattr(cls, name), handed[name]))
    slim = modal.Image.debian_slim
    monkeypatch.setattr(
        modal.Image,
        "debian_slim",
        staticmethod(lambda **kw: handed["debian_slim"].append(((), kw)) or slim(**kw)),
    )
    monkeypatch.delenv("MORTAL_MODAL_APP", raising=False)
    monkeypatch.setenv("MORTAL_MODAL_SECRETS", "huggingface, wandb")
    package, _, name = APP_MODULE.rpartition(".")
    monkeypatch.delitem(sys.modules, APP_MODULE, raising=False)
    monkeypatch.delattr(
        importlib.import_module(package), name, raising=False
    )  # `from package import name` reads it
    module = importlib.import_module(APP_MODULE)
    module.handed = handed
    yield module
    sys.modules.pop(APP_MODULE, None)
    vars(sys.modules[package]).pop(name, None)  # the app imported before, if any, comes back with both


def test_the_app_defines_what_the_backend_looks_up(built: Any) -> None:
    assert isinstance(built.app, modal.App) and built.app.name == APP_NAME
    functions = describe(built)["functions"]
    assert set(functions) == FUNCTIONS
    assert all(
        isinstance(getattr(built, name), modal.Function)
        for name in ("worker", "rollout_vllm", "store", "controller")
    )
    user_secrets = ["modal.Secret.from_name('huggingface')", "modal.Secret.from_name('wandb')"]
    for name in (WORKER_FUNCTION, VLLM_FUNCTION):
        worker = functions[name]
        assert worker["volumes"]["/mortal"]["name"] == "mortal-data" and worker["max_retries"] == 0
        assert worker["gpus"] == [], "the GPU comes per call, from with_options(gpu=...)"
        assert worker["timeout"] == 24 * 3600
        assert worker["secrets"] == user_secrets, (
            "workers never hold the admin token: their launch carries their own"
        )
    assert functions["controller"]["secrets"] == ["modal.Secret.from_name('mortal-state')", *user_secrets]


def test_vllm_rollouts_run_on_an_image_with_vllm_and_the_trainers_torch(built: Any) -> None:
    """Two images, one recipe: the vLLM release and the torch it requires, pinned in one place."""
    options = {kw.get("name"): kw for _, kw in built.handed["function"] if kw.get("name")}
    assert options[VLLM_FUNCTION]["image"] is built.vllm_image and "image" not in options[WORKER_FUNCTION]
    torch, vllm = f"torch=={built.TORCH_VERSION}", f"vllm=={built.VLLM_VERSION}"
    assert [args for args, _ in built.handed["pip_install"]] == [(torch,), (torch, vllm)]
    assert [args for args, _ in built.handed["run_commands"]] == [
        (f"pip install '/opt/mortal[train,cloud]' {torch}",),
        (f"pip install '/opt/mortal[train,cloud]' {torch} {vllm}",),
    ]
    setup = (REPO / "scripts" / "setup-env.sh").read_text()
    assert f"MORTAL_TORCH_VERSION:-{built.TORCH_VERSION}" in setup, (
        "the torch tested here is the images' torch"
    )


def test_the_worker_functions_run_the_worker_and_commit_its_log(
    built: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each body does, run by the library's own local call: reload the volume, then run_worker with
    the volume's commit (the log's way onto the volume)."""
    from mortal.controller.backends import modal_worker

    volume = _Recorder()
    monkeypatch.setattr(built, "data_volume", volume)
    seen = []
    monkeypatch.setattr(modal_worker, "run_worker", lambda launch, **kw: seen.append((launch, kw)) or 7)
    for function in (built.worker, built.rollout_vllm):
        with pytest.warns(UserWarning, match="will not have access to the mounted Volume"):
            assert function.local({"run": "r"}) == 7
    assert volume.calls == ["reload", "reload"]
    assert [(launch, kw["commit"].__name__) for launch, kw in seen] == [({"run": "r"}, "commit")] * 2
    seen[0][1]["commit"]()
    assert volume.calls[-1] == "commit"


def test_the_execute_function_runs_a_rewards_trusted_code_on_its_container(built: Any) -> None:
    """What ModalFunctionExecutor maps its jobs over (mortal.workers.rewards.modal_sandbox)."""
    from mortal.workers.rewards.modal_sandbox import job_payload
    from mortal.workers.rewards.sandbox import Job, SandboxConfig

    info = describe(built)["functions"]["execute"]
    assert info["gpus"] == [] and info["max_retries"] == 0
    payload = job_payload(Job("import sys; print(sys.stdin.read())", stdin="x"), SandboxConfig(timeout=5))
    result = built.execute.local(payload)
    assert (result["success"], result["stdout"], result["confinement"]) == (True, "x\n", "none")


class _Recorder:
    """Stands in for the data volume inside a container: records reload() and commit()."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def reload(self) -> None:
        self.calls.append("reload")

    def commit(self) -> None:
        self.calls.append("commit")


def test_one_store_container_serves_the_web_endpoint(built: Any) -> None:
    store = describe(built)["functions"]["store"]
    assert store["web_info"] is not None and store["concurrency_info"]["max_inputs"] == 64
    assert store["volumes"]["/mortal-state"]["name"] == "mortal-state"
    assert store["secrets"] == ["modal.Secret.from_name('mortal-state')"]
    options = next(kw for _, kw in built.handed["function"] if "max_containers" in kw)
    assert options["min_containers"] == options["max_containers"] == 1, "SQLite has one writer"


def test_the_controller_is_scheduled_and_every_function_ships_serialized(built: Any) -> None:
    controller = describe(built)["functions"]["controller"]
    assert (
        controller["schedule"] == "Period(minutes=10)"
        and controller["volumes"]["/mortal"]["name"] == "mortal-data"
    )
    assert controller["timeout"] > built.CONTROLLER_RUN_SECONDS
    assert [kw.get("serialized") for _, kw in built.handed["function"]] == [True] * len(FUNCTIONS)


def test_a_controller_always_leads_so_a_failure_is_noticed_well_within_a_minute(built: Any) -> None:
    """The bound docs/modal.md states, from the constants: each scheduled call outlives the schedule's
    period, so the next one is up and standing by for the lease when this one hands it on (or dies).

    Worst case: a worker's container is preempted and Modal restarts the input elsewhere, so the call
    never ends and only the heartbeat says so (worker lease), just as the leader dies without releasing
    the lease (the standby waits for it to expire, then renews); then one pass, on a listing at most
    listing_max_age old. A call that ends (crash, error, vanished) is seen sooner: no heartbeat wait."""
    config = ControllerConfig()
    assert (
        built.CONTROLLER_RUN_SECONDS - built.SCHEDULE_MINUTES * 60 == built.CONTROLLER_OVERLAP_SECONDS >= 60
    ), "the next call needs time to start before this one stops"
    takeover = config.leader_lease_seconds + config.leader_renew_seconds
    one_pass = config.plan.active_resync_seconds + config.listing_max_age_seconds
    noticed = config.worker_lease_seconds + takeover + one_pass
    assert noticed == 17.5 and noticed < 20


def test_the_images_are_this_checkout_on_the_deployers_python(built: Any) -> None:
    assert isinstance(built.image, modal.Image) and isinstance(built.vllm_image, modal.Image)
    assert built.handed["debian_slim"] == [((), {"python_version": "{}.{}".format(*sys.version_info)})] * 2
    for (source, target), options in built.handed["add_local_dir"]:
        assert Path(source) == REPO and target == "/opt/mortal" and options["copy"] is True
    for (env,), _ in built.handed["env"]:
        assert env["MORTAL_HOME"] == "/mortal" and env["MORTAL_MODAL_VOLUME"] == "mortal-data"


def test_the_store_endpoint_serves_the_store(
    built: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORTAL_STATE_TOKEN", "modal-app-admin-token")
    monkeypatch.setenv("MORTAL_STORE_BACKING_URL", f"sqlite:///{tmp_path / 'state.db'}")
    with pytest.warns(UserWarning, match="will not have access to the mounted Volume"):
        wsgi = built.store.local()  # the library's own local call of the function's body
    status, answer = _apply_run(wsgi)
    assert status == "200 OK" and answer["result"][1] == "created"
    wsgi.store.close()


def _apply_run(wsgi: Any) -> tuple[str, Any]:
    body = json.dumps({"args": {"name": "r", "spec": {"model": {"name": "m"}}}}).encode()
    environ = {
        "PATH_INFO": "/v1/apply_run",
        "REQUEST_METHOD": "POST",
        "HTTP_AUTHORIZATION": "Bearer modal-app-admin-token",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
    }
    seen = []
    answer = json.loads(b"".join(wsgi(environ, lambda status, headers: seen.append(status))))
    return seen[0], answer


class _VolumeAsReference(Pickler):
    """Modal's deploy pickler, with a placeholder for the volume the worker names (offline, it has no id
    yet)."""

    def persistent_id(self, obj: Any) -> Any:
        return ("modal-object", repr(obj)) if isinstance(obj, modal.Volume) else super().persistent_id(obj)


CONTAINER = """
import io, json, pickle, sys
sys.modules["mortal.client.modal_app"] = None  # a container has the installed mortal, not this module
class Load(pickle.Unpickler):
    def persistent_load(self, pid):
        return type("Volume", (), {"ref": pid[1]})()
functions = {name: Load(open(path, "rb")).load()
             for name, path in zip(("worker", "rollout_vllm", "store", "controller"), sys.argv[1:])}
body = json.dumps({"args": {"name": "r", "spec": {"model": {"name": "m"}}}}).encode()
environ = {"PATH_INFO": "/v1/apply_run", "REQUEST_METHOD": "POST",
           "HTTP_AUTHORIZATION": "Bearer modal-app-admin-token",
           "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)}
seen = []
answer = json.loads(b"".join(functions["store"]()(environ, lambda status, headers: seen.append(status))))
volumes = [functions[name].__globals__["data_volume"].ref for name in ("worker", "rollout_vllm")]
print(json.dumps({"status": seen[0], "result": answer["result"][1],
                  "controller": functions["controller"].__name__, "volumes": volumes}))
"""


def _shipped(function: Any, path: Path) -> Path:
    """The bytes a deploy sends for a serialized function. modal's FunctionSourceInfo and Pickler are
    private: these tests are pinned to a modal minor (pyproject's test extra) and say so when it moves."""
    info = function._get_source_info()
    assert info.is_serialized(), "modal would import the function by module name in the container"
    if "data_volume" in info.get_globals():
        with path.open("wb") as out:
            _VolumeAsReference(out).dump(info.raw_f)
    else:
        path.write_bytes(info.serialized_function())
    return path


def test_functions_ship_by_value_and_run_without_the_app_module(built: Any, tmp_path: Path) -> None:
    """What serialized=True means in the container: no import of this module, only the installed mortal."""
    paths = [
        str(_shipped(getattr(built, name), tmp_path / f"{name}.pkl"))
        for name in ("worker", "rollout_vllm", "store", "controller")
    ]
    env = {
        **os.environ,
        "MORTAL_STATE_TOKEN": "modal-app-admin-token",
        "MORTAL_STORE_BACKING_URL": f"sqlite:///{tmp_path / 's.db'}",
    }
    out = subprocess.run(
        [sys.executable, "-c", CONTAINER, *paths],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "status": "200 OK",
        "result": "created",
        "controller": "controller",
        "volumes": ["modal.Volume.from_name('mortal-data')"] * 2,
    }


# -- installs: the README's editable one and a built wheel ---------------------------------------------------
def _probe(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(PROBE)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _deploy(
    env: dict[str, str], cwd: Path, url: str, module: str = APP_MODULE
) -> subprocess.CompletedProcess[str]:
    """The documented command, against the refusing API: it fails at the token, after building the app.

    PATH holds only this Python's folder: `modal deploy` starts `git log` and three other git commands in a
    task of its own (modal/runner.py, for the deployment's commit info) and the refusal can leave them
    pending, so asyncio prints their transports' teardown at exit, a Modal race under load and not this
    app's. Without git the task ends at once and any traceback left is one the app caused."""
    env = {
        **env,
        "PATH": str(Path(sys.executable).parent),
        "MODAL_SERVER_URL": url,
        "MODAL_TOKEN_ID": "ak-test",
        "MODAL_TOKEN_SECRET": "as-test",
        "MODAL_CONFIG_PATH": str(cwd / "absent.toml"),
    }
    return subprocess.run(
        [sys.executable, "-m", "modal", "deploy", "-m", module],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mortal built as a wheel and installed into a folder of its own (as tests/test_packaging.py does)."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp),
            str(REPO),
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(tmp / "site"),
            str(next(tmp.glob("mortal-*.whl"))),
        ],
        check=True,
        capture_output=True,
    )
    return tmp / "site"


def _installs(wheel_site: Path) -> dict[str, tuple[dict[str, str], Path]]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MORTAL_MODAL_APP", "MORTAL_MODAL_SECRETS", "PYTHONPATH")
    }
    return {
        "editable": ({**base}, REPO / "mortal"),
        "wheel": ({**base, "PYTHONPATH": str(wheel_site)}, wheel_site),
    }


def test_editable_and_wheel_installs_build_the_same_app(wheel_site: Path, tmp_path: Path) -> None:
    built = {name: _probe(env, tmp_path) for name, (env, _) in _installs(wheel_site).items()}
    for name, (_, root) in _installs(wheel_site).items():
        assert Path(built[name].pop("file")).is_relative_to(root), f"the {name} install's module was imported"
    assert built["editable"] == built["wheel"]
    assert set(built["wheel"]["functions"]) == FUNCTIONS


def test_modal_deploy_from_a_checkout_gets_as_far_as_the_token(wheel_site: Path, tmp_path: Path) -> None:
    with RefusingModalAPI() as url:
        for name, (env, _) in _installs(wheel_site).items():
            out = _deploy(env, tmp_path, url)
            assert out.returncode != 0 and REFUSAL in out.stdout + out.stderr, (name, out.stdout, out.stderr)
            assert "Traceback" not in out.stderr, (name, out.stderr)


def test_modal_deploy_of_the_old_module_path_builds_the_same_app(tmp_path: Path) -> None:
    """`modal deploy -m mortal.controller.modal_app`, as earlier docs say, goes through its shim to the
    app."""
    with RefusingModalAPI() as url:
        out = _deploy(
            {**os.environ, "MORTAL_MODAL_SECRETS": ""}, tmp_path, url, "mortal.controller.modal_app"
        )
    assert out.returncode != 0 and REFUSAL in out.stdout + out.stderr, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
