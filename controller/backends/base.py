"""The backend contract: how the controller launches, lists and stops worker processes.

Who calls it: the controller's reconcile (launch a slot's new incarnation, list what is actually
running, stop what should not run). Backends (local processes, Modal function calls, Ray actors)
implement it; nothing else in mortal knows how a worker is started.
What it must not do: touch the state store or decide anything. A backend reports what exists; the
controller compares that with the workers table and acts.

    backend = select_backend("local")                 # the factory: mortal.controller.backends
    handle = backend.launch(WorkerLaunch(run="r", role="actor", replica=0, incarnation=7, ...))
    store.set_worker_handle(row.id, handle)
    [w for w in backend.list("r") if not w.alive]     # exited: exit_code when known
    backend.stop(handle)                               # SIGTERM the group, SIGKILL after grace
    backend.remove_run_files("r", storage_uri)         # delete --purge: the run's folder and its storage
"""

from __future__ import annotations

import abc
import contextlib
import getpass
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mortal.specs.memory import MICRO_BATCH_ENV, ROLLOUT_SHARE_ENV
from mortal.state import paths, wire
from mortal.state.containment import PathOutside, inside, url_inside
from mortal.state.store import WORKER_LEADER_ENV

WORKER_MODULE = "mortal.workers.main"  # what every backend runs: `python -m WORKER_MODULE`
EXITED_TTL_SECONDS = 600.0  # how long list() keeps reporting a worker that ended and was not stop()ped

# Identity variables of a worker: never inherited from the launching process's own environment.
DOORBELLS_ENV = "MORTAL_DOORBELLS"  # "1": the run's workers share this machine (mortal.workers.doorbell)
GPU_PEERS_ENV = "MORTAL_GPU_PEERS"  # devices a worker sees but does not hold (its actor's, for sync ipc)
# The Ray cluster and run namespace a worker of the ray backend connects to as a driver, and the node it
# runs on (sync ray: mortal.workers.sync.ray reads them); set by the worker's Ray actor
# (ray_worker.WorkerHost).
RAY_ADDRESS_ENV, RAY_NAMESPACE_ENV, RAY_NODE_ENV = (
    "MORTAL_RAY_ADDRESS",
    "MORTAL_RAY_NAMESPACE",
    "MORTAL_RAY_NODE_ID",
)
WORKER_IDENTITY_ENV = (
    "MORTAL_RUN",
    "MORTAL_ROLE",
    "MORTAL_REPLICA",
    "MORTAL_INCARNATION",
    "MORTAL_WORKER_ID",
    WORKER_LEADER_ENV,
    "MORTAL_RUN_UID",
    "MORTAL_HEARTBEAT_SECONDS",
    "MORTAL_HOME",
    "MORTAL_STATE_URL",
    "MORTAL_GPU_SHARED",
    GPU_PEERS_ENV,
    "CUDA_VISIBLE_DEVICES",
    RAY_ADDRESS_ENV,
    RAY_NAMESPACE_ENV,
    RAY_NODE_ENV,
    # per launch, from the run (its code snapshot, the controller's memory
    # choices): a value in the launcher's own environment must not reach a worker
    # launched without one
    paths.CODE_SNAPSHOT_ENV,
    MICRO_BATCH_ENV,
    ROLLOUT_SHARE_ENV,
)
STATE_TOKEN_ENV = wire.TOKEN_ENV  # the worker's own scoped token (mortal.state.auth), never the launcher's
# What a worker keeps of its launcher's environment: what it needs to run (the system's, Python's, the GPU
# stack's and its libraries' settings, mortal's own), never a credential (a name with a SECRET_WORDS part,
# or one of DENIED); the spec's secrets are added by name (docs/security.md, The worker environment).
INHERITED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TMPDIR",
        "TEMP",
        "TMP",
        "TZ",
        "TERM",
        "COLUMNS",
        "LANG",
        "LANGUAGE",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONHASHSEED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONWARNINGS",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV",
        "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        "XDG_DATA_HOME",
        "XDG_RUNTIME_DIR",
        "TOKENIZERS_PARALLELISM",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "all_proxy",
        "CC",
        "CXX",
        "CPATH",
        "LIBRARY_PATH",  # Triton compiles its kernels with the system's compiler
    }
)
INHERITED_PREFIXES = (
    "MORTAL_",
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "VLLM_",
    "HF_",
    "TRANSFORMERS_",
    "TRL_",
    "WANDB_",
    "MODAL_",
    "RAY_",
    "COVERAGE_",
    "COV_CORE_",
)
SECRET_WORDS = frozenset(
    {"TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "CREDENTIALS"}
)
DENIED = frozenset({"MORTAL_STORE_BACKING_URL"})  # the store server's database URL (it may hold a password)


def inheritable(name: str) -> bool:
    """Whether a worker keeps the launcher's variable `name` (mortal's own and the spec's secrets aside)."""
    if name in DENIED or SECRET_WORDS & set(name.upper().split("_")):
        return False
    return name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES)


