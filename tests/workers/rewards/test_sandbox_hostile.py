"""Hostile code in the reward sandbox: each attack ends within its timeout, with a result, leaving nothing.

Every case runs in each confinement mode that works on this machine (bubblewrap, unshare; a mode
that does not is skipped with its probe's reason; `none` confines nothing and is not a mode to
attack). After every execution the test checks, besides what the case itself must show:
- no process it started is alive: every descendant of this process seen while it ran (psutil,
  sampled every 20 ms) is gone, and no process anywhere carries the case's marker in its argv;
- no file is left: the executor's temp root (a folder of the test) is empty again, and nothing
  named after the case appeared in the host's /tmp;
- the run returned within timeout + SLACK seconds.
"""

from __future__ import annotations

import errno
import json
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from mortal.workers.rewards import confinement
from mortal.workers.rewards.sandbox import ExecutionResult, LocalExecutor, SandboxConfig

SLACK = 3.0  # seconds past the timeout allowed for the kill and the clean-up
MEMORY_MB = 256
HOST_TMP = Path("/tmp")


class Descendants(threading.Thread):
    """Every process descended from this one while the watch runs, sampled every 20 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="descendants")
        # Children this process already had (an earlier test's server, multiprocessing's resource
        # tracker) are not the execution's.
        self.before = {_key(p) for p in psutil.Process().children(recursive=True) if _key(p) is not None}
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.commands: set[str] = set()  # every argv seen, joined (a process may exec after it is first seen)
        self.peak = 0
        self._done = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self._done.is_set():
            kids = [kid for kid in me.children(recursive=True) if _key(kid) not in self.before]
            self.peak = max(self.peak, len(kids))
            for kid in kids:
                try:
                    self.seen.setdefault((kid.pid, kid.create_time()), kid)
                    self.commands.add(" ".join(kid.cmdline()))
                except psutil.Error:
                    continue
            self._done.wait(0.02)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def survivors(self, grace: float = 3.0) -> list[psutil.Process]:
        """Those still alive (zombies count as gone) once `grace` seconds have passed at most."""
        deadline = time.monotonic() + grace
        while True:
            alive = [p for p in self.seen.values() if _alive(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.05)


def _key(process: psutil.Process) -> tuple[int, float] | None:
    try:
        return process.pid, process.create_time()
    except psutil.Error:
        return None


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def carrying(marker: str, grace: float = 3.0) -> list[int]:
    """Pids of live processes whose argv holds `marker`, once `grace` seconds have passed at most."""
    deadline = time.monotonic() + grace
    while True:
        found = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if any(marker in part for part in p.info["cmdline"] or ()) and _alive(p)
        ]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.fixture(params=["bubblewrap", "unshare"])
def mode(request: pytest.FixtureRequest) -> str:
    reason = confinement.probe(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} does not work here: {reason}")
    return request.param


@pytest.fixture
def marker() -> str:
    return f"mortal-hostile-{uuid.uuid4().hex}"


@pytest.fixture
def attack(
    mode: str, marker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple]]:
    """attack(code, timeout=2, **limits) -> (ExecutionResult, Descendants), checked as the module says."""
    temp_root = tmp_path / "executor-tmp"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))

    def run(code: str, timeout: float = 2.0, **limits: object) -> tuple[ExecutionResult, Descendants]:
        executor = LocalExecutor(
            SandboxConfig(confinement=mode, timeout=timeout, memory_mb=MEMORY_MB, **limits)
        )
        watch = Descendants()
        watch.start()
        started = time.monotonic()
        try:
            result = executor.run(code)
        finally:
            watch.stop()
        elapsed = time.monotonic() - started
        assert elapsed < timeout + SLACK, f"the run took {elapsed:.1f} s with a {timeout} s timeout"
        assert result.confinement == mode and result.error is None, result
        assert watch.seen, "the watch saw no process of the execution, so it could not see a survivor"
        assert watch.survivors() == [], "a process of the sandbox outlived its execution"
        assert carrying(marker) == [], "a process carrying the case's marker is still alive"
        assert list(temp_root.iterdir()) == [], "the execution's temp dir was left behind"
        return result, watch

    yield run
    assert list(HOST_TMP.glob(f"{marker}*")) == [], "the code left a file in the host's /tmp"


def test_an_endless_loop_is_killed_at_the_timeout(attack: Callable[..., tuple]) -> None:
    result, _ = attack("while True:\n    pass", timeout=1.5)
    assert result.timed_out and not result.success and result.signal == "SIGKILL"
    assert 1.5 <= result.duration_seconds < 1.5 + SLACK


def test_a_fork_bomb_is_capped_and_killed_at_the_timeout(attack: Callable[..., tuple]) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result, watch = attack(
        bomb, timeout=2.0, max_processes=16, cpu_seconds=30
    )  # the wall clock ends it, not SIGXCPU
    assert result.timed_out and not result.success
    if confinement.processes_capped():  # else only the timeout ends it (the executor warns)
        assert watch.peak <= 16, f"{watch.peak} processes at once with max_processes=16"


def test_allocating_8_gb_fails_at_the_memory_limit(attack: Callable[..., tuple]) -> None:
    code = (
        "try:\n    block = bytearray(8 * 1024 ** 3)\n    print('allocated 8 GB')\nexcept MemoryError:\n"
        "    print('refused 8 GB')\nchunks = []\ntry:\n    while True:\n"
        "        chunks.append(bytearray(32 << 20))\nexcept MemoryError:\n    print(len(chunks) * 32)"
    )
    result, _ = attack(code)
    assert result.success and not result.timed_out, result
    refused, reached = result.stdout.split("\n")[:2]
    assert refused == "refused 8 GB" and int(reached) < MEMORY_MB


def test_filling_the_disk_stops_at_the_private_tmpfs(
    attack: Callable[..., tuple], mode: str, marker: str
) -> None:
    code = (
        "import os, json\ndef fill(folder):\n    written = 0\n    try:\n        while True:\n"
        f"            with open(os.path.join(folder, '{marker}-' + str(written)), 'wb') as f:\n"
        "                f.write(b'x' * (4 << 20))\n            written += 4\n    except OSError as exc:\n"
        "        return written, exc.errno\nprint(json.dumps([fill('.'), fill('/tmp')]))"
    )
    result, _ = attack(code, timeout=3.0)
    if not confinement.select_mode(
        mode
    ).private_tmp_capped:  # a bwrap without --size: only the timeout ends it
        assert result.timed_out or result.success
        return
    assert result.success, result
    (workdir_mb, workdir_errno), (tmp_mb, tmp_errno) = json.loads(result.stdout)
    assert workdir_errno == tmp_errno == errno.ENOSPC
    assert 0 < workdir_mb + tmp_mb <= confinement.PRIVATE_TMP_MB  # the workdir lives in /tmp's tmpfs


def test_a_listener_on_the_hosts_loopback_is_unreachable(attack: Callable[..., tuple], marker: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as tcp, socket.socket(socket.AF_UNIX) as unix:
        unix.bind(f"\0{marker}")  # abstract unix sockets belong to the network namespace too
        unix.listen()
        port = tcp.getsockname()[1]
        code = (
            f"import socket\nfor family, address in [(socket.AF_INET, ('127.0.0.1', {port})), "
            f"(socket.AF_UNIX, '\\0{marker}')]:\n    s = socket.socket(family)\n    s.settimeout(1)\n"
            "    try:\n"
            "        s.connect(address)\n        print('connected')\n    except OSError as exc:\n"
            "        print('blocked', exc.errno)\n"
        )
        result, _ = attack(code)
        tcp.setblocking(False)
        unix.setblocking(False)
        for listener in (tcp, unix):
            with pytest.raises(BlockingIOError):
                listener.accept()
    assert result.success and result.stdout.count("blocked") == 2 and "connected" not in result.stdout, result


def test_the_environment_shows_no_secret(
    attack: Callable[..., tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = f"sk-mortal-{uuid.uuid4().hex}"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    code = (
        "import os, glob\nprint(dict(os.environ))\nfor path in glob.glob('/proc/*/environ'):\n    try:\n"
        "        print(path, open(path, 'rb').read())\n    except OSError as exc:\n        print(path, exc)"
    )
    result, _ = attack(code)
    assert result.success and "PATH" in result.stdout and "/proc/1/environ" in result.stdout, result
    assert secret not in result.stdout + result.stderr and "OPENAI_API_KEY" not in result.stdout


def test_writing_outside_the_working_directory_leaves_the_host_untouched(
    attack: Callable[..., tuple], marker: str, tmp_path: Path
) -> None:
    # Paths under /tmp exist inside too, in a private tmpfs; the rest of the root is read-only.
    private = [HOST_TMP / marker, tmp_path / marker, tmp_path / "executor-tmp" / marker]
    read_only = [Path.home() / marker, Path("/usr") / marker, Path(confinement.SEED) / "main.py"]
    code = (
        f"import os\nfor path in {[str(t) for t in private + read_only]!r}:\n    try:\n"
        "        with open(path, 'w') as f:\n            f.write('escaped')\n        print('wrote', path)\n"
        "    except OSError as exc:\n        print('refused', path, exc.errno)\n"
        "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
    )
    result, _ = attack(code)
    assert result.success and result.stdout.endswith("fine\n"), result
    outcomes = [line.split()[0] for line in result.stdout.splitlines()[:-1]]
    # As root the code is SANDBOX_UID, and the private folders above its working directory are root's.
    above_workdir = ["refused"] * 2 if confinement.as_root() else ["wrote"] * 2
    assert outcomes == ["wrote", *above_workdir] + ["refused"] * 3, result.stdout
    assert not any(path.exists() for path in private + read_only[:2])


@pytest.fixture
def root_only_file(tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A 0600 file of root's, in a folder the sandbox shows read-only (as it shows the interpreter's)."""
    if not confinement.as_root():
        pytest.skip("the code runs as the worker's own user: only as root are root's files at stake")
    shown = tmp_path / "shown"
    shown.mkdir(mode=0o755)
    secret = shown / marker
    secret.write_text("root's secret")
    secret.chmod(0o600)
    interpreter_dirs = confinement._interpreter_dirs()
    monkeypatch.setattr(confinement, "_interpreter_dirs", lambda: [*interpreter_dirs, str(shown)])
    return secret


