"""Reading worker logs for `mortalctl logs`: which files, prefixes, tail, follow across a relaunch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

from mortal.controller.logs import VolumeLogs, log_files, read_logs
from mortal.state import paths


def write(run: str, role: str, replica: int, incarnation: int, text: str) -> Path:
    path = paths.worker_log(run, role, replica, incarnation)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(text)
    return path


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def follow_until_done(run: str) -> tuple[threading.Thread, list[str]]:
    """`logs -f` of the run on a thread, each line it yields appended to the list, until a line "done"."""
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        for line in read_logs(run, follow=True, poll_seconds=0.02, stop=stop):
            seen.append(line)
            if line == "done":
                stop.set()

    thread = threading.Thread(target=reader)
    thread.start()
    return thread, seen


def test_newest_incarnation_per_slot_actor_first(mortal_home: Path) -> None:
    old = write("r", "actor", 0, 1, "old\n")
    new = write("r", "actor", 0, 4, "new\n")
    r0 = write("r", "rollout", 0, 2, "r0\n")
    r1 = write("r", "rollout", 1, 3, "r1\n")
    (paths.logs_dir("r") / "notes.txt").write_text("not a log")
    assert log_files("r") == [new, r0, r1]
    assert old not in log_files("r")
    assert log_files("r", role="rollout", replica=1) == [r1]
    assert log_files("missing") == []


def test_a_link_in_the_logs_folder_is_not_read(mortal_home: Path, tmp_path: Path) -> None:
    """A file outside the run, or /dev/zero, linked in as a later incarnation's log: never printed."""
    kept = write("r", "rollout", 0, 2, "mine\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET\n")
    (paths.logs_dir("r") / "rollout-0-9.log").symlink_to(secret)
    (paths.logs_dir("r") / "actor-0-3.log").symlink_to("/dev/zero")
    assert log_files("r") == [kept]
    assert list(read_logs("r")) == ["mine"]


def test_lines_are_prefixed_only_when_several_slots(mortal_home: Path) -> None:
    write("r", "actor", 0, 1, "a1\na2\n")
    write("r", "rollout", 0, 2, "b1\nhalf-written")
    assert list(read_logs("r", role="actor")) == ["a1", "a2"]
    assert list(read_logs("r")) == [
        "[actor-0] a1",
        "[actor-0] a2",
        "[rollout-0] b1",
        "[rollout-0] half-written",
    ]
    assert list(read_logs("r", tail=1)) == ["[actor-0] a2", "[rollout-0] half-written"]
    assert list(read_logs("r", tail=0)) == []


def test_a_line_ends_only_at_a_newline(mortal_home: Path) -> None:
    """A progress bar's carriage returns, a form feed or a Unicode line separator stay inside their line (the
    CLI shows them escaped); a CRLF ends a line as LF does; --tail counts the same lines."""
    write("r", "actor", 0, 1, "start\r\n 10%\r 50%\r100%\npage\x0cbreak\u2028same\nend\n")
    lines = ["start", " 10%\r 50%\r100%", "page\x0cbreak\u2028same", "end"]
    assert list(read_logs("r")) == lines
    assert list(read_logs("r", tail=3)) == lines[1:]


def test_tail_of_a_large_file_reads_backwards(mortal_home: Path) -> None:
    write("big", "actor", 0, 1, "".join(f"line {i}\n" for i in range(50_000)))
    assert list(read_logs("big", tail=3)) == ["line 49997", "line 49998", "line 49999"]


def test_follow_yields_new_lines_and_moves_to_a_relaunched_worker(mortal_home: Path) -> None:
    write("f", "actor", 0, 1, "start\n")
    thread, seen = follow_until_done("f")
    wait_until(lambda: seen == ["start"])
    write("f", "actor", 0, 1, "more\npart")
    write("f", "actor", 0, 1, "ial\n")
    write("f", "actor", 0, 2, "relaunched\ndone\n")  # may appear before the old file's last lines were read
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert seen == ["start", "more", "partial", "relaunched", "done"]


