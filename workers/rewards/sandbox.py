"""Run model-written Python with limits and no network: the `Executor` behind every code reward.

    from mortal.workers.rewards.sandbox import SandboxConfig, make_executor
    executor = make_executor(SandboxConfig(timeout=10, memory_mb=512))
    result = executor.run("print(sum(range(10)))")   # ExecutionResult(success=True, stdout='45\\n', ...)
    results = executor.run_batch(["print(1)", "while True: pass"])   # in parallel, `workers` at a time

Who calls it: RewardEnvironment.execute_in_sandbox / execute_in_function (mortal.workers.rewards)
and the code-execution environment. `make_executor` picks a backend by `SandboxConfig.backend`;
"local" (here) writes each execution's files to a fresh temp dir (confined code gets a private
in-memory copy of it as its cwd, so what it writes never reaches the disk) and runs `python3 -I`
of this very interpreter (so the packages of this environment are importable, read-only), RLIMITs
set between fork and exec (address space = memory_mb, CPU seconds, processes, file size, open
files, no core files), a wall-clock timeout that kills the whole process group (and pid
namespace), capped stdout/stderr, an environment without the worker's variables (no API keys leak
in), and a confinement mode from mortal.workers.rewards.confinement (bubblewrap > unshare > refuse; see
there for what each confines). A
Modal backend (mortal.workers.rewards.modal_sandbox, imported when first asked for) is chosen with
`SandboxConfig(backend="modal")`; `image` is for it and is ignored by the local backend.
`trusted=True` (the "function" variants) runs the same way with the timeout and output cap only:
no confinement, no rlimits, the worker's environment; it is for code you wrote, not the model.
What it must not do: let the code reach the network, outlive its timeout, or see the worker's secrets.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from mortal.workers.rewards import confinement
from mortal.workers.rewards.confinement import Mode, SandboxUnavailable

if TYPE_CHECKING:
    from mortal.specs.rewards import SandboxSpec

__all__ = [
    "ExecutionResult",
    "Executor",
    "FunctionConfig",
    "Job",
    "LocalExecutor",
    "SandboxConfig",
    "SandboxUnavailable",
    "make_executor",
    "register_executor",
]

MAIN = "main.py"
# Runs main.py as __main__ with the temp dir importable (isolated mode leaves it off sys.path).
BOOT = (
    "import runpy, sys; sys.path.insert(0, ''); sys.argv = ['main.py']; "
    "runpy.run_path('main.py', run_name='__main__')"
)

QUIET_THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one execution of untrusted code (the seed's `SandboxConfig(image=..., timeout=60)`).

    `image` is a Modal image for a Modal backend; the local backend keeps it and ignores it (it runs
    this machine's interpreter). `confinement`: auto (bubblewrap, else unshare) | bubblewrap |
    unshare | none; `allow_unconfined` lets auto fall back to none (with a warning) instead of
    failing the run. `workers`: parallel executions in run_batch (default: min(4, CPUs)).
    """

    image: Any = None
    timeout: float = 10.0
    memory_mb: int = 512
    cpu_seconds: float | None = None
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024
    workers: int | None = None
    confinement: str = "auto"
    allow_unconfined: bool = False
    backend: str = "local"

    @classmethod
    def from_spec(cls, spec: SandboxSpec, **overrides: Any) -> SandboxConfig:
        """spec.rewards[i].sandbox (timeoutSeconds, memoryMB, backend) plus any other field by name."""
        return cls(timeout=spec.timeout_seconds, memory_mb=spec.memory_mb, backend=spec.backend, **overrides)

    def limits(self) -> dict[str, Any]:
        """What shapes a result (for cache keys): every field but the image, workers and backend."""
        return {k: v for k, v in self.__dict__.items() if k not in ("image", "workers", "backend")}


@dataclass(frozen=True)
class FunctionConfig:
    """Limits for trusted code (execute_in_function): a timeout and parallelism, nothing else."""

    timeout: float = 60.0
    workers: int | None = None
    max_output_bytes: int = 1024 * 1024

    def as_sandbox(self) -> SandboxConfig:
        return SandboxConfig(
            timeout=self.timeout,
            workers=self.workers,
            max_output_bytes=self.max_output_bytes,
            confinement="none",
            allow_unconfined=True,
        )


@dataclass(frozen=True)
class Job:
    """One execution: the code (run as main.py), its stdin and extra files (relative path -> text)."""

    code: str
    stdin: str = ""
    files: dict[str, str] | None = None


