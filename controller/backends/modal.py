"""The Modal backend: every worker is one call of the deployed app's worker function, on the GPU the
spec names.

Who calls it: the controller, through the `Backend` contract (`select_backend("modal")`). The app
(mortal.client.modal_app) defines the functions; their body (modal_worker) runs
`python -m mortal.workers.main` and returns its exit code. Rollouts that generate with vLLM are calls
of `rollout_vllm`, whose image adds vLLM; every other worker is a call of `worker`. The handle is
"modal:<function call id>"; each launch is recorded in a modal.Dict, so a restarted controller adopts
the calls an earlier one launched instead of launching twins. Only the Modal calls the tests' fake
provides are used, and importing this module never imports modal.
What it must not do: touch the store, decide anything, or read an unreachable Modal as an exit.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mortal.controller.backends.base import (
    EXITED_TTL_SECONDS,
    Backend,
    BackendError,
    BackendUnavailable,
    BackendWorker,
    LaunchFailed,
    WorkerLaunch,
)
from mortal.controller.backends.gpus import wants_gpu
from mortal.state import paths
from mortal.state.containment import posix_inside

APP_NAME = "mortal"
APP_ENV = "MORTAL_MODAL_APP"  # the deployed app's name, when not "mortal"
WORKER_FUNCTION = "worker"
VLLM_FUNCTION = "rollout_vllm"  # the same body on the image with vLLM (rollouts that generate with it)
DATA_MOUNT = "/mortal"  # where the app's containers mount the data volume (their MORTAL_HOME)
HANDLE_PREFIX = "modal:"
CANCEL_MARGIN_SECONDS = 5.0  # after the grace: the worker function's own cleanup, then containers are ended
TERMINATE_WAIT_SECONDS = 60.0
# The GPU types Modal's `gpu=` accepts (modal.com/docs/guide/gpu), upper case as Modal normalizes them.
MODAL_GPUS = frozenset(
    {
        "T4",
        "L4",
        "A10",
        "A10G",
        "L40S",
        "A100",
        "A100-40GB",
        "A100-80GB",
        "RTX-PRO-6000",
        "H100",
        "H100!",
        "H200",
        "B200",
        "B200+",
        "ANY",
    }
)
GPU_ALIASES = {
    "A100-40G": "A100-40GB",
    "A100-80G": "A100-80GB",
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "H100-80GB": "H100",
    "H200-141GB": "H200",
    "A10-24GB": "A10",
}
# Modal errors that mean "this call is over" (rather than "Modal could not be asked").
_CALL_ENDED = (
    "OutputExpiredError",
    "FunctionTimeoutError",
    "RemoteError",
    "InternalFailure",
    "ExecutionError",
    "DeserializationError",
    "NotFoundError",
)
_GPU = re.compile(r"^(?P<name>[A-Z0-9!+-]+?)(?::(?P<count>\d+))?$")


class UnsupportedGPU(LaunchFailed):
    """The spec names a GPU type Modal does not have."""


def deployed_app_name() -> str:
    """The deployed app's name: $MORTAL_MODAL_APP, else 'mortal'."""
    return os.environ.get(APP_ENV) or APP_NAME


def data_volume_name(app: str) -> str:
    """The app's volume of runs, checkpoints, weights and logs (mounted at DATA_MOUNT)."""
    return f"{app}-data"


def worker_function(launch: WorkerLaunch) -> str:
    """The app function a launch is a call of: rollouts that will generate with vLLM need its image.

    `auto` means vLLM on a GPU (mortal.workers.rollout.engines.resolve_engine_name); on the CPU it is
    transformers, which the trainer's image has."""
    if launch.role == "rollout" and (
        launch.engine == "vllm" or (launch.engine == "auto" and wants_gpu(launch.gpu))
    ):
        return VLLM_FUNCTION
    return WORKER_FUNCTION


