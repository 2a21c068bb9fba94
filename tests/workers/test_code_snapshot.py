"""A worker imports from, and runs in, its run's code snapshot (mortal.workers.main.use_code_snapshot)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mortal.state import WorkerRef, paths
from mortal.workers.errors import FatalWorkerError
from mortal.workers.main import use_code_snapshot

WORKER = WorkerRef("r", "rollout", 0, 1)
DIGEST = "ab" * 32


def test_no_snapshot_leaves_the_worker_as_it_was(mortal_home):
    assert use_code_snapshot({}, WORKER) is None


def test_the_snapshot_comes_first_on_the_path_and_is_the_working_folder(mortal_home, monkeypatch, tmp_path):
    folder = paths.code_dir("r", DIGEST)
    folder.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = {paths.CODE_SNAPSHOT_ENV: DIGEST, "MORTAL_HOME": str(mortal_home)}
    assert use_code_snapshot(env, WORKER) == str(folder)
    assert sys.path[0] == str(folder) and Path.cwd() == folder
    assert os.environ["PYTHONPATH"] == f"{folder}{os.pathsep}/elsewhere"  # processes it starts see it too


@pytest.mark.parametrize(
    ("digest", "says"), [(DIGEST, "is not on this machine"), ("../../etc", "not a sha256")]
)
def test_a_missing_or_malformed_snapshot_fails_the_worker_naming_it(mortal_home, digest, says):
    with pytest.raises(FatalWorkerError) as failed:
        use_code_snapshot({paths.CODE_SNAPSHOT_ENV: digest, "MORTAL_HOME": str(mortal_home)}, WORKER)
    assert failed.value.reason == "CodeSnapshotMissing" and says in failed.value.message
