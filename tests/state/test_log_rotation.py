"""mortal.state.log_rotation: a worker log past its cap moves to `<log>.1` and starts over, whoever writes it.

What it promises: the rotated file holds the content before the rotation whole; every writer's next write
lands at the start of the emptied log (no hole of zeros); only a regular file opened for appending is
rotated; a worker process's own prints (the run's code) are capped, its last lines kept.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mortal.state import log_rotation


def test_the_cap_comes_from_the_environment_with_kubelets_default_otherwise() -> None:
    assert log_rotation.max_bytes({}) == log_rotation.DEFAULT_MAX_BYTES
    assert log_rotation.max_bytes({log_rotation.MAX_BYTES_ENV: "4096"}) == 4096
    assert log_rotation.max_bytes({log_rotation.MAX_BYTES_ENV: "0"}) == 0, "no cap"
    for unit_or_sign in ("10M", "10Mi", "-5", "²"):  # "²" is a digit to str.isdigit, not to int()
        assert (
            log_rotation.max_bytes({log_rotation.MAX_BYTES_ENV: unit_or_sign})
            == log_rotation.DEFAULT_MAX_BYTES
        )


def test_a_rotated_log_keeps_its_content_and_the_next_writes_start_over(tmp_path: Path) -> None:
    log = tmp_path / "actor-0-1.log"
    with open(log, "ab") as first, open(log, "ab") as second:  # stdout and a child's copy of it
        first.write(b"old line\n" * 100)
        first.flush()
        assert log_rotation.appended_file(first.fileno()) == log
        log_rotation.rotate(first.fileno(), log)
        second.write(b"new line\n")
        second.flush()
    assert (tmp_path / "actor-0-1.log.1").read_bytes() == b"old line\n" * 100
    assert log.read_bytes() == b"new line\n", "appended at the new start, no zeros before it"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor-0-1.log", "actor-0-1.log.1"]
    assert stat.S_IMODE((tmp_path / "actor-0-1.log.1").stat().st_mode) == 0o600, "its owner's, as the log is"


def test_a_link_planted_where_the_copy_goes_is_replaced_not_written_through(tmp_path: Path) -> None:
    logs, outside = tmp_path / "logs", tmp_path / "outside"
    logs.mkdir()
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("ORIGINAL\n")
    log = logs / "actor-0-1.log"
    (logs / "actor-0-1.log.1.partial").symlink_to(victim)
    (logs / "actor-0-1.log.1").symlink_to(victim)
    with open(log, "ab") as out:
        out.write(b"old line\n")
        out.flush()
        log_rotation.rotate(out.fileno(), log)
    assert victim.read_text() == "ORIGINAL\n"
    rotated = logs / "actor-0-1.log.1"
    assert not rotated.is_symlink() and rotated.read_bytes() == b"old line\n"


def test_only_a_regular_file_opened_for_appending_is_rotated(tmp_path: Path) -> None:
    with open(tmp_path / "w.log", "wb") as written:
        assert log_rotation.appended_file(written.fileno()) is None, "its next write would leave a hole"
    read, write = os.pipe()
    try:
        assert log_rotation.appended_file(write) is None
    finally:
        os.close(read)
        os.close(write)
    cap = log_rotation.LogCap(fd=read, limit=10)
    assert not cap.start(), "nothing to watch"


def test_no_cap_starts_nothing(tmp_path: Path) -> None:
    with open(tmp_path / "w.log", "ab") as log:
        assert not log_rotation.LogCap(fd=log.fileno(), limit=0).start()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_worker_that_prints_without_end_stays_under_its_cap_and_keeps_its_last_lines(
    tmp_path: Path,
) -> None:
    """A process as a backend starts a worker (stdout and stderr appending to its log) whose code prints
    every few milliseconds: the log never holds much more than the cap, and the last line printed is in it."""
    script = (
        "import sys, time\n"
        "from mortal.state.log_rotation import LogCap\n"
        "LogCap(limit=20000, every=0.02).start()\n"
        "for i in range(3000):\n"
        "    print(f'reward debug line {i:05d}', flush=True)\n"
        "    if i % 100 == 0: time.sleep(0.03)\n"
        "time.sleep(0.2)\n"
        "print('last line', flush=True)\n"
    )
    log = tmp_path / "rollout-0-1.log"
    with open(log, "ab") as out:
        subprocess.run(
            [sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, check=True, timeout=120
        )
    rotated = log_rotation.rotated_path(log)
    assert rotated.exists(), "rotated at least once"
    assert log.stat().st_size < 30000 and rotated.stat().st_size < 30000, "printed in all: 78 KB"
    assert log.read_text().splitlines()[-1] == "last line"
    assert "\x00" not in log.read_text() + rotated.read_text()
