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
- `Volume.from_name(name)`: commit() / reload(), counted in `fake.commits` / `fake.reloads`; and, as a
  client outside the containers sees it, listdir / read_file / remove_file over the folder the app
  mounts (`volume`: the same files the containers write), missing paths raising what modal 1.6 raises.
- Preemption, as Modal does it: `fake.preempt(id)` interrupts the call's container (SIGINT, its
  grace) and starts the same input again in a new one (same call id); `fake.vanish(id)` ends the
  container and forgets the call (`get` raises NotFoundError).
Set `fake.unreachable = True` and every call raises modal.exception.ConnectionError.

Faithful to the installed `modal` (the test extra installs the real library): every call is bound to
that library's own signature (`inspect.signature(modal.Function.spawn)`, ...: `conform`), a spawn's
arguments also to the deployed function's (the app module's `worker(launch)`), Dict values must
pickle, and the errors raised are modal.exception's own classes. A call that would fail against the
real client raises ModalAPIMisuse (a BaseException, like pytest's own failures, so no `except
Exception` in the code under test swallows it) and is kept in `fake.misuses`: `shutdown()`, which
every fixture calls, fails the test on any.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

WORKER_BODY = "mortal.controller.backends.modal_worker:run_worker"


class InputCancellation(BaseException):
    """The container's side only (modal.exception.InputCancellation, without importing modal there)."""


class ModalAPIMisuse(BaseException):  # noqa: N818 - reads as what happened
    """A call the installed modal library would refuse: wrong names, arguments, or unpicklable values."""


def _api_signature(api: Callable[..., Any]) -> inspect.Signature:
    """The signature a caller binds to: without the `self`/`cls` that modal's wrappers still list."""
    signature = inspect.signature(api)
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls"):
        signature = signature.replace(parameters=params[1:])
    return signature


def conform(api: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments by name (defaults filled in) as the installed library's `api` binds them;
    ModalAPIMisuse when they do not bind."""
    signature = _api_signature(api)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ModalAPIMisuse(f"{api.__qualname__}{signature} refuses {args!r}, {kwargs!r}: {exc}") from None
    bound.apply_defaults()
    return bound.arguments


WORKER_FUNCTIONS = (
    "worker",
    "rollout_vllm",
)  # the app's functions that run a worker (mortal.client.modal_app)


def _deployed_workers() -> dict[str, Callable[..., Any]]:
    """The bodies `modal deploy` ships as the app's worker functions (their signatures are what spawn
    binds)."""
    from mortal.client import modal_app

    return {name: getattr(modal_app, name)._get_source_info().raw_f for name in WORKER_FUNCTIONS}


class _Container:
    """One spawned call: the body's process and where it leaves its result."""

    def __init__(self, proc: subprocess.Popen[bytes], result: Path, target: str, payload: bytes) -> None:
        self.proc, self.result, self.expired, self.cancelled = proc, result, False, False
        self.target, self.payload, self.attempts = target, payload, 1
        self.restarting = False  # preempted, its input not yet started again: the call still runs

    @property
    def started(self) -> bool:
        """The body runs, with Modal's cancellation handler installed."""
        return self.result.with_suffix(".ready").exists()


class FakeModal:
    """The `modal` module as ModalBackend sees it, with one deployed app."""

    def __init__(
        self,
        volume: Path,
        app: str = "mortal",
        functions: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import modal  # the real library: its signatures and its exception classes

        self.api, self.exception = modal, modal.exception
        self.deployed_workers = _deployed_workers()
        self.volume = volume
        self.misuses: list[ModalAPIMisuse] = []
        self.commits: dict[str, int] = {}
        self.reloads: dict[str, int] = {}
        self.apps = {app: functions or dict.fromkeys(WORKER_FUNCTIONS, WORKER_BODY)}
        self.env = {"MORTAL_HOME": str(volume), **(env or {})}  # the app's environment (volume mount)
        self.dicts: dict[str, dict[Any, Any]] = {}
        self.calls: dict[str, _Container] = {}
        self.gone: dict[str, _Container] = {}  # vanished calls (their containers, for shutdown's checks)
        self.spawned: list[tuple[str, str | None, tuple[Any, ...]]] = []  # (function, gpu, args)
        self.unreachable = False
        self._tmp = Path(tempfile.mkdtemp(prefix="fake-modal-"))
        self._lock = threading.Lock()
        self.Function = SimpleNamespace(from_name=self._function_from_name)
        self.FunctionCall = SimpleNamespace(from_id=lambda *a, **kw: _FunctionCall.from_id(self, *a, **kw))
        self.Dict = SimpleNamespace(from_name=self._dict_from_name)
        self.Volume = SimpleNamespace(from_name=self._volume_from_name)

    def conform(self, api: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`conform`, remembering a misuse for shutdown() in case the code under test swallowed it."""
        try:
            return conform(api, *args, **kwargs)
        except ModalAPIMisuse as exc:
            self.misuses.append(exc)
            raise

    def serializable(self, value: Any) -> Any:
        """A copy of `value` as Modal stores it (pickled); an unpicklable one is a misuse."""
        try:
            return pickle.loads(pickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 - whatever pickle raises, Modal would refuse it too
            self.misuses.append(ModalAPIMisuse(f"not serializable for Modal: {value!r}: {exc}"))
            raise self.misuses[-1] from None

    def _check(self) -> None:
        if self.unreachable:
            raise self.exception.ConnectionError("could not connect to Modal (fake: unreachable)")

    def _function_from_name(self, *args: Any, **kwargs: Any) -> _Function:
        bound = self.conform(self.api.Function.from_name, *args, **kwargs)
        self._check()
        return _Function(self, bound["app_name"], bound["name"], gpu=None)

    def _dict_from_name(self, *args: Any, **kwargs: Any) -> _Dict:
        bound = self.conform(self.api.Dict.from_name, *args, **kwargs)
        self._check()
        name = bound["name"]
        with self._lock:
            if name not in self.dicts:
                if not bound["create_if_missing"]:
                    raise self.exception.NotFoundError(f"Dict {name!r} not found")
                self.dicts[name] = {}
        return _Dict(self, name)

    def _volume_from_name(self, *args: Any, **kwargs: Any) -> _Volume:
        bound = self.conform(self.api.Volume.from_name, *args, **kwargs)
        self._check()
        return _Volume(self, bound["name"])

    # -- containers ----------------------------------------------------------------------------
    def start(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        call_id = f"fc-{uuid.uuid4().hex[:20]}"
        payload = pickle.dumps((target, args, kwargs))
        result = self._tmp / f"{call_id}.result"
        with self._lock:
            self.calls[call_id] = _Container(self._boot(result, payload), result, target, payload)
        return call_id

    def _boot(self, result: Path, payload: bytes) -> subprocess.Popen[bytes]:
        """A container running the body the payload names."""
        proc = subprocess.Popen(
            [sys.executable, __file__, str(result)],
            stdin=subprocess.PIPE,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        assert proc.stdin is not None
        proc.stdin.write(payload)
        proc.stdin.close()
        return proc

    def preempt(self, call_id: str, grace: float = 30.0, restart_after: float = 0.0) -> None:
        """What a preemption does: SIGINT to the container (the body's handlers run, within `grace`),
        then, `restart_after` seconds later, the same input in a new container under the same call id."""
        box = self.container(call_id)
        box.restarting = True
        os.kill(box.proc.pid, signal.SIGINT)
        try:
            box.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill_container(call_id)
        for leftover in (box.result, box.result.with_suffix(".ready")):
            leftover.unlink(missing_ok=True)
        time.sleep(restart_after)
        with self._lock:
            if not box.restarting:  # cancelled meanwhile: the input is not started again
                return
            box.proc, box.attempts, box.restarting = (
                self._boot(box.result, box.payload),
                box.attempts + 1,
                False,
            )

    def vanish(self, call_id: str) -> None:
        """The call is gone from Modal altogether: its container ended, its id unknown (NotFoundError)."""
        self.kill_container(call_id)
        with self._lock:
            self.gone[call_id] = self.calls.pop(call_id)

    def container(self, call_id: str) -> _Container:
        with self._lock:
            found = self.calls.get(call_id)
        if found is None:
            raise self.exception.NotFoundError(f"function call {call_id} not found")
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
        """End every container; then fail if any call misused the library (see ModalAPIMisuse)."""
        for call_id in list(self.calls):
            if self.calls[call_id].proc.poll() is None:
                self.kill_container(call_id)
        for box in self.gone.values():
            box.proc.wait()
        if self.misuses:
            raise ModalAPIMisuse(f"{len(self.misuses)} call(s) the real modal would refuse: {self.misuses}")


class _Function:
    def __init__(self, fake: FakeModal, app: str, name: str, gpu: str | None) -> None:
        self._fake, self._app, self._name, self._gpu = fake, app, name, gpu

    def with_options(self, *args: Any, **options: Any) -> _Function:
        gpu = self._fake.conform(self._fake.api.Function.with_options, *args, **options)["gpu"]
        assert set(options) <= {"gpu"}, f"the fake has only gpu=, not {sorted(set(options) - {'gpu'})}"
        return _Function(self._fake, self._app, self._name, gpu if gpu is not None else self._gpu)

    def spawn(self, *args: Any, **kwargs: Any) -> _FunctionCall:
        self._fake.conform(self._fake.api.Function.spawn, *args, **kwargs)
        if self._name in self._fake.deployed_workers:
            self._fake.conform(self._fake.deployed_workers[self._name], *args, **kwargs)
        self._fake._check()
        target = self._fake.apps.get(self._app, {}).get(self._name)
        if target is None:
            raise self._fake.exception.NotFoundError(
                f"Lookup failed for Function '{self._name}' from the '{self._app}' app"
            )
        call_id = self._fake.start(target, self._fake.serializable(args), self._fake.serializable(kwargs))
        self._fake.spawned.append((self._name, self._gpu, args))
        return _FunctionCall(self._fake, call_id)


class _FunctionCall:
    def __init__(self, fake: FakeModal, call_id: str) -> None:
        self._fake, self.object_id = fake, call_id

    @classmethod
    def from_id(cls, fake: FakeModal, *args: Any, **kwargs: Any) -> _FunctionCall:
        return cls(fake, fake.conform(fake.api.FunctionCall.from_id, *args, **kwargs)["function_call_id"])

    def get(self, *args: Any, **kwargs: Any) -> Any:
        timeout = self._fake.conform(self._fake.api.FunctionCall.get, *args, **kwargs)["timeout"]
        self._fake._check()
        errors = self._fake.exception
        box = self._fake.container(self.object_id)
        try:
            box.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError() from None  # the builtin, as modal's poll_function raises it
        if box.restarting:  # a preempted input waiting for its next container: still running
            time.sleep(timeout or 0)
            raise TimeoutError()
        if box.expired:
            raise errors.OutputExpiredError()
        if not box.result.exists() and box.cancelled:
            raise errors.RemoteError("input was cancelled")
        if not box.result.exists():
            raise errors.RemoteError(
                f"container of {self.object_id} exited with {box.proc.returncode} without output"
            )
        kind, value = pickle.loads(box.result.read_bytes())
        if kind == "ok":
            return value
        if kind == "cancelled":
            raise errors.RemoteError("input was cancelled")
        raise RuntimeError(value)  # the body's own exception, as deserialized from the remote

    def cancel(self, *args: Any, **kwargs: Any) -> None:
        terminate = self._fake.conform(self._fake.api.FunctionCall.cancel, *args, **kwargs)[
            "terminate_containers"
        ]
        self._fake._check()
        box = self._fake.container(self.object_id)
        with self._fake._lock:
            if box.restarting:  # a preempted input not yet started again is dropped
                box.restarting, box.cancelled = False, True
                return
        if box.proc.poll() is not None:
            return
        if terminate or not box.started:  # an input not yet started is just dropped
            box.cancelled = not terminate
            self._fake.kill_container(self.object_id)
        else:
            os.kill(box.proc.pid, signal.SIGUSR1)


class _Dict:
    def __init__(self, fake: FakeModal, name: str) -> None:
        self._fake, self._name = fake, name

    def _data(self, method: str, *args: Any, **kwargs: Any) -> tuple[dict[Any, Any], dict[str, Any]]:
        """The Dict's contents and the call's arguments, bound as modal.Dict.<method> binds them."""
        bound = self._fake.conform(getattr(self._fake.api.Dict, method), *args, **kwargs)
        self._fake._check()
        return self._fake.dicts[self._name], bound

    def get(self, *args: Any, **kwargs: Any) -> Any:
        with self._fake._lock:
            data, bound = self._data("get", *args, **kwargs)
            return copy.deepcopy(data.get(self._fake.serializable(bound["key"]), bound["default"]))

    def put(self, *args: Any, **kwargs: Any) -> bool:
        with self._fake._lock:
            data, bound = self._data("put", *args, **kwargs)
            if bound["skip_if_exists"] and bound["key"] in data:
                return False
            data[self._fake.serializable(bound["key"])] = self._fake.serializable(bound["value"])
            return True

    def pop(self, *args: Any, **kwargs: Any) -> Any:
        with self._fake._lock:
            data, bound = self._data("pop", *args, **kwargs)
            if bound["key"] not in data:
                if bound["default"] is _api_signature(self._fake.api.Dict.pop).parameters["default"].default:
                    raise KeyError(bound["key"])
                return bound["default"]
            return data.pop(bound["key"])

    def items(self, *args: Any, **kwargs: Any) -> Any:
        with self._fake._lock:
            data, _ = self._data("items", *args, **kwargs)
            return iter(copy.deepcopy(list(data.items())))


class _Volume:
    def __init__(self, fake: FakeModal, name: str) -> None:
        self._fake, self._name = fake, name

    def commit(self, *args: Any, **kwargs: Any) -> None:
        self._count("commit", self._fake.commits, *args, **kwargs)

    def reload(self, *args: Any, **kwargs: Any) -> None:
        self._count("reload", self._fake.reloads, *args, **kwargs)

    def _path(self, method: str, *args: Any, **kwargs: Any) -> tuple[Path, dict[str, Any]]:
        """The local file behind the volume path the call names (checked like every call)."""
        bound = self._fake.conform(getattr(self._fake.api.Volume, method), *args, **kwargs)
        self._fake._check()
        path = bound["path"]
        if path.startswith("/") or ".." in Path(path).parts:
            raise ModalAPIMisuse(f"Volume.{method}: {path!r} is not a path inside the volume")
        return self._fake.volume / path, bound

    def listdir(self, *args: Any, **kwargs: Any) -> list[Any]:
        from modal.volume import FileEntry, FileEntryType

        local, bound = self._path("listdir", *args, **kwargs)
        if not local.exists():
            raise self._fake.exception.NotFoundError(f"No such file or directory: {bound['path']}")
        found = local.rglob("*") if bound["recursive"] else local.iterdir() if local.is_dir() else [local]
        return [
            FileEntry(
                path=str(p.relative_to(self._fake.volume)),
                mtime=int(p.stat().st_mtime),
                type=FileEntryType.DIRECTORY if p.is_dir() else FileEntryType.FILE,
                size=p.stat().st_size if p.is_file() else 0,
            )
            for p in sorted(found)
        ]

    def read_file(self, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        local, bound = self._path("read_file", *args, **kwargs)
        if not local.is_file():
            raise FileNotFoundError(
                f"No such file: {bound['path']}"
            )  # modal 1.6 turns its NotFoundError into this
        data = local.read_bytes()
        return iter([data[i : i + 4096] for i in range(0, len(data), 4096)])

    def remove_file(self, *args: Any, **kwargs: Any) -> None:
        local, bound = self._path("remove_file", *args, **kwargs)
        if not local.exists():
            raise FileNotFoundError(f"No such file or directory: {bound['path']}")
        assert not local.is_dir() or bound["recursive"], "the fake removes folders only recursively"
        shutil.rmtree(local) if local.is_dir() else local.unlink()

    def batch_upload(self, *args: Any, **kwargs: Any) -> _Upload:
        self._fake.conform(self._fake.api.Volume.batch_upload, *args, **kwargs)
        self._fake._check()
        return _Upload(self._fake)

    def _count(self, method: str, counts: dict[str, int], *args: Any, **kwargs: Any) -> None:
        self._fake.conform(getattr(self._fake.api.Volume, method), *args, **kwargs)
        self._fake._check()
        with self._fake._lock:
            counts[self._name] = counts.get(self._name, 0) + 1


class _Upload:
    """Volume.batch_upload's context: the files are copied into the volume when it exits without an error.
    Without force, a file already in the volume is refused (the fake's reading of Modal's no-overwrite
    rule)."""

    def __init__(self, fake: FakeModal) -> None:
        from modal.volume import VolumeUploadContextManager

        self._fake, self._api, self._files = fake, VolumeUploadContextManager, []

    def __enter__(self) -> _Upload:
        return self

    def put_file(self, *args: Any, **kwargs: Any) -> None:
        bound = self._fake.conform(self._api.put_file, *args, **kwargs)
        remote = str(bound["remote_path"])
        if remote.startswith("/") or ".." in Path(remote).parts:
            raise ModalAPIMisuse(f"put_file: {remote!r} is not a path inside the volume")
        self._files.append((Path(bound["local_file"]), self._fake.volume / remote))

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            return
        for local, dest in self._files:
            if dest.exists():
                raise self._fake.exception.Error(f"fake: {dest} is already in the volume (no force)")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, dest)


# -- the container's side: `python modal_fake.py RESULT` -------------------------------------------------
def _cancel_input(signum: int, frame: Any) -> None:
    raise InputCancellation("Input was cancelled by user")


def _container_main(result: Path) -> None:
    target, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    signal.signal(signal.SIGUSR1, _cancel_input)  # Modal's container entrypoint does this for sync bodies
    # A preemption's SIGINT raises KeyboardInterrupt, as in a fresh container, also when the tests were
    # started as a background job (which inherits SIGINT ignored, and Python then keeps it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
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


def logged(launch: dict[str, Any]) -> int:
    """The worker function's own log path (modal_worker.run_logged) around the script `SCRIPT`, writing
    `LOG`, its commits recorded as lines of `COMMITS` (each: the log's size when committed)."""
    from mortal.controller.backends.modal_worker import run_logged

    env, log, commits = launch["env"], Path(launch["env"]["LOG"]), Path(launch["env"]["COMMITS"])

    def commit() -> None:
        with commits.open("a") as out:
            out.write(f"{log.stat().st_size}\n")

    return run_logged(
        [sys.executable, "-c", env["SCRIPT"]],
        os.environ,
        log,
        stop_grace=5,
        commit=commit,
        commit_every=float(env.get("EVERY", "0.2")),
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))  # so "modal_fake:exit_after" imports in the container
    _container_main(Path(sys.argv[1]))