def modal_gpu(gpu: str, count: int = 1) -> str | None:
    """Modal's `gpu=` string for the spec's GPU name and count; None for CPU ('none')."""
    if not wants_gpu(gpu):
        return None
    match = _GPU.match(gpu.strip().upper().replace("_", "-").replace(" ", "-"))
    name = GPU_ALIASES.get(match["name"], match["name"]) if match else None
    if match is None or name not in MODAL_GPUS:
        known = ", ".join(sorted(MODAL_GPUS - {"ANY"}))
        raise UnsupportedGPU(f"gpu {gpu!r} is not a Modal GPU type; use one of {known} (or 'none' for CPU)")
    count = int(match["count"] or count)
    return name if count == 1 else f"{name}:{count}"


def load_modal() -> ModuleType:
    """The `modal` package, once we know it can reach Modal; BackendUnavailable says the fix otherwise."""
    try:
        import modal
    except ImportError as exc:
        raise BackendUnavailable(
            "the modal backend needs the `modal` package: pip install 'mortal[cloud]' (or pip install modal)"
        ) from exc
    if not has_modal_credentials():
        raise BackendUnavailable(
            "no Modal token here: run `modal token new` (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)"
        )
    return modal


def data_volume(modal: ModuleType | Any | None = None) -> Any:
    """The deployed app's data volume, for clients outside the containers (`mortalctl logs`, `cp`)."""
    return (modal or load_modal()).Volume.from_name(data_volume_name(deployed_app_name()))


def has_modal_credentials(environ: dict[str, str] | None = None) -> bool:
    """Where Modal's client finds credentials: inside a Modal container, the MODAL_TOKEN_* variables,
    or the token file `modal token new` writes (~/.modal.toml, or $MODAL_CONFIG_PATH)."""
    env = os.environ if environ is None else environ
    if env.get("MODAL_IS_REMOTE") == "1" or (env.get("MODAL_TOKEN_ID") and env.get("MODAL_TOKEN_SECRET")):
        return True
    path = Path(env.get("MODAL_CONFIG_PATH") or Path.home() / ".modal.toml")
    return path.is_file() and "token_id" in path.read_text(errors="replace")


