"""GitOps: `mortalctl controller --watch DIR` makes a folder of TrainingRun files the desired state.

Who calls it: the manager, in a thread, when started with a watch folder. Every change in the folder
(watchfiles) applies every spec in it, like `mortalctl apply -f DIR`, and deletes the runs that came
from this folder and whose file went away. Runs are marked with the label `mortal.dev/source`
(a hash of the folder's path, a valid label value) and the annotation `mortal.dev/source-dir` (the
path, for people). A folder with an unreadable file deletes nothing that round (a half-saved file
must not delete a run). Each run is admitted first (mortal.controller.admission), with the
controller's working folder as the applying folder: one that fails is logged and not applied.
What it must not do: touch workers; it writes desired state only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import watchfiles

from mortal.controller.admission import AdmissionRefused, admit_runs
from mortal.controller.snapshot import being_deleted
from mortal.specs import SpecError, TrainingRun, load_file
from mortal.state.apply_document import apply_document
from mortal.state.errors import Conflict, InvalidValue
from mortal.state.store import Store

log = logging.getLogger("mortal.controller")
SOURCE_LABEL = "mortal.dev/source"
SOURCE_ANNOTATION = "mortal.dev/source-dir"
SUFFIXES = (".yaml", ".yml")


@dataclass
class SyncResult:
    applied: dict[str, str] = field(default_factory=dict)  # run -> created | configured | unchanged
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def source_id(folder: Path) -> str:
    return hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]


def read_folder(folder: Path) -> tuple[list[TrainingRun], list[str]]:
    """Every run in the folder's YAML files (sorted by file name), and the errors of unreadable files."""
    runs: list[TrainingRun] = []
    errors: list[str] = []
    for path in sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file()):
        try:
            runs.extend(load_file(path))
        except (SpecError, OSError) as exc:
            errors.append(str(exc))
    names = [r.name for r in runs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    errors.extend(f"run {n!r} is defined more than once in {folder}" for n in repeated)
    return runs, errors


def sync_folder(store: Store, folder: Path) -> SyncResult:
    """Apply the folder's runs (one refused does not stop the others); delete this folder's runs whose files
    are gone (only when every file read and every run applied)."""
    result = SyncResult()
    runs, result.errors = read_folder(folder)
    label = {SOURCE_LABEL: source_id(folder)}
    for run in runs:
        labels = {**run.metadata.labels, **label}
        # The purge sets the old run's folder aside, with a snapshot installed now.
        if being_deleted(store, run.name):
            result.errors.append(f"trainingrun/{run.name} is being deleted: applied again once it is gone")
            continue
        try:
            with admit_runs([(run, str(folder))], [Path.cwd()]) as admitted:
                admission = admitted[0]  # checked, snapshot installed, its digest in the run's annotations
        except AdmissionRefused as exc:  # not applied; the next change of the folder tries again
            result.errors.append(str(exc))
            continue
        annotations = {**run.metadata.annotations, SOURCE_ANNOTATION: str(folder.resolve())}
        try:
            _, outcome = apply_document(store, run, labels=labels, annotations=annotations)
            result.applied[run.name] = str(outcome)
            continue
        except (Conflict, InvalidValue) as exc:  # refused (a finished run), or being deleted: not applied
            result.errors.append(str(exc))
        except SpecError as exc:  # the three-way merge does not fit; the folder's other runs go on
            result.errors.append(
                f"trainingrun/{run.name} in {folder}, with the fields kept from its live spec: {exc}"
            )
        admission.withdraw(store)  # a run never created leaves no code folder under its name
    if result.errors:  # a file that did not read, or a run refused: the folder is mid-edit, delete nothing
        return result
    present = {r.name for r in runs}
    for row in store.list_runs(labels=label, include_deleted=False):
        if row.name not in present:
            store.mark_deleted(row.name)
            result.deleted.append(row.name)
    return result


def watch_folder(
    store: Store, folder: Path, stop: threading.Event, on_sync: Callable[[SyncResult], None]
) -> None:
    """Sync now and after every change in the folder, until `stop`."""
    on_sync(_sync_logged(store, folder))
    for _changes in watchfiles.watch(
        folder, stop_event=stop, step=100, debounce=800, recursive=False, raise_interrupt=False
    ):
        on_sync(_sync_logged(store, folder))


def _sync_logged(store: Store, folder: Path) -> SyncResult:
    try:
        result = sync_folder(store, folder)
    except Exception as exc:  # the store is down for a moment: the next change or restart syncs again
        log.error("sync of %s failed: %s", folder, exc)
        return SyncResult(errors=[str(exc)])
    for name, outcome in result.applied.items():
        if outcome != "unchanged":
            log.info("trainingrun/%s %s (from %s)", name, outcome, folder)
    for name in result.deleted:
        log.info("trainingrun/%s deleted (its file left %s)", name, folder)
    for error in result.errors:
        log.error("%s", error)
    return result
