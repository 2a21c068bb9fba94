"""The `modal` sandbox backend: each execution in a modal.Sandbox with no network, the job in as JSON,
its outcome back as one line; the sandbox always terminated; trusted code through the deployed
`execute` function. Modal cannot be reached from here: the client's calls are replaced by a fake that
binds every call to the installed library's own signature and runs the sandbox's command in a local
process (so the runner script itself is tested for real)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest

modal = pytest.importorskip("modal")

from mortal.specs.rewards import RewardSpec  # noqa: E402
from mortal.workers.rewards import RewardSet  # noqa: E402
from mortal.workers.rewards import modal_sandbox as ms  # noqa: E402
from mortal.workers.rewards.sandbox import Job, SandboxConfig, make_executor  # noqa: E402


def bound(owner: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """Fail the test if the call would not bind to the installed library's signature."""
    inspect.signature(getattr(owner, name)).bind(*args, **kwargs)


class FakeStreamWriter:
    """The sandbox's stdin: what is written reaches the process at EOF (when the sandbox is waited on)."""

    def __init__(self) -> None:
        self.data, self.eof = [], False

    def write(self, data: str | bytes) -> None:
        bound(modal.io_streams.StreamWriter, "write", self, data)
        assert not self.eof, "write after write_eof"
        self.data.append(data if isinstance(data, str) else data.decode())

    def write_eof(self) -> None:
        bound(modal.io_streams.StreamWriter, "write_eof", self)
        self.eof = True

    def drain(self) -> None:
        bound(modal.io_streams.StreamWriter, "drain", self)


class FakeStreamReader:
    def __init__(self, sandbox: FakeSandbox) -> None:
        self.sandbox = sandbox

    def read(self) -> str:
        bound(modal.io_streams.StreamReader, "read", self)
        return self.sandbox.out


