"""A stand-in for the few `modal` objects ModalBackend uses, whose calls really run.

    fake = FakeModal(volume=mortal_home)          # "deploys" app mortal with its worker function
    backend = ModalBackend(modal=fake)            # or monkeypatch sys.modules["modal"] = fake

Only what mortal.controller.backends.modal calls, behaving as Modal documents it:
- `Function.from_name(app, name)` is lazy: an app that is not deployed raises NotFoundError at spawn;
  `.with_options(gpu=...)` returns the function with that GPU (recorded in `fake.spawned`).
- `.spawn(*args)` starts the function body in a subprocess, its "container" (the deployed body of
  `worker` is mortal.controller.backends.modal_worker.run_worker, the real one), with the app's
  environment (MORTAL_HOME = the volume) and Modal's cancellation signal (SIGUSR1 raises
  InputCancellation in the body). It returns a FunctionCall with an `object_id` "fc-...".
- `FunctionCall.from_id(id).get(timeout)` waits up to `timeout`, raises the builtin TimeoutError while
  the call runs, then returns the body's return value; a cancelled call or a dead container raises
  RemoteError, a call whose output was dropped (`fake.expire(id)`) raises OutputExpiredError.
- `.cancel()` delivers InputCancellation to the body; `.cancel(terminate_containers=True)` kills the
  container and everything in it.
- `Dict.from_name(name, create_if_missing=True)`: get / put / pop / items over values that are
  copied in and out, as Modal serializes them; it outlives every backend object (Modal's server).
Set `fake.unreachable = True` and every call raises modal.exception.ConnectionError.
"""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

WORKER_BODY = "mortal.controller.backends.modal_worker:run_worker"
_NO_DEFAULT = object()


class Error(Exception):
    pass


class NotFoundError(Error):
    pass


class ConnectionError(Error):  # noqa: A001 - Modal's own name
    pass


class ModalTimeoutError(Error):  # modal.exception.TimeoutError: not the builtin one
    pass


class OutputExpiredError(ModalTimeoutError):
    pass


class FunctionTimeoutError(ModalTimeoutError):
    pass


class RemoteError(Error):
    pass


class InternalFailure(Error):
    pass


class ExecutionError(Error):
    pass


class DeserializationError(Error):
    pass


class InputCancellation(BaseException):
    pass


EXCEPTIONS = SimpleNamespace(
    Error=Error, NotFoundError=NotFoundError, ConnectionError=ConnectionError, TimeoutError=ModalTimeoutError,
    OutputExpiredError=OutputExpiredError, FunctionTimeoutError=FunctionTimeoutError, RemoteError=RemoteError,
    InternalFailure=InternalFailure, ExecutionError=ExecutionError, DeserializationError=DeserializationError,
    InputCancellation=InputCancellation,
)


class _Container:
    """One spawned call: the body's process and where it leaves its result."""

    def __init__(self, proc: subprocess.Popen[bytes], result: Path) -> None:
        self.proc, self.result, self.expired, self.cancelled = proc, result, False, False

    @property
    def started(self) -> bool:
        """The body runs, with Modal's cancellation handler installed."""
        return self.result.with_suffix(".ready").exists()


