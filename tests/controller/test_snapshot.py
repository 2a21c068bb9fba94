"""The code snapshot: what a run takes from the applying folder, copied by content hash, bounded, and named to
its workers (controller/snapshot.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mortal.controller.snapshot import (
    CODE_ANNOTATION,
    Snapshot,
    SnapshotRefused,
    build,
    code_environ,
    importing_folders,
)
from mortal.specs import TrainingRun
from mortal.state import paths


def spec(**sections):
    doc = {
        "model": {"name": "simulated"},
        "dataset": {"name": "builtin:arith"},
        "rewards": [{"function": "pkg.scoring:correct"}],
        **sections,
    }
    return TrainingRun.model_validate({"metadata": {"name": "r"}, "spec": doc}).spec


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "scoring.py").write_text("def correct(completions, **kw):\n    return [1.0]\n")
    (root / "pkg" / "__pycache__" / "scoring.cpython-311.pyc").write_bytes(b"stale")
    (root / "pkg" / ".venv").mkdir()
    (root / "pkg" / ".venv" / "huge").write_bytes(b"x" * 1000)
    (root / "unrelated.py").write_text("print('not needed')\n")
    return root


def test_only_the_named_top_level_package_is_copied_without_caches_or_virtualenvs(folder):
    snapshot = build(spec(), [folder])
    try:
        files = [p for p in snapshot.folder.rglob("*") if p.is_file()]
        copied = sorted(str(p.relative_to(snapshot.folder)) for p in files)
        assert copied == ["pkg/__init__.py", "pkg/scoring.py"]
        assert [p.field for p in snapshot.parts] == ["spec.rewards[0].function"]
    finally:
        snapshot.close()


def test_the_digest_follows_the_content(folder):
    first, again = build(spec(), [folder]), build(spec(), [folder])
    (folder / "pkg" / "scoring.py").write_text("def correct(completions, **kw):\n    return [0.0]\n")
    edited = build(spec(), [folder])
    try:
        assert first.digest == again.digest != edited.digest
    finally:
        for s in (first, again, edited):
            s.close()


def test_a_run_needing_nothing_from_the_folder_has_no_snapshot(folder):
    snapshot = build(spec(rewards=[{"function": "mortal.workers.rewards.builtin:correct_answer"}]), [folder])
    assert snapshot.digest is None and snapshot.parts == []
    snapshot.close()


def test_a_relative_model_folder_is_linked_not_copied(folder):
    (folder / "models" / "tiny").mkdir(parents=True)
    (folder / "models" / "tiny" / "config.json").write_text("{}")
    snapshot = build(spec(model={"name": "models/tiny"}), [folder])
    try:
        link = snapshot.folder / "models" / "tiny"
        assert link.is_symlink() and link.resolve() == (folder / "models" / "tiny").resolve()
    finally:
        snapshot.close()


def test_a_relative_file_outside_the_folder_is_refused(folder):
    (folder.parent / "outside.jsonl").write_text("{}\n")
    with pytest.raises(SnapshotRefused) as refused:
        build(spec(dataset={"name": "../outside.jsonl"}), [folder])
    assert refused.value.field == "spec.dataset.name" and "outside the applying folder" in str(refused.value)


def test_a_symlink_out_of_the_folder_is_refused_not_copied(folder):
    secret = folder.parent / "secret.txt"
    secret.write_text("not the run's")
    (folder / "pkg" / "key.txt").symlink_to(secret)
    with pytest.raises(SnapshotRefused) as refused:
        build(spec(), [folder])
    assert refused.value.field == "spec.rewards[0].function" and "pkg/key.txt" in str(refused.value)
    (folder / "pkg" / "key.txt").unlink()
    (folder / "data.jsonl").symlink_to(secret)
    with pytest.raises(SnapshotRefused) as refused:
        build(spec(dataset={"name": "data.jsonl"}), [folder])
    assert refused.value.field == "spec.dataset.name"


def test_a_symlink_inside_the_folder_is_copied_as_its_content(folder):
    (folder / "pkg" / "alias.py").symlink_to(folder / "pkg" / "scoring.py")
    snapshot = build(spec(), [folder])
    try:
        copied = snapshot.folder / "pkg" / "alias.py"
        assert not copied.is_symlink() and copied.read_text() == (folder / "pkg" / "scoring.py").read_text()
    finally:
        snapshot.close()


def test_a_reference_without_a_module_name_copies_nothing(folder):
    """An environment reward's args.class is free text: '.x:Y' names no top-level module, not the folder."""
    snapshot = build(
        spec(
            rewards=[{"env": "environment", "args": {"class": ".pkg:Env"}}],
            rollout={"environment": "mortal.workers.simulated:Nothing"},
        ),
        [folder],
    )
    try:
        assert snapshot.parts == [] and snapshot.digest is None
    finally:
        snapshot.close()


def test_install_is_content_addressed_and_a_fork_keeps_its_parents(folder, mortal_home):
    snapshot = build(spec(), [folder])
    installed = snapshot.install("parent")
    snapshot.close()
    assert installed == paths.code_dir("parent", snapshot.digest)
    assert (installed / "pkg" / "scoring.py").is_file()
    assert code_environ({CODE_ANNOTATION: snapshot.digest}) == {paths.CODE_SNAPSHOT_ENV: snapshot.digest}
    kept = Snapshot.kept("parent", snapshot.digest)  # what a fork's admission checks and installs
    assert kept is not None and kept.digest == snapshot.digest
    kept.install("child")
    kept.close()
    assert (paths.code_dir("child", snapshot.digest) / "pkg" / "scoring.py").is_file()
    assert installed.is_dir()  # the parent keeps its own


def test_the_folders_a_process_imported_user_code_from_count_installed_packages_do_not(folder, monkeypatch):
    monkeypatch.syspath_prepend(str(folder))
    import pkg.scoring  # noqa: F401 - imported as a MortalTrainer script would

    try:
        found = importing_folders(
            spec(rewards=[{"function": "pkg.scoring:correct"}, {"function": "pytest:fixture"}]),
            Path("/nowhere"),
        )
        assert found == [Path("/nowhere"), folder.resolve()]
    finally:
        for name in ("pkg", "pkg.scoring"):
            sys.modules.pop(name, None)
