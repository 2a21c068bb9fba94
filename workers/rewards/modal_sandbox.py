"""The `modal` sandbox backend: each execution of model-written code in a `modal.Sandbox` of its own.

    SandboxConfig(backend="modal", image=modal.Image.debian_slim().pip_install("numpy"), timeout=10)
    rewards: [{env: code-execution, sandbox: {backend: modal}}]                         # from a spec

The seeds' `SandboxConfig(backend="modal")`: where a reward's code should not run on the worker's
own machine (a GPU container on Modal has no bubblewrap, or the code needs an image of its own).
Who calls it: mortal.workers.rewards.sandbox.make_executor, which imports this module when a config
asks for backend "modal". Through Modal's public client API only:
1. `Sandbox.create("python3", "-I", "-c", RUNNER, image=..., block_network=True, timeout=...)` in
   the deployed app (MORTAL_MODAL_APP, default "mortal"; created if missing), image `config.image`
   or a slim Debian with this worker's Python version;
2. the job (code, stdin, files, limits) goes in as JSON on the sandbox's stdin; RUNNER, stdlib only
   so any image with python3 works, writes the files into a fresh folder, runs main.py as the local
   backend does (rlimits, a wall-clock timeout that kills the process group, capped output) and
   prints the outcome as one JSON line;
3. the client waits, reads that line into an ExecutionResult (confinement "modal-sandbox"), and
   terminates the sandbox whatever happened.
Trusted code (`execute_in_function`) goes instead to the deployed function `execute`
(mortal.controller.modal_app), one call per job, a batch as one `Function.map`.
What it must not do: give the code network access, let it outlive `timeout` plus the sandbox's
start-up grace, or return without terminating the sandbox.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from mortal.workers.rewards.sandbox import (
    ExecutionResult,
    Executor,
    Job,
    SandboxConfig,
    SandboxUnavailable,
    register_executor,
)

APP_ENV, DEFAULT_APP = "MORTAL_MODAL_APP", "mortal"  # the deployed app (as mortal.controller.backends.modal)
EXECUTE_FUNCTION = "execute"  # the deployed function that runs trusted code (mortal.controller.modal_app)
START_GRACE_SECONDS = 60  # a sandbox's own timeout also covers its container's start
RUNNER_MEMORY_MB = 256  # the runner's own share of the container, above the code's address-space limit
CONFINEMENT = "modal-sandbox"

# Runs inside the sandbox (any image with python3): job JSON on stdin -> one JSON line on stdout.
RUNNER = r"""
import json, os, resource, signal, subprocess, sys, tempfile, time
job = json.loads(sys.stdin.read())
work = tempfile.mkdtemp(prefix="mortal-job-")
files = dict(job.get("files") or {}, **{"main.py": job["code"]})
out = {"exit_code": None, "stdout": "", "stderr": "", "timed_out": False, "error": None,
       "stdout_truncated": False, "stderr_truncated": False, "signal": None}
try:
    for rel, text in files.items():
        path = os.path.normpath(os.path.join(work, rel))
        if os.path.isabs(rel) or not path.startswith(work + os.sep):
            raise ValueError("file name %r leaves the working directory" % rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text)
except (ValueError, OSError) as exc:
    out["error"] = str(exc)
    print(json.dumps(out))
    sys.exit(0)
