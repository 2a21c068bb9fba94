"""mortal.state.containment: a stored path is used only when, resolved, it lies strictly inside the folder (or
below the URL prefix) that owns it; `..`, an absolute path elsewhere, the root itself and a symlink that
leads out are refused with PathOutside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mortal.state import paths
from mortal.state.containment import (
    PathOutside,
    inside,
    owned_checkpoint,
    posix_inside,
    tree_inside,
    url_inside,
)


def test_a_path_below_the_root_comes_back_resolved(tmp_path: Path) -> None:
    (tmp_path / "run" / "step-1").mkdir(parents=True)
    assert inside(tmp_path / "run", tmp_path / "run" / "step-1") == (tmp_path / "run" / "step-1").resolve()
    assert inside(tmp_path / "run", "step-1") == (tmp_path / "run" / "step-1").resolve()
    assert inside(tmp_path / "run", tmp_path / "run" / "not-yet") == (tmp_path / "run" / "not-yet").resolve()


@pytest.mark.parametrize("candidate", ["..", ".", "../other", "step-1/../..", "/etc", "/", ""])
def test_a_path_that_leaves_the_root_or_is_the_root_is_refused(tmp_path: Path, candidate: str) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(PathOutside, match="refused"):
        inside(tmp_path / "run", candidate)


def test_a_symlink_inside_the_root_that_points_out_is_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "run", tmp_path / "victim"
    (root / "step-1").mkdir(parents=True)
    outside.mkdir()
    (root / "step-2").symlink_to(outside)
    with pytest.raises(PathOutside, match="resolves to"):
        inside(root, root / "step-2")
    (root / "step-1" / "model.safetensors").symlink_to(outside / "secret")
    assert inside(root, root / "step-1") == (root / "step-1").resolve()  # the folder itself is inside...
    with pytest.raises(PathOutside, match="model.safetensors"):
        tree_inside(root, root / "step-1")  # ...but a copy of it would follow the link out


def test_a_root_reached_through_a_symlink_still_holds_its_own(tmp_path: Path) -> None:
    (tmp_path / "real" / "step-1").mkdir(parents=True)
    os.symlink(tmp_path / "real", tmp_path / "home")
    assert inside(tmp_path / "home", tmp_path / "home" / "step-1") == (tmp_path / "real" / "step-1").resolve()
    assert inside(tmp_path / "home", tmp_path / "real" / "step-1") == (tmp_path / "real" / "step-1").resolve()


@pytest.mark.parametrize(
    ("candidate", "ok"),
    [
        ("s3://bucket/prefix/r/step-1", True),
        ("S3://bucket//prefix/r/./step-1", True),
        ("s3://bucket/prefix/r", False),
        ("s3://bucket/prefix/r/../other/step-1", False),
        ("s3://bucket/prefix/rx/step-1", False),
        ("gs://bucket/prefix/r/step-1", False),
        ("/bucket/prefix/r/step-1", False),
    ],
)
def test_a_remote_url_must_be_below_the_runs_prefix_once_normalized(candidate: str, ok: bool) -> None:
    if ok:
        assert url_inside("s3://bucket/prefix/r", candidate) == candidate
    else:
        with pytest.raises(PathOutside):
            url_inside("s3://bucket/prefix/r", candidate)


def test_a_path_on_storage_this_machine_cannot_resolve_is_checked_as_text() -> None:
    assert posix_inside("runs", "runs/a") == "runs/a"
    assert (
        posix_inside("/mortal/runs/r", "/mortal/runs/r/checkpoints/step-1")
        == "/mortal/runs/r/checkpoints/step-1"
    )
    for candidate in ("runs", "runs/..", "runs/../../etc", "elsewhere/runs/a"):
        with pytest.raises(PathOutside):
            posix_inside("runs", candidate)


def test_a_checkpoint_row_is_the_runs_own_folder_or_below_its_storage_prefix(
    mortal_home: Path, tmp_path: Path
) -> None:
    own = paths.checkpoints_dir("r") / "step-1"
    own.mkdir(parents=True)
    assert owned_checkpoint("r", str(own)) == str(own.resolve())
    with pytest.raises(PathOutside):
        owned_checkpoint("r", str(paths.checkpoints_dir("other") / "step-1"))
    with pytest.raises(PathOutside, match="spec.checkpoint.uri is not set"):
        owned_checkpoint("r", "s3://bucket/r/step-1")
    assert owned_checkpoint("r", "s3://bucket/r/step-1", "s3://bucket") == "s3://bucket/r/step-1"
    with pytest.raises(PathOutside):
        owned_checkpoint("r", "s3://bucket/other/step-1", "s3://bucket")
    mounted = tmp_path / "bucket" / "r" / "step-1"
    mounted.mkdir(parents=True)
    assert owned_checkpoint("r", f"file://{mounted}", f"file://{tmp_path / 'bucket'}") == f"file://{mounted}"
    assert owned_checkpoint("r", f"file://{own}") == f"file://{own}"
    with pytest.raises(PathOutside):
        owned_checkpoint(
            "r", f"file://{tmp_path / 'bucket' / 'other' / 'step-1'}", f"file://{tmp_path / 'bucket'}"
        )