class BackendError(Exception):
    """Base of every error a backend raises on purpose."""


class UnknownBackend(BackendError):
    """The name is not a backend at all."""


class BackendUnavailable(BackendError):
    """The backend exists but cannot run from here: a missing package or credentials (the message says
    the fix)."""


class InsufficientGPUs(BackendError):
    """A launch asked for more GPUs than the backend can give it now.

    `requested`, `free` and `total` say why; `permanent` is True when the machine does not have
    that many at all (the run cannot start here: a condition, not a retry), False when they exist
    but are held by other workers (retry after backoff).
    """

    def __init__(self, requested: int, free: int, total: int, gpu: str) -> None:
        self.requested, self.free, self.total, self.gpu = requested, free, total, gpu
        self.permanent = requested > total
        if self.permanent:
            msg = f"asked for {requested} GPU(s) ({gpu}) but this machine has {total}"
        else:
            msg = f"asked for {requested} GPU(s) ({gpu}); {free} of {total} are free (others are in use)"
        super().__init__(msg)


class WaitingForActorGPU(InsufficientGPUs):
    """A colocated rollout cannot start before its run's actor holds a GPU to share (retried, no failure)."""

    def __init__(self, run: str, gpu: str) -> None:
        BackendError.__init__(
            self, f"rollouts of {run!r} share the actor's GPU ({gpu}); waiting for the actor to hold one"
        )
        self.requested, self.free, self.total, self.gpu, self.permanent = 1, 0, 0, gpu, False


class LaunchFailed(BackendError):
    """The backend could not start the process (bad interpreter, no space for the log, ...)."""