limits = job["limits"]
def apply_limits():
    mb = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mb, mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    size = limits["max_file_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.get("cpu_seconds"):
        cpu = int(limits["cpu_seconds"]) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
boot = ("import runpy, sys; sys.path.insert(0, ''); sys.argv = ['main.py']; "
        "runpy.run_path('main.py', run_name='__main__')")
started = time.monotonic()
proc = subprocess.Popen([sys.executable, "-I", "-c", boot], cwd=work, stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                        preexec_fn=apply_limits)

try:
    stdout, stderr = proc.communicate(job.get("stdin", "").encode(), timeout=limits["timeout"])
except subprocess.TimeoutExpired:
    out["timed_out"] = True
    os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
cap = limits["max_output_bytes"]
for name, data in (("stdout", stdout), ("stderr", stderr)):
    out[name] = data[:cap].decode("utf-8", "replace")
    out[name + "_truncated"] = len(data) > cap
out["exit_code"] = proc.returncode
if proc.returncode is not None and proc.returncode < 0:
    out["signal"] = signal.Signals(-proc.returncode).name
out["duration_seconds"] = time.monotonic() - started
print(json.dumps(out))
"""


def _modal() -> Any:
    try:
        import modal
    except ImportError as exc:
        raise RuntimeError(
            "sandbox backend 'modal' needs the modal client: pip install 'mortal[cloud]'"
        ) from exc
    return modal


def app_name() -> str:
    return os.environ.get(APP_ENV) or DEFAULT_APP


def job_payload(job: Job, config: SandboxConfig) -> dict[str, Any]:
    """What RUNNER reads: the job and the limits that shape its result."""
    limits = {
        k: config.limits()[k]
        for k in ("timeout", "memory_mb", "cpu_seconds", "max_processes", "max_file_mb", "max_output_bytes")
    }
    return {"code": job.code, "stdin": job.stdin, "files": job.files or {}, "limits": limits}


def result_from(line: str, duration: float, confinement: str) -> ExecutionResult:
    """RUNNER's JSON line (or its absence: the sandbox died first) as an ExecutionResult."""
    try:
        out = json.loads(line.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return ExecutionResult(
            False,
            None,
            "",
            "",
            False,
            duration,
            confinement=confinement,
            error=f"the sandbox ended without a result (its output: {line[-300:]!r})",
        )
    code, timed_out = out["exit_code"], out["timed_out"]
    return ExecutionResult(
        success=code == 0 and not timed_out and out["error"] is None,
        exit_code=code,
        stdout=out["stdout"],
        stderr=out["stderr"],
        timed_out=timed_out,
        duration_seconds=out.get("duration_seconds", duration),
        stdout_truncated=out["stdout_truncated"],
        stderr_truncated=out["stderr_truncated"],
        confinement=confinement,
        signal=out["signal"],
        error=out["error"],
    )


class ModalSandboxExecutor(Executor):
    """Untrusted code: one modal.Sandbox per execution, no network, the code's limits inside it."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._app: Any = None
        self._image: Any = config.image

    def check(self) -> None:
        """No modal client here: fail when the rewards load, not at the first completion."""
        try:
            _modal()
        except RuntimeError as exc:
            raise SandboxUnavailable(str(exc)) from None

    def _resources(self) -> tuple[Any, Any]:
        """The app sandboxes belong to and the image they run (built once per executor)."""
        modal = _modal()
        if self._app is None:
            self._app = modal.App.lookup(app_name(), create_if_missing=True)
        if self._image is None:
            self._image = modal.Image.debian_slim(
                python_version=f"{sys.version_info.major}.{sys.version_info.minor}"
            )
        return self._app, self._image

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> ExecutionResult:
        app, image = self._resources()
        modal = _modal()
        started = time.monotonic()
        payload = json.dumps(job_payload(Job(code, stdin, files), self.config))
        try:
            sandbox = modal.Sandbox.create(
                "python3",
                "-I",
                "-c",
                RUNNER,
                app=app,
                image=image,
                block_network=True,
                timeout=math.ceil(self.config.timeout) + START_GRACE_SECONDS,
                memory=self.config.memory_mb + RUNNER_MEMORY_MB,
            )
        except modal.exception.Error as exc:
            return ExecutionResult(
                False,
                None,
                "",
                "",
                False,
                time.monotonic() - started,
                confinement=CONFINEMENT,
                error=f"could not start a Modal sandbox: {exc}",
            )
        try:
            sandbox.stdin.write(payload)
            sandbox.stdin.write_eof()
            sandbox.stdin.drain()
            sandbox.wait(raise_on_termination=False)
            line = sandbox.stdout.read()
        except modal.exception.Error as exc:
            return ExecutionResult(
                False,
                None,
                "",
                "",
                False,
                time.monotonic() - started,
                confinement=CONFINEMENT,
                error=f"the Modal sandbox failed: {exc}",
            )
        finally:
            sandbox.terminate()
        return result_from(line, time.monotonic() - started, CONFINEMENT)


class ModalFunctionExecutor(Executor):
    """Trusted code (execute_in_function): the deployed `execute` function, a batch as one map."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._function: Any = None

    def _remote(self) -> Any:
        if self._function is None:
            self._function = _modal().Function.from_name(app_name(), EXECUTE_FUNCTION)
        return self._function

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> ExecutionResult:
        return self.run_batch([Job(code, stdin, files)])[0]

    def run_batch(self, codes: Sequence[str | Job]) -> list[ExecutionResult]:
        jobs = [c if isinstance(c, Job) else Job(c) for c in codes]
        if not jobs:
            return []
        payloads = [job_payload(job, self.config) for job in jobs]
        return [ExecutionResult(**fields) for fields in self._remote().map(payloads)]


def execute_trusted(payload: dict[str, Any]) -> dict[str, Any]:
    """The body of the deployed `execute` function: one job, trusted, on that container's local backend."""
    from mortal.workers.rewards.sandbox import LocalExecutor

    limits = payload["limits"]
    config = SandboxConfig(
        timeout=limits["timeout"],
        max_output_bytes=limits["max_output_bytes"],
        confinement="none",
        allow_unconfined=True,
    )
    result = LocalExecutor(config, trusted=True).run(
        payload["code"], payload.get("stdin", ""), payload.get("files")
    )
    return asdict(result)


register_executor(
    "modal",
    lambda config, trusted: ModalFunctionExecutor(config) if trusted else ModalSandboxExecutor(config),
)
