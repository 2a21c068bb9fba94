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

import functools
import hashlib
import logging
import os
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
RETRY_SECONDS = 5.0  # how soon a sync that met a passing error (a run still being deleted) runs again
ALWAYS_IGNORED = watchfiles.DefaultFilter()  # editors' swap and backup files, as watchfiles leaves out


@dataclass
class SyncResult:
    applied: dict[str, str] = field(default_factory=dict)  # run -> created | configured | unchanged
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # runs no readable file gives, kept while errors stand
    retry: bool = False  # an error passes on its own (a run still being deleted, the store down): sync again


def source_id(folder: Path) -> str:
    return hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]


def read_folder(folder: Path) -> tuple[list[TrainingRun], list[str]]:
    """Every run in the folder's YAML files (sorted by file name), and the errors of unreadable files and of
    a name that two documents give (naming their files)."""
    runs: list[TrainingRun] = []
    errors: list[str] = []
    files: dict[str, list[str]] = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file()):
        try:
            found = load_file(path)
        except (SpecError, OSError) as exc:
            errors.append(str(exc))
            continue
        runs.extend(found)
        for run in found:
            files.setdefault(run.name, []).append(path.name)
    errors.extend(
        f"run {name!r} is defined more than once in {folder}: in {', '.join(where)}"
        for name, where in sorted(files.items())
        if len(where) > 1
    )
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
            result.retry = True
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
    present = {r.name for r in runs}
    listed = store.list_runs(labels=label, include_deleted=False)
    gone = [row.name for row in listed if row.name not in present]
    if result.errors:  # a file that did not read, or a run refused: the folder is mid-edit, delete nothing
        result.kept = gone
        return result
    for name in gone:
        store.mark_deleted(name)
        result.deleted.append(name)
    return result


def watch_folder(
    store: Store, folder: Path, stop: threading.Event, on_sync: Callable[[SyncResult], None]
) -> None:
    """Sync now, after every change in the folder or in a file a link in it points to, and every
    RETRY_SECONDS while the last sync met an error that passes on its own, until `stop`."""
    result = _sync_logged(store, folder, SyncResult())
    on_sync(result)
    while not stop.is_set():
        targets = _link_targets(folder)
        for changes in watchfiles.watch(
            folder,
            *sorted({t.parent for t in targets}),
            watch_filter=functools.partial(_relevant, folder.resolve(), targets),
            stop_event=stop,
            step=100,
            debounce=800,
            rust_timeout=int(RETRY_SECONDS * 1000),
            yield_on_timeout=True,
            recursive=False,
            raise_interrupt=False,
        ):
            if not changes and not result.retry:
                continue
            result = _sync_logged(store, folder, result)
            on_sync(result)
            if _link_targets(folder) != targets:
                break  # a link came, went or points elsewhere: watch its target's folder instead


def _relevant(folder: Path, targets: set[Path], change: watchfiles.Change, path: str) -> bool:
    """A change of a file in the folder, or of a file one of its links points to (not of the other files
    beside that one), editors' swap files left out."""
    real = Path(os.path.realpath(path))
    return ALWAYS_IGNORED(change, path) and (real.parent == folder or real in targets)


def _link_targets(folder: Path) -> set[Path]:
    """The files the folder's YAML links point to (an edit there changes the folder's desired state)."""
    try:
        links = [p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_symlink()]
    except OSError:
        return set()
    targets = {Path(os.path.realpath(link)) for link in links}
    return {target for target in targets if target.parent.is_dir()}


def _sync_logged(store: Store, folder: Path, last: SyncResult) -> SyncResult:
    """sync_folder, its outcome logged; an error the last sync logged is not logged again (a retry every
    few seconds would repeat it)."""
    try:
        result = sync_folder(store, folder)
    except Exception as exc:  # the store is down for a moment: retried, as after a change or a restart
        result = SyncResult(errors=[f"sync of {folder} failed: {exc}"], retry=True)
    for name, outcome in result.applied.items():
        if outcome != "unchanged":
            log.info("trainingrun/%s %s (from %s)", name, outcome, folder)
    for name in result.deleted:
        log.info("trainingrun/%s deleted (its file left %s)", name, folder)
    for error in result.errors:
        if error not in last.errors:
            log.error("%s", error)
    if result.kept and result.kept != last.kept:
        log.warning(
            "not deleting %s (no file of %s that reads gives them) while the folder has the errors above",
            ", ".join(f"trainingrun/{name}" for name in result.kept),
            folder,
        )
    return result