class Unschedulable(LaunchFailed):
    """No node of the cluster can ever hold the worker (it asks for more CPUs, GPUs, memory or custom
    resources than any node has): the run cannot start there, a condition for the user, not a retry."""


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything a backend needs to start one incarnation of one worker slot.

    `worker_id` is `WorkerRef.process_id` (`run/role-replica#incarnation@uid`): the marker the backend
    finds the process by, which the uid keeps apart from an earlier run's of the same name. `env` carries
    extra variables (the spec's secrets) copied into the worker's environment; `state_token` is the
    worker's own token for an HTTP store (MORTAL_STATE_TOKEN), minted by the controller for this
    incarnation. `heartbeat_seconds`, when set, becomes MORTAL_HEARTBEAT_SECONDS (the worker otherwise
    derives its period from lease_seconds in its row).
    """

    run: str
    role: str
    replica: int
    incarnation: int
    worker_id: str
    state_url: str
    mortal_home: str
    gpu: str = "none"
    gpu_count: int = 1
    env: dict[str, str] = field(default_factory=dict, repr=False)  # values of secrets: never in a repr
    heartbeat_seconds: float | None = None
    run_uid: str = ""  # MORTAL_RUN_UID: fences off a leftover worker of an earlier run of the same name
    colocate: bool = False  # share the GPUs of the run's actor (spec rollout.colocate), not free ones
    sees_actor_gpus: bool = False  # also see the actor's GPUs (sync ipc and nccl to rollouts' own GPUs)
    engine: str = "auto"  # spec.generation.engine: a rollout that uses vLLM may run on an image with it
    # What a backend that schedules onto a cluster's nodes (ray) reserves besides GPUs; others ignore them.
    cpus: float | None = None
    memory_bytes: int | None = None
    resources: dict[str, float] = field(default_factory=dict)  # custom scheduler resources (spec.ray.<role>)
    # The worker uses its node's own MORTAL_HOME, not mortal_home (spec.ray.sharedFilesystem false).
    node_home: bool = False
    log_uri: str | None = None  # storage the worker's log is uploaded to (spec.checkpoint.uri, node_home)
    state_token: str = field(default="", repr=False)  # MORTAL_STATE_TOKEN: this incarnation's scoped token

    def environ(
        self, inherited: Mapping[str, str], cuda_visible_devices: str | None, mortal_home: str | None = None
    ) -> dict[str, str]:
        """The worker process's environment (the protocol of mortal.workers.runtime).

        What the worker needs of `inherited` (the launcher's environment: `inheritable`, without any worker
        identity or credential), then the spec's secrets, then the protocol's variables and its own token,
        then torch.compile's cache folders under MORTAL_HOME where neither set them (compile_cache_environ).
        `cuda_visible_devices` None leaves the GPUs as the machine gives them (Modal attaches exactly the
        requested ones); `mortal_home` overrides the launch's (a Modal container sees the shared volume at
        its own mount point).
        """
        env = {k: v for k, v in inherited.items() if k not in WORKER_IDENTITY_ENV and inheritable(k)}
        env.update(self.env)
        env.update(
            MORTAL_RUN=self.run,
            MORTAL_ROLE=self.role,
            MORTAL_REPLICA=str(self.replica),
            MORTAL_INCARNATION=str(self.incarnation),
            MORTAL_WORKER_ID=self.worker_id,
            MORTAL_RUN_UID=self.run_uid,
            **{WORKER_LEADER_ENV: "1"},
            MORTAL_HOME=str(mortal_home or self.mortal_home),
            MORTAL_STATE_URL=self.state_url,
            PYTHONUNBUFFERED="1",
        )
        if self.state_token:
            env[STATE_TOKEN_ENV] = self.state_token
        if cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        if self.heartbeat_seconds is not None:
            env["MORTAL_HEARTBEAT_SECONDS"] = str(self.heartbeat_seconds)
        if self.colocate:
            env["MORTAL_GPU_SHARED"] = "1"
        if env.get("TORCHINDUCTOR_CACHE_DIR") == torch_default_cache_dir():
            del env["TORCHINDUCTOR_CACHE_DIR"]  # torch's default, written back by a launcher that imported it
        for name, value in compile_cache_environ(mortal_home or self.mortal_home).items():
            env.setdefault(name, value)  # a user's own setting (inherited, or the spec's env) wins
        return env


def compile_cache_environ(home: str | Path) -> dict[str, str]:
    """torch.compile's on-disk caches in <home>/compile-cache/, so a relaunched worker, and a later run of
    the same model and shapes, loads what an earlier process compiled
    (workers/rollout/engines/compile_cache.py).

    Shared across runs because nothing in an entry belongs to a run: torch's and Triton's keys (graph,
    shapes, dtypes, device, versions) keep a different model or GPU from a wrong artifact, and their
    writes are atomic renames. Set in the environment the backend gives the process, so torch reads it
    before it is imported, on every backend alike. The folder is a cache, safe to delete at any time.
    """
    folder = paths.compile_cache_dir(home)
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
        "TRITON_CACHE_DIR": str(folder / "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }


def torch_default_cache_dir() -> str:
    """torch's own default for TORCHINDUCTOR_CACHE_DIR (torch/_inductor/runtime/cache_dir_utils.py, outside
    fbcode), computed without importing torch. torch writes the folder it uses back into os.environ, so
    a process that imported torch and compiled (a test, a notebook running the controller) carries this
    value without anyone having chosen it: it is not taken for the user's choice."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


@dataclass(frozen=True)
class BackendWorker:
    """One worker process as the backend sees it.

    `alive` False means it exited; `exit_code` is its status when the backend knows it (a child it
    launched; negative -N when signal N killed it, as in subprocess), None otherwise: then the worker
    row's own `report_exit` is the truth, and no report at all means the worker was lost (or was
    stopped on request: a worker stopped by SIGTERM exits 0 without a report). A handle missing from
    `list()` altogether is gone too.
    """

    worker_id: str
    handle: str
    run: str
    role: str
    replica: int
    incarnation: int
    alive: bool
    exit_code: int | None = None
    run_uid: str = ""  # the uid of the run it was launched for ("" when the backend cannot tell)


