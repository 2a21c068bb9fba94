"""`python -m mortal.state.http_server --processes N`: N server processes answer on one address, and none
outlives the process that started them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.polling import wait_for

TOKEN = "processes-admin-token"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    log = tmp_path / "server.log"
    env = {**os.environ, "MORTAL_STATE_TOKEN": TOKEN, "MORTAL_HOME": str(tmp_path)}
    cmd = [
        sys.executable,
        "-m",
        "mortal.state.http_server",
        "--backing-url",
        f"sqlite:///{tmp_path}/state.db",
        "--port",
        "0",
        "--processes",
        "2",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        found = wait_for(
            lambda: re.search(r"serving the state store at (http://\S+)", log.read_text()),
            timeout=60,
            what="the server's address",
            details=log.read_text,
            give_up=lambda: proc.poll() is not None,
        )
        yield proc, found.group(1)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            child.kill()
        proc.kill()
        proc.wait(10)


def _siblings(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children()


def test_every_process_answers_on_the_one_address(server: tuple[subprocess.Popen, str]) -> None:
    proc, url = server
    wait_for(lambda: len(_siblings(proc)) == 1, timeout=30, what="one sibling process")
    (sibling,) = _siblings(proc)
    port = int(url.rsplit(":", 1)[1])
    wait_for(
        lambda: any(c.status == "LISTEN" and c.laddr.port == port for c in sibling.net_connections()),
        timeout=60,
        what="the sibling listening on the same port",
    )
    # Fresh connections are spread over both listeners by the kernel: every one of them is answered.
    for _ in range(40):
        answer = requests.post(
            f"{url}/v1/list_runs",
            json={"args": {}},
            timeout=10,
            headers={"Authorization": f"Bearer {TOKEN}", "Connection": "close"},
        )
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_no_sibling_outlives_the_process_that_started_it(
    server: tuple[subprocess.Popen, str], how: int
) -> None:
    proc, _ = server
    wait_for(lambda: len(_siblings(proc)) == 1, timeout=30, what="one sibling process")
    (sibling,) = _siblings(proc)
    proc.send_signal(how)
    proc.wait(15)
    wait_for(
        lambda: not sibling.is_running() or sibling.status() == psutil.STATUS_ZOMBIE,
        timeout=15,
        what="the sibling to end with its parent",
    )


def test_a_sibling_gets_the_database_url_in_its_environment_not_its_command_line(
    server: tuple[subprocess.Popen, str], tmp_path: Path
) -> None:
    """A command line is every local user's to read (ps); a PostgreSQL URL may hold a password."""
    proc, _ = server
    wait_for(lambda: len(_siblings(proc)) == 1, timeout=30, what="one sibling process")
    (sibling,) = _siblings(proc)
    assert "state.db" not in " ".join(sibling.cmdline())
    assert sibling.environ()["MORTAL_STATE_URL"] == f"sqlite:///{tmp_path}/state.db"


def test_processes_must_be_at_least_one(tmp_path: Path) -> None:
    env = {**os.environ, "MORTAL_STATE_TOKEN": TOKEN, "MORTAL_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "mortal.state.http_server", "--processes", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--processes must be at least 1" in done.stderr
