"""mortal's Modal app: `modal deploy -m mortal.client.modal_app` (from a checkout; see docs/modal.md).

Five functions on two images (this checkout, pip-installed with its `train` extra; torch pinned to
TORCH_VERSION in both, the one VLLM_VERSION requires, so trainer and rollouts agree):

    worker(launch) -> int     one mortal worker per call, on the GPU ModalBackend asks for per call
    rollout_vllm(launch)      the same on the image with vLLM (ModalBackend picks the function per launch)
    execute(payload) -> dict  a reward's trusted code (sandbox backend modal)
    store                     the state store over HTTPS (mortal.state.http_server), one container
    controller                the controller, hosted: each scheduled call outlives the schedule's period,
                              so the next one stands by for the leader lease when this one hands it on

Runs, checkpoints and logs live on the `mortal-data` volume at /mortal (MORTAL_HOME). The admin token
(secret `mortal-state`) goes to the store and the controller only; the secrets named in
$MORTAL_MODAL_SECRETS go to workers and the controller (a worker's launch carries its own token).
Every function is `serialized=True` (shipped by value): a container runs the installed mortal and never
imports this module. Pickled code runs only on the Python series it was pickled on, so the image's
Python is the deployer's.
What it must not do: hold logic of its own. Each function is a thin wrapper of code tested on its own.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import modal

from mortal.controller.backends.modal import (
    DATA_MOUNT,
    VLLM_FUNCTION,
    WORKER_FUNCTION,
    data_volume_name,
    deployed_app_name,
)
from mortal.workers.rewards.modal_sandbox import EXECUTE_FUNCTION

APP = deployed_app_name()
STATE_MOUNT = "/mortal-state"
DATA_VOLUME, STATE_VOLUME = data_volume_name(APP), f"{APP}-state"
STATE_SECRET = f"{APP}-state"  # holds MORTAL_STATE_TOKEN
# The one place the two pins live: vLLM 0.32.0 requires torch==2.13.0 (its wheel's metadata), the torch
# scripts/setup-env.sh installs here too; the trainer's image gets the same torch.
VLLM_VERSION, TORCH_VERSION = "0.32.0", "2.13.0"
EXECUTE_TIMEOUT_SECONDS = 10 * 60  # one trusted reward job; the job's own timeout ends it sooner
WORKER_TIMEOUT_SECONDS = 24 * 3600  # Modal's longest; a worker cut off here is relaunched and resumes
SCHEDULE_MINUTES = 10  # a controller call starts this often
CONTROLLER_OVERLAP_SECONDS = 90  # ... and runs this much longer: the next one, standing by, takes over
CONTROLLER_RUN_SECONDS = SCHEDULE_MINUTES * 60 + CONTROLLER_OVERLAP_SECONDS
REPO = Path(__file__).resolve().parents[2]  # this checkout: mortal/client/ lies two folders below it
PYTHON = "{}.{}".format(*sys.version_info)  # the deployer's: serialized functions need the same series
IGNORED = [".git", ".venv", "**/__pycache__", "**/*.egg-info", "tests", "bench", "docs", "build", "dist"]

data_volume = modal.Volume.from_name(DATA_VOLUME, create_if_missing=True)
state_volume = modal.Volume.from_name(STATE_VOLUME, create_if_missing=True)
# Workers get the user's secrets only, never the admin token: each gets its own scoped token in its launch.
worker_secrets = [
    modal.Secret.from_name(name.strip())
    for name in os.environ.get("MORTAL_MODAL_SECRETS", "").split(",")
    if name.strip()
]
secrets = [modal.Secret.from_name(STATE_SECRET), *worker_secrets]  # the controller's


def mortal_image(*pins: str) -> modal.Image:
    """This checkout installed with its train and cloud extras over `pins` (pip requirements), which
    the same pip command holds to, so nothing mortal needs moves them."""
    return (
        modal.Image.debian_slim(python_version=PYTHON)
        .pip_install(*pins)  # a layer of its own: a code change does not reinstall torch (or vLLM)
        .add_local_dir(REPO, "/opt/mortal", copy=True, ignore=IGNORED)
        .run_commands(" ".join(["pip install '/opt/mortal[train,cloud]'", *pins]))
        .env(
            {
                "MORTAL_HOME": DATA_MOUNT,
                "MORTAL_MODAL_VOLUME": DATA_VOLUME,
                "MORTAL_MODAL_APP": APP,
                "PYTHONUNBUFFERED": "1",
            }
        )
    )


image = mortal_image(f"torch=={TORCH_VERSION}")
vllm_image = mortal_image(f"torch=={TORCH_VERSION}", f"vllm=={VLLM_VERSION}")
app = modal.App(APP, image=image, include_source=False)  # mortal is installed in the image


@app.function(
    name=WORKER_FUNCTION,
    volumes={DATA_MOUNT: data_volume},
    secrets=worker_secrets,
    timeout=WORKER_TIMEOUT_SECONDS,
    retries=0,
    serialized=True,
)
def worker(launch: dict) -> int:
    from mortal.controller.backends.modal_worker import run_worker

    data_volume.reload()  # a warm container reused for this call sees what others committed since
    return run_worker(launch, commit=data_volume.commit)


@app.function(
    name=VLLM_FUNCTION,
    image=vllm_image,
    volumes={DATA_MOUNT: data_volume},
    secrets=worker_secrets,
    timeout=WORKER_TIMEOUT_SECONDS,
    retries=0,
    serialized=True,
)
def rollout_vllm(launch: dict) -> int:
    """`worker` on the image with vLLM: the rollout's engine `auto` resolves to vllm there on a GPU."""
    from mortal.controller.backends.modal_worker import run_worker

    data_volume.reload()
    return run_worker(launch, commit=data_volume.commit)