def test_as_root_the_code_is_an_unprivileged_user_that_cannot_read_roots_files(
    attack: Callable[..., tuple], root_only_file: Path
) -> None:
    targets = [str(root_only_file), *(["/etc/shadow"] if Path("/etc/shadow").exists() else [])]
    code = (
        f"import os\nfor path in {targets!r}:\n    try:\n        open(path).read()\n"
        "        print('read', os.path.exists(path))\n    except PermissionError:\n"
        "        print('denied', os.path.exists(path))\n"
        "open('/tmp/own', 'w').write('a')\nopen('own', 'w').write('b')\nprint(os.listdir('/tmp'))\n"
        "print(os.getresuid(), os.getresgid(), os.getgroups(),\n"
        "      open('/proc/self/uid_map').read().split())"
    )
    result, _ = attack(code)
    assert result.success, result
    *outcomes, tmp_listing, who = result.stdout.splitlines()
    assert outcomes == ["denied True"] * len(targets), result.stdout  # there, and closed
    assert "'own'" in tmp_listing
    uid = confinement.SANDBOX_UID
    assert who == f"{(uid,) * 3} {(uid,) * 3} [] ['0', '0', '4294967295']"  # a host user, no user namespace


def test_a_detached_daemon_dies_with_the_execution(attack: Callable[..., tuple], marker: str) -> None:
    code = (
        "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', "
        "'import time\\nwhile True: time.sleep(0.05)', "
        f"'{marker}'])\n    os._exit(0)\nimport time\ntime.sleep(0.3)\nprint('parent exits')"
    )
    result, watch = attack(code)
    assert result.success and result.stdout == "parent exits\n" and not result.timed_out, result
    assert any(marker in command for command in watch.commands), "the daemon never ran"


def test_100_mb_of_output_is_cut_at_the_cap(attack: Callable[..., tuple]) -> None:
    rss_before = psutil.Process().memory_info().rss
    code = (
        "import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.buffer.write(chunk)\n"
        "    sys.stderr.buffer.write(chunk[:1 << 18])\nprint('end', file=sys.stderr)"
    )
    result, _ = attack(code, timeout=3.0)
    assert result.success, result.stderr[-300:]
    assert result.stdout_truncated and result.stderr_truncated
    assert len(result.stdout) == len(result.stderr) == SandboxConfig().max_output_bytes
    assert psutil.Process().memory_info().rss - rss_before < 50 << 20  # the worker kept only the caps
