"""mortal.workers.doorbell: a ring of the name a process listens for ends its wait at once; nothing else does,
and without inotify a wait is the poll interval it replaced."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from mortal.workers.doorbell import DOORBELLS_ENV, FOLDER, RESULTS, TASKS, Doorbell


@pytest.fixture
def listener(tmp_path: Path):
    bell = Doorbell(tmp_path, listens_for=RESULTS)
    assert bell.hears
    yield bell
    bell.close()


def _timed_wait(bell: Doorbell, timeout: float) -> tuple[bool, float]:
    started = time.monotonic()
    rang = bell.wait(timeout)
    return rang, time.monotonic() - started


def test_a_ring_from_another_thread_ends_the_wait_at_once(listener: Doorbell, tmp_path: Path) -> None:
    ringer = threading.Timer(0.2, Doorbell(tmp_path).ring, args=(RESULTS,))
    ringer.start()
    rang, waited = _timed_wait(listener, timeout=10)
    ringer.join()
    assert rang and 0.15 < waited < 5


def test_a_ring_between_a_look_and_the_wait_is_not_missed(listener: Doorbell, tmp_path: Path) -> None:
    Doorbell(tmp_path).ring(RESULTS)  # before the wait: the watch, made with the listener, kept it
    rang, waited = _timed_wait(listener, timeout=10)
    assert rang and waited < 5


def test_a_ring_of_another_name_does_not_end_the_wait(listener: Doorbell, tmp_path: Path) -> None:
    Doorbell(tmp_path).ring(TASKS)
    rang, waited = _timed_wait(listener, timeout=0.3)
    assert not rang and waited >= 0.29


def test_a_ring_is_heard_once(listener: Doorbell, tmp_path: Path) -> None:
    Doorbell(tmp_path).ring(RESULTS)
    assert listener.wait(5)
    assert not listener.wait(0.2)


def test_every_listener_of_a_name_hears_one_ring(tmp_path: Path) -> None:
    rollouts = [Doorbell(tmp_path, listens_for=TASKS) for _ in range(3)]
    Doorbell(tmp_path).ring(TASKS)
    assert all(bell.wait(5) for bell in rollouts)
    for bell in rollouts:
        bell.close()


def test_ringing_before_any_listener_makes_the_folder(tmp_path: Path) -> None:
    Doorbell(tmp_path / "run").ring(TASKS)
    assert (tmp_path / "run" / FOLDER / TASKS).exists()


def test_a_ring_that_cannot_be_written_is_dropped_quietly(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    Doorbell(tmp_path / "file").ring(TASKS)  # the poll still sees what the ring would have announced


def test_without_inotify_a_wait_is_the_poll_interval(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "inotify_simple", None)  # an import of it fails, as on a Mac
    bell = Doorbell(tmp_path, listens_for=RESULTS)
    assert not bell.hears
    bell.ring(RESULTS)
    rang, waited = _timed_wait(bell, timeout=0.2)
    assert not rang and waited >= 0.19


def test_only_workers_whose_backend_says_so_ring_and_listen(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(DOORBELLS_ENV, raising=False)
    silent = Doorbell.for_worker(tmp_path, RESULTS)
    silent.ring(RESULTS)
    assert (
        not silent.hears and not (tmp_path / FOLDER).exists()
    )  # nothing written to a run's (network) folder
    monkeypatch.setenv(DOORBELLS_ENV, "1")
    bell = Doorbell.for_worker(tmp_path, RESULTS)
    assert bell.hears
    bell.close()


@pytest.mark.parametrize("hears", [True, False])
def test_a_stop_ends_a_wait_with_or_without_inotify(tmp_path: Path, monkeypatch, hears: bool) -> None:
    """The rollout's idle wait: a stop set before it returns at once; without inotify, one
    set during it too."""
    if not hears:
        monkeypatch.setitem(sys.modules, "inotify_simple", None)
    bell = Doorbell(tmp_path, listens_for=TASKS)
    assert bell.hears == hears
    stopping = threading.Event()
    stopping.set()
    started = time.monotonic()
    assert not bell.wait(5.0, stopping=stopping)
    assert time.monotonic() - started < 1.0
    if not hears:
        stopping.clear()
        threading.Timer(0.1, stopping.set).start()
        started = time.monotonic()
        assert not bell.wait(5.0, stopping=stopping)
        assert time.monotonic() - started < 2.0
    bell.close()