@app.function(name=EXECUTE_FUNCTION, timeout=EXECUTE_TIMEOUT_SECONDS, retries=0, serialized=True)
def execute(payload: dict) -> dict:
    """Trusted code of a reward (`execute_in_function` with SandboxConfig(backend="modal")): one job run
    unconfined on this container's local backend; its ExecutionResult as a dict."""
    from mortal.workers.rewards.modal_sandbox import execute_trusted

    return execute_trusted(payload)


@app.function(
    volumes={STATE_MOUNT: state_volume},
    secrets=[modal.Secret.from_name(STATE_SECRET)],
    min_containers=1,
    max_containers=1,
    serialized=True,
)
@modal.concurrent(max_inputs=64)
@modal.wsgi_app()
def store():
    """One container only: SQLite has one writer, and a volume merges no concurrent edits of one file."""
    from mortal.state.http_server import ACCESS_LOG, TOKEN_ENV, make_app, previous_tokens_from

    backing = os.environ.get("MORTAL_STORE_BACKING_URL") or f"sqlite:///{STATE_MOUNT}/state.db"
    return make_app(
        backing, os.environ[TOKEN_ENV], f"{STATE_MOUNT}/{ACCESS_LOG}", previous_tokens_from(os.environ)
    )


@app.function(
    volumes={DATA_MOUNT: data_volume},
    secrets=secrets,
    schedule=modal.Period(minutes=SCHEDULE_MINUTES),
    timeout=CONTROLLER_RUN_SECONDS + 300,
    serialized=True,
)
def controller() -> None:
    """Run a controller for CONTROLLER_RUN_SECONDS, then give the lease up to the next scheduled call,
    which started CONTROLLER_OVERLAP_SECONDS earlier and waits for it as a standby (docs/modal.md,
    Failures: how fast a failure is noticed).

    In a thread of its own: run_controller sets SIGTERM/SIGINT handlers only on the main thread,
    and Modal's container runtime keeps those (a cancellation here stops the controller cleanly)."""
    from mortal.controller.manager import run_controller

    url = os.environ.get("MORTAL_STATE_URL") or modal.Function.from_name(APP, "store").get_web_url()
    stop = threading.Event()
    thread = threading.Thread(
        target=run_controller, kwargs={"state_url": url, "stop_event": stop}, name="mortal-controller"
    )
    thread.start()
    try:
        thread.join(CONTROLLER_RUN_SECONDS)
    finally:
        stop.set()
        thread.join()