def test_follow_goes_on_through_a_rotation_without_losing_lines(mortal_home: Path) -> None:
    """The worker's log cap (state/log_rotation.py) copies the log to <log>.1 and empties it: a follower
    reads what it had not yet read from <log>.1, then the emptied log from its start."""
    from mortal.state import log_rotation

    path = write("r", "rollout", 0, 1, "one\n")
    thread, seen = follow_until_done("r")
    wait_until(lambda: seen == ["one"])
    with open(path, "ab") as log:
        log.write(b"two\nthree\n")
        log.flush()
        log_rotation.rotate(log.fileno(), path)
        log.write(b"four\ndone\n")
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert seen == ["one", "two", "three", "four", "done"]


def test_a_rotated_logs_older_lines_come_first_and_fill_its_tail(mortal_home: Path) -> None:
    from mortal.state import log_rotation

    path = write("t", "actor", 0, 1, "".join(f"old {i}\n" for i in range(5)))
    with open(path, "ab") as log:
        log_rotation.rotate(log.fileno(), path)
        log.write(b"new 0\nnew 1\n")
    assert list(read_logs("t")) == [*(f"old {i}" for i in range(5)), "new 0", "new 1"]
    assert list(read_logs("t", tail=4)) == ["old 3", "old 4", "new 0", "new 1"]
    assert list(read_logs("t", tail=2)) == ["new 0", "new 1"]


def test_a_ray_runs_log_in_storage_is_followed_across_a_rotation(tmp_path: Path) -> None:
    """StorageLogs (a Ray run's nodes upload their logs): the rotated file is uploaded after the emptied log,
    and a follower reads the rest from it, then the log from its start."""
    from mortal.controller.logs import StorageLogs

    logs = tmp_path / "bucket" / "s" / "logs"
    logs.mkdir(parents=True)
    (logs / "actor-0-1.log").write_text("one\n")
    follow = read_logs(
        "s", follow=True, poll_seconds=0.01, source=StorageLogs(f"file://{tmp_path / 'bucket'}")
    )
    assert next(follow) == "one"
    (logs / "actor-0-1.log").write_text("four\ndone\n")  # as ray_worker uploads them: the log, then <log>.1
    (logs / "actor-0-1.log.1").write_text("one\ntwo\nthree\n")
    assert [next(follow) for _ in range(4)] == ["two", "three", "four", "done"]


class Volume:
    """A modal.Volume as a client outside the containers sees it (listdir, read_file) over a folder; counts
    reads."""

    def __init__(self, root: Path) -> None:
        self.root, self.reads = root, 0

    def listdir(self, path: str, *, recursive: bool = False) -> list[SimpleNamespace]:
        folder = self.root / path
        if not folder.is_dir():
            raise FileNotFoundError(path)
        return [
            SimpleNamespace(path=str(p.relative_to(self.root)), size=p.stat().st_size)
            for p in folder.iterdir()
        ]

    def read_file(self, path: str) -> Iterator[bytes]:
        self.reads += 1
        data = (self.root / path).read_bytes()
        return iter([data[:3], data[3:]])


def test_logs_on_a_modal_volume_read_alike_and_only_when_they_grew(tmp_path: Path) -> None:
    """VolumeLogs: the same files, names, tail and follow as on this machine, through listdir/read_file."""
    volume = Volume(tmp_path)
    source = VolumeLogs(volume)
    logs = tmp_path / "runs" / "v" / "logs"
    assert list(read_logs("v", source=source)) == []
    logs.mkdir(parents=True)
    (logs / "actor-0-1.log").write_text("a1\na2\n")
    (logs / "rollout-0-2.log").write_text("r1\n")
    assert list(read_logs("v", tail=1, source=source)) == ["[actor-0] a2", "[rollout-0] r1"]
    stop = threading.Event()
    seen: list[str] = []

    def reader() -> None:
        for line in read_logs("v", role="actor", follow=True, poll_seconds=0.02, stop=stop, source=source):
            seen.append(line)
            if line == "done":
                stop.set()

    thread = threading.Thread(target=reader)
    thread.start()
    wait_until(lambda: seen == ["a1", "a2"])
    reads = volume.reads
    time.sleep(0.2)
    assert volume.reads == reads, "an unchanged file is not read again"
    with open(logs / "actor-0-1.log", "a") as fh:
        fh.write("a3\n")
    (logs / "actor-0-4.log").write_text("relaunched\ndone\n")
    thread.join(timeout=10)
    assert seen == ["a1", "a2", "a3", "relaunched", "done"]