class ModalBackend(Backend):
    """Workers as calls of the deployed app's worker function; their record is a modal.Dict."""

    name = "modal"

    def __init__(
        self,
        modal: ModuleType | Any | None = None,
        app_name: str | None = None,
        exited_ttl_seconds: float = EXITED_TTL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`modal` is the modal package (tests pass a fake); `app_name` defaults to $MORTAL_MODAL_APP or
        'mortal'."""
        self._modal = modal if modal is not None else load_modal()
        self.app_name = app_name or deployed_app_name()
        self.exited_ttl_seconds, self._clock = exited_ttl_seconds, clock
        self._registry = self._modal.Dict.from_name(f"{self.app_name}-workers", create_if_missing=True)
        self._functions: dict[tuple[str, str | None], Any] = {}
        self._ended: dict[str, int | None] = {}  # call id -> exit code of calls seen ended (not polled again)
        self._lock = threading.Lock()
        self._shipped: set[str] = set()  # code snapshots known to be on the volume (their folders there)

    # -- launch ------------------------------------------------------------------------------
    def launch(self, launch: WorkerLaunch) -> str:
        """Spawn the worker's call (or return the handle of the running call of this worker id)."""
        if not launch.state_url.startswith(("http://", "https://")):
            raise LaunchFailed(
                f"workers on Modal reach the state store over HTTP, not {launch.state_url.split(':')[0]}: "
                "run the controller with MORTAL_STATE_URL=https://<workspace>--mortal-store.modal.run "
                "(docs/modal.md)"
            )
        self.ship_code(launch)
        gpu = modal_gpu(launch.gpu, launch.gpu_count)
        function = worker_function(launch)
        known = self._modal_call(self._registry.get, launch.worker_id)
        if _is_entry(known) and self._status(known["call_id"])[0]:
            return HANDLE_PREFIX + known["call_id"]
        try:
            call = self._function(function, gpu).spawn(dataclasses.asdict(launch))
        except self._modal.exception.NotFoundError as exc:
            raise LaunchFailed(
                f"the Modal app {self.app_name!r} is not deployed ({exc}): modal deploy -m "
                "mortal.client.modal_app"
            ) from exc
        except self._modal.exception.Error as exc:
            raise LaunchFailed(f"could not spawn {launch.worker_id} on Modal: {exc}") from exc
        entry = {
            "call_id": call.object_id,
            "worker_id": launch.worker_id,
            "run": launch.run,
            "run_uid": launch.run_uid,
            "role": launch.role,
            "replica": launch.replica,
            "incarnation": launch.incarnation,
            "gpu": gpu,
            "function": function,
            "launched_at": self._clock(),
            "ended_at": None,
        }
        self._modal_call(self._registry.put, launch.worker_id, entry)
        return HANDLE_PREFIX + call.object_id

    def gpus_held(self, launch: WorkerLaunch) -> int:
        """Every call is a container with GPUs of its own, a colocated rollout's too (docs/modal.md)."""
        return launch.gpu_count if wants_gpu(launch.gpu) else 0

    def _function(self, name: str, gpu: str | None) -> Any:
        """The app's function `name` with `gpu` (looked up once; with_options per GPU type)."""
        with self._lock:
            if (name, gpu) not in self._functions:
                base = self._functions.get((name, None)) or self._modal.Function.from_name(
                    self.app_name, name
                )
                self._functions[(name, None)] = base
                self._functions[(name, gpu)] = base if gpu is None else base.with_options(gpu=gpu)
            return self._functions[(name, gpu)]

    # -- list --------------------------------------------------------------------------------
    def list(self, run: str | None = None) -> list[BackendWorker]:
        entries = dict(self._modal_call(lambda: list(self._registry.items())))
        now = self._clock()
        workers = []
        for worker_id, entry in entries.items():
            if not _is_entry(entry):
                continue  # not written by a ModalBackend (a Dict shared by mistake): never ours to judge
            if run is not None and entry["run"] != run:
                continue
            alive, code = self._status(entry["call_id"])
            if not alive:
                if entry.get("ended_at") is None:
                    self._modal_call(self._registry.put, worker_id, {**entry, "ended_at": now})
                elif now - entry["ended_at"] > self.exited_ttl_seconds:
                    self._forget(worker_id, entry["call_id"])
                    continue
            workers.append(
                BackendWorker(
                    worker_id=worker_id,
                    handle=HANDLE_PREFIX + entry["call_id"],
                    run=entry["run"],
                    role=entry["role"],
                    replica=int(entry["replica"]),
                    incarnation=int(entry["incarnation"]),
                    alive=alive,
                    exit_code=code,
                    run_uid=str(entry.get("run_uid") or ""),
                )
            )
        return sorted(workers, key=lambda w: (w.run, w.role, w.replica, w.incarnation))

    def _status(self, call_id: str, wait: float = 0) -> tuple[bool, int | None]:
        """(alive, exit code) of a call: its return value once it ended, None when it failed in Modal."""
        with self._lock:
            if call_id in self._ended:
                return False, self._ended[call_id]
        errors = self._modal.exception
        ended = tuple(getattr(errors, name) for name in _CALL_ENDED)
        try:
            value = self._modal.FunctionCall.from_id(call_id).get(timeout=wait)
        except TimeoutError:  # the builtin one: still running (Modal's own TimeoutError is not a subclass)
            return True, None
        except ended:
            code = None
        except errors.Error as exc:
            raise BackendError(f"Modal could not say how call {call_id} is: {exc}") from exc
        except Exception:  # the function itself raised (it returns codes, so: crashed): ended, code unknown
            code = None
        else:
            code = value if isinstance(value, int) and not isinstance(value, bool) else None
        with self._lock:
            self._ended[call_id] = code
        return False, code

    # -- stop --------------------------------------------------------------------------------
    def stop(self, handle: str, grace_seconds: float = 5.0) -> None:
        """Cancel the call (the worker function TERMs the worker, KILLs it after its grace); if it is still
        running after `grace_seconds`, end its container. Returns once the call has ended; forgets it."""
        if not handle.startswith(HANDLE_PREFIX):
            return
        call_id = handle.removeprefix(HANDLE_PREFIX)
        call = self._modal_call(self._modal.FunctionCall.from_id, call_id)
        if self._status(call_id)[0] and grace_seconds > 0:
            self._modal_call(call.cancel)
            self._wait_ended(call_id, grace_seconds + CANCEL_MARGIN_SECONDS)
        if self._status(call_id)[0]:
            self._modal_call(call.cancel, terminate_containers=True)
            self._wait_ended(call_id, TERMINATE_WAIT_SECONDS)
        for worker_id, entry in self._modal_call(lambda: list(self._registry.items())):
            if _is_entry(entry) and entry["call_id"] == call_id:
                self._forget(worker_id, call_id)

    def _forget(self, worker_id: str, call_id: str) -> None:
        self._modal_call(self._registry.pop, worker_id, None)
        with self._lock:
            self._ended.pop(call_id, None)

    def _wait_ended(self, call_id: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._status(call_id, wait=min(1.0, max(0.0, deadline - time.monotonic())))[0]:
            if time.monotonic() >= deadline:
                return False
        return True

    # -- files -------------------------------------------------------------------------------
    def ship_code(self, launch: WorkerLaunch) -> None:
        """Upload the run's code snapshot (mortal.controller.snapshot) to the data volume, where the worker's
        MORTAL_HOME is, unless it is there already (content-addressed: an upload is never replaced)."""
        digest = launch.env.get(paths.CODE_SNAPSHOT_ENV)
        remote = f"runs/{launch.run}/code/{digest}"  # each run's own: a digest alone is not where it lies
        if not digest or remote in self._shipped:
            return
        local = paths.code_dir(launch.run, digest, launch.mortal_home)
        volume = self._modal_call(self._modal.Volume.from_name, data_volume_name(self.app_name))
        try:
            volume.listdir(remote)
            present = True
        except (FileNotFoundError, self._modal.exception.NotFoundError):
            present = False
        except self._modal.exception.Error as exc:
            raise BackendError(f"Modal: could not list {remote} on the volume: {exc}") from exc
        if not present:
            if not local.is_dir():
                raise LaunchFailed(
                    f"the run's code snapshot {local} is not on the controller's machine: "
                    "apply the run again from the folder of its code"
                )
            try:
                with volume.batch_upload() as batch:
                    for root, _, files in os.walk(local):  # a linked model folder is not the volume's to hold
                        for name in files:
                            if not (Path(root) / name).is_symlink():
                                rel = (Path(root) / name).relative_to(local).as_posix()
                                batch.put_file(str(Path(root) / name), f"{remote}/{rel}")
            except self._modal.exception.Error as exc:
                raise BackendError(f"Modal: could not upload {remote} to the volume: {exc}") from exc
        self._shipped.add(remote)

    def set_aside_run_folder(self, run: str, uid: str) -> None:
        """Not done on the volume yet (its API copies and removes, it has no rename): a deleted Modal run's
        folder stays at runs/<run>, and a run applied again under the name writes into it. Its store rows,
        which say what is current, are the new run's alone."""

    def remove_run_folder(self, run: str) -> None:
        """Remove the run's folder from the data volume (`delete --purge`), through the API, so it works
        from a controller anywhere; a folder already gone is no error."""
        folder = posix_inside("runs", f"runs/{run}")  # PathOutside for a name that leaves runs/
        # The run's shipped snapshots went with its folder.
        self._shipped = {remote for remote in self._shipped if not remote.startswith(f"{folder}/")}
        volume = self._modal_call(self._modal.Volume.from_name, data_volume_name(self.app_name))
        try:
            volume.remove_file(folder, recursive=True)
        except (FileNotFoundError, self._modal.exception.NotFoundError):  # modal 1.6 raises the former
            return
        except self._modal.exception.Error as exc:
            raise BackendError(
                f"Modal: could not remove runs/{run} from the volume {data_volume_name(self.app_name)}: {exc}"
            ) from exc

    def _modal_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A call into Modal; its failures are BackendErrors (the reconcile pass is retried)."""
        try:
            return fn(*args, **kwargs)
        except self._modal.exception.Error as exc:
            raise BackendError(f"Modal: {exc}") from exc


def _is_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and all(
        k in entry for k in ("call_id", "run", "role", "replica", "incarnation")
    )
