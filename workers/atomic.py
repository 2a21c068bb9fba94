"""Directories that appear whole or not at all: write into a hidden temporary sibling, fsync, rename.

Used by mortal.workers.weights (published weight versions) and mortal.workers.checkpoint
(checkpoints). A reader listing the parent folder sees either nothing or the complete directory:
`os.rename` of a directory is atomic on one filesystem, and every file and the directory itself are
fsynced first, so a crash (kill -9, power loss) never exposes a partial one. Temporary directories
start with `.tmp-`; `remove_stale_tmp` clears the leftovers of a writer that died.
It must not know what is inside the directories.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory (deepest first), so the rename publishes data."""
    dirs = []
    for folder, _, files in os.walk(root):
        dirs.append(folder)
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in reversed(dirs):
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to `final`; on success it becomes `final` atomically.

    An exception inside the block removes the temporary directory and leaves `final` untouched. A
    `final` already present (left by a writer that crashed after its rename but before recording
    it) is replaced: the caller decides, by the store, what is current.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_stale_tmp(parent: Path) -> int:
    """Delete leftover temporary directories under `parent` (call only where one writer lives)."""
    if not parent.is_dir():
        return 0
    stale = [p for p in parent.iterdir() if p.name.startswith(TMP_PREFIX)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)