class FakeModal:
    """The `modal` module as ModalBackend sees it, with one deployed app."""

    def __init__(self, volume: Path, app: str = "mortal", functions: dict[str, str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.exception = EXCEPTIONS
        self.apps = {app: functions or {"worker": WORKER_BODY}}
        self.env = {"MORTAL_HOME": str(volume), **(env or {})}  # the app's environment (volume mount)
        self.dicts: dict[str, dict[Any, Any]] = {}
        self.calls: dict[str, _Container] = {}
        self.spawned: list[tuple[str, str | None, tuple[Any, ...]]] = []  # (function, gpu, args)
        self.unreachable = False
        self._tmp = Path(tempfile.mkdtemp(prefix="fake-modal-"))
        self._lock = threading.Lock()
        self.Function = SimpleNamespace(from_name=self._function_from_name)
        self.FunctionCall = SimpleNamespace(from_id=lambda call_id: _FunctionCall(self, call_id))
        self.Dict = SimpleNamespace(from_name=self._dict_from_name)

    def _check(self) -> None:
        if self.unreachable:
            raise ConnectionError("could not connect to Modal (fake: unreachable)")

    def _function_from_name(self, app_name: str, name: str) -> _Function:
        self._check()
        return _Function(self, app_name, name, gpu=None)

    def _dict_from_name(self, name: str, create_if_missing: bool = False) -> _Dict:
        self._check()
        with self._lock:
            if name not in self.dicts:
                if not create_if_missing:
                    raise NotFoundError(f"Dict {name!r} not found")
                self.dicts[name] = {}
        return _Dict(self, name)

    # -- containers ----------------------------------------------------------------------------
    def start(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        call_id = f"fc-{uuid.uuid4().hex[:20]}"
        result = self._tmp / f"{call_id}.result"
        env = {**os.environ, **self.env}
        proc = subprocess.Popen([sys.executable, __file__, str(result)], stdin=subprocess.PIPE, env=env,
                                start_new_session=True)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((target, args, kwargs)))
        proc.stdin.close()
        with self._lock:
            self.calls[call_id] = _Container(proc, result)
        return call_id

    def container(self, call_id: str) -> _Container:
        with self._lock:
            found = self.calls.get(call_id)
        if found is None:
            raise NotFoundError(f"function call {call_id} not found")
        return found

    def kill_container(self, call_id: str) -> None:
        """What ending a container does: every process in it dies at once."""
        proc = self.container(call_id).proc
        try:
            inside = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            inside = []
        for p in inside:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                continue
        proc.wait()
        psutil.wait_procs(inside, timeout=10)

    def expire(self, call_id: str) -> None:
        """Drop a finished call's output, as Modal does after its retention period."""
        self.container(call_id).expired = True

    def worker_pid(self, call_id: str) -> int:
        """The pid of the mortal worker process the call's body started (its only child)."""
        children = psutil.Process(self.container(call_id).proc.pid).children()
        return children[0].pid

    def shutdown(self) -> None:
        for call_id in list(self.calls):
            if self.calls[call_id].proc.poll() is None:
                self.kill_container(call_id)


class _Function:
    def __init__(self, fake: FakeModal, app: str, name: str, gpu: str | None) -> None:
        self._fake, self._app, self._name, self._gpu = fake, app, name, gpu

    def with_options(self, *, gpu: str | None = None, **others: Any) -> _Function:
        assert not others, f"the fake has only gpu=, not {sorted(others)}"
        return _Function(self._fake, self._app, self._name, gpu if gpu is not None else self._gpu)

    def spawn(self, *args: Any, **kwargs: Any) -> _FunctionCall:
        self._fake._check()
        target = self._fake.apps.get(self._app, {}).get(self._name)
        if target is None:
            raise NotFoundError(f"Lookup failed for Function '{self._name}' from the '{self._app}' app")
        call_id = self._fake.start(target, copy.deepcopy(args), copy.deepcopy(kwargs))
        self._fake.spawned.append((self._name, self._gpu, args))
        return _FunctionCall(self._fake, call_id)


class _FunctionCall:
    def __init__(self, fake: FakeModal, call_id: str) -> None:
        self._fake, self.object_id = fake, call_id

    def get(self, timeout: float | None = None, *, index: int = 0) -> Any:
        self._fake._check()
        box = self._fake.container(self.object_id)
        try:
            box.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError() from None  # the builtin, as modal's poll_function raises it
        if box.expired:
            raise OutputExpiredError()
        if not box.result.exists() and box.cancelled:
            raise RemoteError("input was cancelled")
        if not box.result.exists():
            raise RemoteError(f"container of {self.object_id} exited with {box.proc.returncode} without output")
        kind, value = pickle.loads(box.result.read_bytes())
        if kind == "ok":
            return value
        if kind == "cancelled":
            raise RemoteError("input was cancelled")
        raise RuntimeError(value)  # the body's own exception, as deserialized from the remote

    def cancel(self, terminate_containers: bool = False) -> None:
        self._fake._check()
        box = self._fake.container(self.object_id)
        if box.proc.poll() is not None:
            return
        if terminate_containers or not box.started:  # an input not yet started is just dropped
            box.cancelled = not terminate_containers
            self._fake.kill_container(self.object_id)
        else:
            os.kill(box.proc.pid, signal.SIGUSR1)


class _Dict:
    def __init__(self, fake: FakeModal, name: str) -> None:
        self._fake, self._name = fake, name

    def _data(self) -> dict[Any, Any]:
        self._fake._check()
        return self._fake.dicts[self._name]

    def get(self, key: Any, default: Any = None) -> Any:
        with self._fake._lock:
            return copy.deepcopy(self._data().get(key, default))

    def put(self, key: Any, value: Any, *, skip_if_exists: bool = False) -> bool:
        with self._fake._lock:
            data = self._data()
            if skip_if_exists and key in data:
                return False
            data[key] = copy.deepcopy(value)
            return True

    def pop(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        with self._fake._lock:
            data = self._data()
            if key not in data:
                if default is _NO_DEFAULT:
                    raise KeyError(key)
                return default
            return data.pop(key)

    def items(self) -> Any:
        with self._fake._lock:
            return iter(copy.deepcopy(list(self._data().items())))


# -- the container's side: `python modal_fake.py RESULT` -------------------------------------------------
def _cancel_input(signum: int, frame: Any) -> None:
    raise InputCancellation("Input was cancelled by user")


def _container_main(result: Path) -> None:
    target, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGUSR1, _cancel_input)  # Modal's container entrypoint does this for sync bodies
    result.with_suffix(".ready").touch()
    module, _, name = target.partition(":")
    try:
        out: tuple[str, Any] = ("ok", getattr(importlib.import_module(module), name)(*args, **kwargs))
    except InputCancellation:
        out = ("cancelled", None)
    except BaseException as exc:  # noqa: BLE001 - whatever the body raised goes back to the caller
        out = ("error", f"{type(exc).__name__}: {exc}")
    tmp = result.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(out))
    tmp.rename(result)


# -- test bodies (deployed in place of the worker for the backend's unit tests) ---------------------------
def exit_after(launch: dict[str, Any]) -> int:
    """Sleep `SLEEP` seconds (from the launch's env), then return `CODE`."""
    time.sleep(float(launch["env"].get("SLEEP", "0")))
    return int(launch["env"].get("CODE", "0"))


def ignore_cancellation(launch: dict[str, Any]) -> int:
    """A body deaf to cancellation (as user code that swallows InputCancellation would be); touches MARKER."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    Path(launch["env"]["MARKER"]).touch()
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # so "modal_fake:exit_after" imports in the container
    _container_main(Path(sys.argv[1]))