class FakeSandbox:
    """modal.Sandbox as the backend uses it; the command runs here, killed at the sandbox's timeout."""

    created: list[FakeSandbox] = []

    def __init__(self, args: tuple[str, ...], kwargs: dict[str, Any]) -> None:
        assert args[0] == "python3"
        self.kwargs, self.terminated, self.out = kwargs, 0, ""
        self.proc = subprocess.Popen(
            [sys.executable, *args[1:]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.stdin, self.stdout = FakeStreamWriter(), FakeStreamReader(self)

    @classmethod
    def create(cls, *args: str, **kwargs: Any) -> FakeSandbox:
        bound(modal.Sandbox, "create", *args, **kwargs)
        cls.created.append(cls(args, kwargs))
        return cls.created[-1]

    def wait(self, raise_on_termination: bool = True) -> None:
        bound(modal.Sandbox, "wait", self, raise_on_termination=raise_on_termination)
        sent = "".join(self.stdin.data).encode() if self.stdin.eof else None
        try:
            out, _ = self.proc.communicate(sent, timeout=self.kwargs["timeout"])
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.out = out.decode()

    def terminate(self, *, wait: bool = False) -> None:
        bound(modal.Sandbox, "terminate", self, wait=wait)
        self.terminated += 1
        if self.proc.poll() is None:
            self.proc.kill()


@pytest.fixture
def fake_modal(monkeypatch: pytest.MonkeyPatch) -> type[FakeSandbox]:
    FakeSandbox.created = []

    def lookup(name: str, **kwargs: Any) -> str:
        bound(modal.App, "lookup", name, **kwargs)
        return f"app:{name}"

    monkeypatch.setattr(modal.Sandbox, "create", FakeSandbox.create)
    monkeypatch.setattr(modal.App, "lookup", lookup)
    monkeypatch.delenv(ms.APP_ENV, raising=False)
    return FakeSandbox


def modal_executor(**limits: Any) -> ms.ModalSandboxExecutor:
    executor = make_executor(SandboxConfig(backend="modal", **limits))
    assert isinstance(executor, ms.ModalSandboxExecutor)
    return executor


def test_code_runs_in_a_sandbox_without_network_and_the_sandbox_is_terminated(fake_modal) -> None:
    result = modal_executor(timeout=5).run("import sys; print(sys.stdin.read() * 2)", stdin="ab")
    assert (result.success, result.exit_code, result.stdout, result.confinement) == (
        True,
        0,
        "abab\n",
        "modal-sandbox",
    )
    [sandbox] = fake_modal.created
    assert sandbox.kwargs["block_network"] is True and sandbox.kwargs["app"] == "app:mortal"
    assert sandbox.kwargs["timeout"] == 5 + ms.START_GRACE_SECONDS
    assert sandbox.kwargs["memory"] == 512 + ms.RUNNER_MEMORY_MB
    assert isinstance(sandbox.kwargs["image"], modal.Image) and sandbox.terminated == 1


def test_a_custom_image_and_app_are_used_as_given(fake_modal, monkeypatch) -> None:
    monkeypatch.setenv(ms.APP_ENV, "other")
    image = modal.Image.debian_slim(python_version="3.12").pip_install("numpy")
    modal_executor(image=image).run("print(1)")
    assert (
        fake_modal.created[0].kwargs["image"] is image and fake_modal.created[0].kwargs["app"] == "app:other"
    )


def test_the_code_is_killed_at_its_timeout_and_its_output_capped(fake_modal) -> None:
    slow = modal_executor(timeout=1).run("import time\nprint('started', flush=True)\ntime.sleep(30)")
    assert (slow.success, slow.timed_out, slow.signal, slow.stdout) == (False, True, "SIGKILL", "started\n")
    loud = modal_executor(max_output_bytes=100).run("print('x' * 10000)")
    assert loud.success and len(loud.stdout) == 100 and loud.stdout_truncated


def test_files_failures_and_limits_come_back_as_results(fake_modal) -> None:
    executor = modal_executor(memory_mb=64)
    helper = executor.run("import helper; print(helper.VALUE)", files={"helper.py": "VALUE = 7"})
    assert helper.stdout == "7\n"
    failed = executor.run("raise SystemExit(3)")
    assert (failed.success, failed.exit_code) == (False, 3)
    escaped = executor.run("print(1)", files={"../outside.py": "x"})
    assert not escaped.success and "leaves the working directory" in escaped.error
    hungry = executor.run("x = bytearray(512 * 1024 * 1024)")
    assert not hungry.success and "MemoryError" in hungry.stderr
    assert all(sandbox.terminated == 1 for sandbox in fake_modal.created)


def test_a_sandbox_that_dies_without_a_result_says_so(fake_modal, monkeypatch) -> None:
    monkeypatch.setattr(ms, "RUNNER", "import sys; sys.exit(9)")
    result = modal_executor().run("print(1)")
    assert not result.success and result.error.startswith("the sandbox ended without a result")


def test_a_spec_reward_runs_its_code_in_modal_sandboxes(fake_modal) -> None:
    entry = RewardSpec.model_validate(
        {"env": "code-execution", "sandbox": {"backend": "modal", "timeoutSeconds": 5}}
    )
    rewards = RewardSet.from_spec([entry])
    right, wrong = (
        "```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a\n```",
    )
    scores = rewards.score("p", [right, wrong], [[1], [2]], {"tests": ["assert add(2, 3) == 5"]})
    assert scores == {"code-execution": [1.0, 0.0]} and len(fake_modal.created) == 2


def test_trusted_code_goes_to_the_deployed_execute_function_as_one_map(monkeypatch) -> None:
    calls = []

    class FakeFunction:
        def map(self, *inputs: Any, **kwargs: Any):
            bound(modal.Function, "map", self, *inputs, **kwargs)
            calls.append(len(inputs[0]))
            return [ms.execute_trusted(payload) for payload in inputs[0]]

    def from_name(app_name: str, name: str, **kwargs: Any) -> FakeFunction:
        bound(modal.Function, "from_name", app_name, name, **kwargs)
        assert (app_name, name) == ("mortal", ms.EXECUTE_FUNCTION)
        return FakeFunction()

    monkeypatch.setattr(modal.Function, "from_name", from_name)
    monkeypatch.delenv(ms.APP_ENV, raising=False)
    executor = make_executor(SandboxConfig(backend="modal", timeout=5), trusted=True)
    results = executor.run_batch(["print(1)", Job("import sys; print(sys.stdin.read())", stdin="in")])
    assert [r.stdout for r in results] == ["1\n", "in\n"] and calls == [2]
    assert executor.run("raise SystemExit(2)").exit_code == 2
