"""Directories that appear whole or not at all: write into a hidden temporary sibling, fsync, rename.

Used by mortal.workers.sync (published weight versions) and mortal.workers.actor.checkpoint
(checkpoints). A reader listing the parent folder sees either nothing or the complete directory:
`os.rename` of a directory is atomic on one filesystem, and every file and the directory itself are
fsynced first, so a crash (kill -9, power loss) never exposes a partial one. Temporary directories
start with `.tmp-`; `remove_stale_tmp` clears the leftovers of a writer that died.

On Modal the run folder is a modal.Volume, whose changes other containers see only once committed
(and, in a container already running, after a reload). `volume_sync` commits after every rename
(before the caller records the directory in the store, so a reader that finds the row finds the
files); `volume_refresh` reloads when a reader misses a path another container published. Both are
no-ops unless MORTAL_MODAL_VOLUME names the volume (the Modal app sets it).
It must not know what is inside the directories.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"
VOLUME_ENV = "MORTAL_MODAL_VOLUME"
log = logging.getLogger("mortal.worker")


def _volume() -> Any:
    name = os.environ.get(VOLUME_ENV)
    if not name:
        return None
    import modal  # only in a Modal container, where the app installed it

    return modal.Volume.from_name(name)


def volume_sync() -> None:
    """Commit the shared volume (Modal), so other containers can see what was just written."""
    volume = _volume()
    if volume is not None:
        volume.commit()


def volume_refresh() -> None:
    """Reload the shared volume (Modal) to see what other containers committed; best effort (a
    reload fails while this container has files of the volume open)."""
    volume = _volume()
    if volume is None:
        return
    try:
        volume.reload()
    except Exception as exc:  # the caller reads on and reports a missing file as it would anyway
        log.warning("could not reload volume %s: %s", os.environ.get(VOLUME_ENV), exc)


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
def atomic_dir(final: Path, durable: bool = True) -> Iterator[Path]:
    """Yield an empty temporary directory next to `final`; on success it becomes `final` atomically.

    `durable=False` skips the fsyncs (the rename stays atomic): for what means nothing after a crash
    anyway, such as the manifest of weights held in a process's GPU memory (ipc, nccl).

    An exception inside the block removes the temporary directory and leaves `final` untouched. A
    `final` already present (left by a writer that crashed after its rename but before recording
    it) is replaced: the caller decides, by the store, what is current.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if durable:
            fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        if durable:
            _fsync_dir(final.parent)
            volume_sync()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sweep(folder: Path, recorded: set[str]) -> int:
    """Remove the directories under `folder` that no store row points to: retired versions, and what
    a crashed or fenced writer of an older incarnation left. Call only from the live incarnation,
    after its own write was recorded; temporary directories are remove_stale_tmp's."""
    if not folder.is_dir():
        return 0
    stray = [p for p in folder.iterdir() if not p.name.startswith(TMP_PREFIX) and str(p) not in recorded]
    for path in stray:
        shutil.rmtree(path, ignore_errors=True)
    return len(stray)


def remove_stale_tmp(parent: Path) -> int:
    """Delete leftover temporary directories under `parent` (call only where one writer lives)."""
    if not parent.is_dir():
        return 0
    stale = [p for p in parent.iterdir() if p.name.startswith(TMP_PREFIX)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)