@dataclass
class ExecutionResult:
    """How one execution ended. `success`: exit code 0 within the time limit."""

    success: bool
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    duration_seconds: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    confinement: str = ""
    signal: str | None = None  # e.g. SIGKILL (timeout, cgroup), SIGXCPU (CPU limit)
    error: str | None = None  # why it could not run at all (bad file name, ...)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ran_out_of_time(self) -> bool:
        """Ended by the wall clock (timed_out) or by the CPU-seconds limit (SIGXCPU). Why both: the CPU
        limit defaults to the timeout, so code that spins ends by whichever comes first, and which one
        does depends on how busy the machine is; to whoever reads the result both are a timeout."""
        return self.timed_out or self.signal == "SIGXCPU"


class Executor(ABC):
    """Runs code somewhere confined. Subclass it for another backend (Modal sandboxes)."""

    config: SandboxConfig

    @abstractmethod
    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> ExecutionResult: ...

    def check(self) -> None:  # noqa: B027 (optional for a backend)
        """Raise SandboxUnavailable now (not at the first completion) if this executor cannot run code."""

    def run_batch(self, codes: Sequence[str | Job]) -> list[ExecutionResult]:
        """Every item in parallel, at most `config.workers` at a time, results in input order."""
        jobs = [c if isinstance(c, Job) else Job(c) for c in codes]
        if not jobs:
            return []
        workers = max(1, min(len(jobs), self.config.workers or min(4, os.cpu_count() or 1)))
        if workers == 1:
            return [self.run(j.code, j.stdin, j.files) for j in jobs]
        with ThreadPoolExecutor(workers, thread_name_prefix="mortal-sandbox") as pool:
            return list(pool.map(lambda j: self.run(j.code, j.stdin, j.files), jobs))

    def close(self) -> None:  # noqa: B027 (optional for a backend)
        """Release what the backend holds (nothing locally)."""


_FACTORIES: dict[str, Callable[[SandboxConfig, bool], Executor]] = {}


def register_executor(backend: str, factory: Callable[[SandboxConfig, bool], Executor]) -> None:
    """Make `SandboxConfig(backend=name)` build executors with `factory(config, trusted)`."""
    _FACTORIES[backend] = factory


# Backends shipped with mortal but imported only when a config asks for them (modal's client is optional).
_BACKEND_MODULES = {"modal": "mortal.workers.rewards.modal_sandbox"}


def make_executor(config: SandboxConfig | None = None, trusted: bool = False) -> Executor:
    config = config or SandboxConfig()
    if config.backend not in _FACTORIES and config.backend in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[config.backend])
    if config.backend not in _FACTORIES:
        raise ValueError(
            f"no sandbox backend {config.backend!r}; registered: {', '.join(sorted(_FACTORIES))}"
        )
    return _FACTORIES[config.backend](config, trusted)


# -- the local backend -----------------------------------------------------------------------------
class _CappedReader(threading.Thread):
    """Drains a pipe to its end, keeping the first `cap` bytes (so a chatty program never blocks)."""

    def __init__(self, pipe: IO[bytes], cap: int) -> None:
        super().__init__(daemon=True, name="mortal-sandbox-pipe")
        self.pipe, self.cap = pipe, cap
        self.kept = bytearray()
        self.truncated = False

    def run(self) -> None:
        try:
            while chunk := self.pipe.read1(65536):
                room = self.cap - len(self.kept)
                if room > 0:
                    self.kept += chunk[:room]
                if len(chunk) > room:
                    self.truncated = True
        except (OSError, ValueError):  # closed under us after a kill
            pass

    def text(self) -> str:
        return self.kept.decode("utf-8", errors="replace")


def _write_files(workdir: Path, code: str, files: dict[str, str] | None) -> None:
    for name, text in (files or {}).items():
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or str(rel) == MAIN:
            raise ValueError(f"file name {name!r} must be a relative path inside the temp dir, not {MAIN}")
        target = workdir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    (workdir / MAIN).write_text(code, encoding="utf-8")