class Backend(abc.ABC):
    """Launch, list and stop workers. Every method is idempotent and safe to call after a restart."""

    name: str

    @abc.abstractmethod
    def launch(self, launch: WorkerLaunch) -> str:
        """Start the worker; return its handle (stable, never reused for another process)."""

    @abc.abstractmethod
    def list(self, run: str | None = None) -> list[BackendWorker]:
        """Workers of `run` (all runs if None): live ones, plus exited ones this backend still knows of.

        Also finds workers launched by an earlier controller process (re-adoption).
        """

    @abc.abstractmethod
    def stop(self, handle: str, grace_seconds: float = 5.0) -> None:
        """Stop the worker and everything it started; returns once they are gone. Unknown or already
        stopped handles are a no-op."""

    def dump_stacks(self, handle: str) -> bool:
        """Ask the worker's process to write its Python stacks to its log (mortal.workers.deadline): True once
        it was signalled (local: SIGUSR1; Ray: through its actor). False where this backend cannot signal it
        (the default: a Modal container), or did not reach it: the store's request for the stacks, which the
        worker's heartbeat answers, is then the only one (mortal.state.store.Store.request_stacks)."""
        return False

    def gpus_held(self, launch: WorkerLaunch) -> int:
        """GPUs the worker of `launch` will hold, recorded in its row for its GPU time (limits.maxGPUHours):
        `gpu_count` of its GPU type; none on the CPU; none for a colocated rollout, which shares its actor's
        (the local backend). A backend that gives every worker devices of its own says so (Modal)."""
        if launch.gpu.strip().lower() in ("none", "cpu", "") or launch.colocate:
            return 0
        return launch.gpu_count

    def remove_run_files(self, run: str, storage_uri: str | None = None) -> None:
        """Remove everything of the run's on disk (`delete --purge`, once every worker is gone): its folder
        where this backend's workers write it (`remove_run_folder`) and, with `storage_uri`
        (spec.checkpoint.uri), its prefix there (checkpoints, and the logs Ray workers upload)."""
        self.remove_run_folder(run)
        if storage_uri is not None:
            remove_from_storage(run, storage_uri)

    def set_aside_run_folder(self, run: str, uid: str) -> None:
        """Move a deleted run's folder (delete without --purge) to `paths.kept_run_dir`, once every worker is
        gone: a run applied again under the name then writes a folder of its own (its incarnations count
        from 1 again, so its logs, checkpoints and weights would take the old run's file names). Here: this
        machine's $MORTAL_HOME; a folder already moved or never made is no error."""
        folder, kept = set_aside_paths(run, uid)
        if not folder.exists() or kept.exists():
            return
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            os.rename(folder, kept)
        except OSError as exc:
            raise BackendError(f"cannot keep the files of deleted run {run!r} in {kept}: {exc}") from exc

    def remove_run_folder(self, run: str) -> None:
        """The run's folder (checkpoints, weights, logs, compile caches): here, this machine's
        $MORTAL_HOME/runs/<run>, once checked to be the run's own (`own_run_folder`)."""
        shutil.rmtree(own_run_folder(run), ignore_errors=True)


def set_aside_paths(run: str, uid: str) -> tuple[Path, Path]:
    """(the run's own folder, where a delete without --purge keeps it), resolved; PathOutside when either is
    not mortal's to move: the folder is not the run's own (`own_run_folder`), or MORTAL_HOME/deleted is a
    link elsewhere. The CLI asks too, to say what the delete will do with the files."""
    return own_run_folder(run), inside(paths.mortal_home(), paths.kept_run_dir(run, uid))


def own_run_folder(run: str) -> Path:
    """$MORTAL_HOME/runs/<run> resolved, when it is the run's own folder there; PathOutside for a name that
    would leave runs/ or a folder that is a link (out of MORTAL_HOME, or to another run's folder): a move
    or a removal through it would take files the run does not own."""
    folder = inside(paths.runs_dir(), paths.run_dir(run))
    own = Path(os.path.realpath(paths.runs_dir())) / run
    if folder != own:
        raise PathOutside(
            paths.run_dir(run), paths.runs_dir(), f" as a folder of its own (a link to {folder})"
        )
    return folder


def remove_from_storage(run: str, uri: str) -> None:
    """`<uri>/<run>/` removed with fsspec (as the workers' CheckpointStorage lays it out); a prefix already
    gone is no error. A storage this controller cannot use (its fsspec package missing here, no
    permission) is a BackendError: the purge is retried and the run's row kept, so its files are not
    lost track of.
    A run name that would leave `<uri>/` (a row stored before the store checked names) is PathOutside."""
    import fsspec

    url_inside(uri, f"{uri.rstrip('/')}/{run}")  # PathOutside for a name that leaves the run's prefix
    try:
        fs, root = fsspec.core.url_to_fs(uri.rstrip("/"))
        prefix = posixpath.join(root, run)
        fs.invalidate_cache(prefix)
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
    except FileNotFoundError:
        return
    except (ImportError, OSError, ValueError) as exc:
        raise BackendError(
            f"cannot remove run {run!r}'s checkpoints under spec.checkpoint.uri {uri!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to a worker's process group; one already gone (or not ours) is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
