"""The store server process leaves the objects of its start out of later garbage collections
(`serve(freeze_heap=True)`, which `python -m mortal.state.http_server` passes): a full collection
walks every object it finds and stops the server's threads meanwhile, and the first came with the first
burst of calls. Run in a child process each: what a process freezes it keeps for its life."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import gc, sys
from mortal.state.http_server import serve
with serve(sys.argv[1], "heap-test-admin-token", freeze_heap=sys.argv[2] == "1"):
    print(gc.get_freeze_count())
"""


def _frozen_after_start(tmp_path: Path, freeze: bool) -> int:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, url, "1" if freeze else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_serving_process_freezes_what_its_start_left(tmp_path: Path) -> None:
    assert _frozen_after_start(tmp_path, freeze=False) == 0
    assert _frozen_after_start(tmp_path, freeze=True) > 10_000  # the imports', the migrations', ...


def test_the_server_command_freezes_its_heap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mortal.state import http_server

    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def fake_serve(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(http_server, "serve", fake_serve)
    monkeypatch.setenv(http_server.TOKEN_ENV, "heap-test-admin-token")
    with pytest.raises(Stop):
        http_server.main(["--backing-url", f"sqlite:///{tmp_path / 'state.db'}", "--port", "0"])
    assert seen["freeze_heap"] is True