def _signal_name(code: int | None, mode: Mode) -> str | None:
    """The signal that ended the code: a negative exit code, or bubblewrap's 128 + signal."""
    if code is not None and mode.name == "bubblewrap" and 128 < code < 128 + 64:
        code = 128 - code
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class LocalExecutor(Executor):
    """Executions on this machine, each in a fresh temp dir (see the module docstring for the limits)."""

    def __init__(self, config: SandboxConfig | None = None, trusted: bool = False) -> None:
        self.config = config or SandboxConfig()
        self.trusted = trusted
        self._mode: Mode | None = Mode("none", confinement.CONFINES["none"]) if trusted else None
        self._lock = threading.Lock()

    @property
    def mode(self) -> Mode:
        """The confinement, chosen (and probed) at first use; SandboxUnavailable if none is allowed."""
        with self._lock:
            if self._mode is None:
                self._mode = confinement.select_mode(self.config.confinement, self.config.allow_unconfined)
                if not confinement.processes_capped():
                    confinement.log.warning(
                        "sandbox: running as root without a writable pids cgroup, so the process count is "
                        "capped for all executions together (RLIMIT_NPROC of their host user, uid %d)",
                        confinement.SANDBOX_UID,
                    )
            return self._mode

    def check(self) -> None:
        _ = self.mode

    def _env(self, workdir: str, mode: Mode) -> dict[str, str]:
        if self.trusted:
            return {**os.environ, **QUIET_THREADS}
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp" if mode.private_tmp else workdir,
            "PYTHONIOENCODING": "utf-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **QUIET_THREADS,
        }

    def _preexec(self, mode: Mode, cap: confinement.ProcessCap | None) -> Callable[[], None] | None:
        """Runs in the child between fork and exec: only raw syscalls, no locks, no imports."""
        if self.trusted:
            return None
        c = self.config
        cpu = math.ceil(c.cpu_seconds if c.cpu_seconds is not None else c.timeout)
        memory = c.memory_mb * 1024 * 1024
        limits = [
            (resource.RLIMIT_AS, memory, memory),
            (resource.RLIMIT_CPU, cpu, cpu + 1),
            (resource.RLIMIT_FSIZE, c.max_file_mb * 1024 * 1024, c.max_file_mb * 1024 * 1024),
            (resource.RLIMIT_NOFILE, c.max_open_files, c.max_open_files),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        # Counted per host user: unconfined, that is the worker's own; confined as root, every execution's
        # code is SANDBOX_UID, so where a pids cgroup caps each execution that cap is the one that applies.
        if mode.name != "none" and not (cap is not None and confinement.as_root()):
            limits.append((resource.RLIMIT_NPROC, c.max_processes, c.max_processes))

        def apply() -> None:
            if cap is not None:
                cap.join_self()
            for kind, soft, hard in limits:
                resource.setrlimit(kind, (soft, hard))

        return apply

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> ExecutionResult:
        mode = self.mode
        workdir = Path(tempfile.mkdtemp(prefix="mortal-sbx-"))
        started = time.monotonic()
        try:
            try:
                _write_files(workdir, code, files)
                mode.hand_over(str(workdir))
            except (ValueError, OSError) as exc:
                return ExecutionResult(False, None, "", "", False, 0.0, confinement=mode.name, error=str(exc))
            return self._execute(mode, workdir, stdin, started)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _execute(self, mode: Mode, workdir: Path, stdin: str, started: float) -> ExecutionResult:
        argv = mode.wrap([sys.executable, "-I", "-c", BOOT], str(workdir))
        cap = None if self.trusted else confinement.process_cap(self.config.max_processes)
        # stdin in memory, not in a file on disk: the code may write to its fd 0 (up to max_file_mb).
        with os.fdopen(os.memfd_create("mortal-sandbox-stdin"), "w+b") as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=workdir,
                    env=self._env(str(workdir), mode),
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=self._preexec(mode, cap),
                )
            except (OSError, subprocess.SubprocessError) as exc:  # SubprocessError: the preexec step failed
                if cap is not None:
                    cap.remove()
                confinement.log.warning("sandbox: could not start an execution: %s", exc)
                return ExecutionResult(
                    False, None, "", "", False, 0.0, confinement=mode.name, error=f"could not start: {exc}"
                )
            readers = [
                _CappedReader(proc.stdout, self.config.max_output_bytes),
                _CappedReader(proc.stderr, self.config.max_output_bytes),
            ]
            for reader in readers:
                reader.start()
            timed_out = False
            try:
                proc.wait(timeout=self.config.timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                self._kill(proc, cap)
            duration = time.monotonic() - started
            for reader, pipe in zip(readers, (proc.stdout, proc.stderr), strict=True):
                reader.join(timeout=2.0)
                # else a process that escaped the kill (trusted mode) holds the pipe:
                if not reader.is_alive():
                    # closing would wait on the reader's lock; the daemon thread ends with it
                    pipe.close()
        out, err = readers
        code = proc.returncode
        return ExecutionResult(
            success=code == 0 and not timed_out,
            exit_code=code,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=timed_out,
            duration_seconds=duration,
            stdout_truncated=out.truncated,
            stderr_truncated=err.truncated,
            confinement=mode.name,
            signal=_signal_name(code, mode),
        )

    @staticmethod
    def _kill(proc: subprocess.Popen, cap: confinement.ProcessCap | None) -> None:
        """Everything the execution started goes: its process group, its cgroup, its pid namespace."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if cap is not None:
            cap.remove()
        proc.wait()


register_executor("local", lambda config, trusted: LocalExecutor(config, trusted))
