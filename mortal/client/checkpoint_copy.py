"""A run's checkpoint copied out to a local folder (`mortalctl cp`), from wherever it lies.

The newest complete checkpoint unless a step is named (the store lists only complete ones), read from
this machine, from spec.checkpoint.uri's storage (fsspec) or from the run's Modal volume, its path
checked first to be the run's own (mortal.state.containment).
What it must not do: leave a half-copied folder where the user looks. Files land in a temporary
folder beside DIR, renamed to DIR when all of them are there; DIR must not exist yet, or be empty.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.client.errors import ClientError
from mortal.controller.backends.modal import DATA_MOUNT as MODAL_DATA_MOUNT
from mortal.controller.backends.modal import data_volume
from mortal.state.containment import PathOutside, owned_checkpoint, posix_inside, report_refused, tree_inside
from mortal.workers.actor.storage import StorageError, is_url, local_path, open_filesystem

if TYPE_CHECKING:
    from mortal.state.store import Store
    from mortal.state.tables import CheckpointRow


def choose_checkpoint(checkpoints: list[CheckpointRow], run: str, step: int | None) -> CheckpointRow:
    if not checkpoints:
        raise ClientError(f"run {run!r} has no complete checkpoint yet")
    if step is None:
        return max(checkpoints, key=lambda c: c.step)
    for checkpoint in checkpoints:
        if checkpoint.step == step:
            return checkpoint
    kept = ", ".join(f"step-{c.step}" for c in sorted(checkpoints, key=lambda c: c.step))
    raise ClientError(f"run {run!r} has no complete checkpoint of step {step} (it keeps {kept})")


def check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ClientError(f"{dest}: exists and is not an empty folder; name a new one")
    if not dest.parent.is_dir():
        raise ClientError(f"{dest.parent}: no such folder")


def owned(store: Store, run: str, checkpoint: CheckpointRow, spec: dict[str, Any]) -> str:
    """The checkpoint's path once checked to be the run's own (mortal.state.containment): in its checkpoints
    folder (on Modal's volume: runs/<run>/checkpoints/ there) or under spec.checkpoint.uri's <run>/, with no
    symlink below it that leads out. A row pointing elsewhere: a Warning event, and ClientError."""
    uri = spec.get("checkpoint", {}).get("uri")
    try:
        if spec.get("backend") == "modal" and not is_url(checkpoint.path):
            return posix_inside(f"{MODAL_DATA_MOUNT}/runs/{run}/checkpoints", checkpoint.path)
        path = owned_checkpoint(run, checkpoint.path, uri)
        folder = local_path(path)
        if folder is not None:
            real = Path(os.path.realpath(folder))
            tree_inside(real.parent, real)  # copytree follows the links below it
        return path
    except PathOutside as exc:
        report_refused(store, run, f"copying checkpoint step-{checkpoint.step}", exc)
        raise ClientError(f"checkpoint step-{checkpoint.step} of run {run!r}: {exc}") from None


def copy_local(source: Path, into: Path) -> None:
    if not source.is_dir():
        raise ClientError(
            f"the checkpoint folder {source} is gone from this machine (pruned, or the run was purged)"
        )
    shutil.copytree(source, into, dirs_exist_ok=True)


def copy_from_storage(url: str, into: Path) -> None:
    """Every file of the checkpoint at `url` (spec.checkpoint.uri's storage), downloaded with fsspec."""
    try:
        fs, root = open_filesystem(url)
        files = fs.find(root)
        for remote in files:
            target = into / os.path.relpath(remote, root)
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(target))
    except (StorageError, OSError) as exc:
        raise ClientError(f"cannot download the checkpoint at {url}: {exc}") from exc
    if not files:
        raise ClientError(f"the checkpoint at {url} is empty or gone (pruned, or removed from the storage)")


def copy_from_modal(source: str, into: Path, volume: Any) -> int:
    """Every file under `source` (a path inside the workers' mount) from `volume`; the bytes copied."""
    from modal.volume import FileEntryType

    prefix = os.path.relpath(source, MODAL_DATA_MOUNT)
    if prefix.startswith(".."):
        raise ClientError(
            f"the checkpoint path {source} is not on the Modal data volume ({MODAL_DATA_MOUNT})"
        )
    copied = 0
    for entry in volume.listdir(prefix, recursive=True):
        if entry.type != FileEntryType.FILE:
            continue
        target = into / os.path.relpath(entry.path, prefix)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as handle:
            for chunk in volume.read_file(entry.path):
                handle.write(chunk)
                copied += len(chunk)
    if not copied and not any(into.iterdir()):
        raise ClientError(f"the checkpoint {prefix} is empty or gone on the Modal volume")
    return copied


def modal_data_volume() -> Any:
    return data_volume()


@dataclass(frozen=True)
class CopiedCheckpoint:
    run: str
    step: int
    weight_version: int
    dest: Path


def copy_checkpoint(store: Store, run: str, step: int | None, dest: Path) -> CopiedCheckpoint:
    """Copy `run`'s checkpoint of `step` (the newest when None) into `dest`, a new or empty folder, from
    wherever it lies: this machine, spec.checkpoint.uri's storage, or the run's Modal volume."""
    row = store.get_run(run)  # NotFound: "error: run ... not found"
    checkpoint = choose_checkpoint(store.list_checkpoints(run), run, step)
    dest = dest.expanduser().resolve()
    check_destination(dest)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        if is_url(checkpoint.path):
            copy_from_storage(owned(store, run, checkpoint, row.spec), staging)
        elif row.spec.get("backend") == "modal":
            copy_from_modal(owned(store, run, checkpoint, row.spec), staging, modal_data_volume())
        else:
            copy_local(Path(owned(store, run, checkpoint, row.spec)), staging)
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return CopiedCheckpoint(run, checkpoint.step, checkpoint.weight_version, dest)
