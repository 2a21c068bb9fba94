"""Fork: a new run started from another run's checkpoint (`mortalctl fork`, MortalTrainer.train).

The checkpoint of step N is copied into NEW's folder (hard-linked where the filesystem allows: checkpoint
files are never written in place), then NEW is created with it recorded as NEW's own in one store
transaction (`Store.fork_run`). The actor resumes from it as after a preemption: NEW's first step is N+1,
with the parent's weights, optimizer, scheduler, RNG and data position. Also the lookups that rollback
and cp share: the checkpoint a source names, and its folder, checked to be the run's own.
What it must not do: import torch, or start and stop workers itself (the controller does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.client.errors import ClientError
from mortal.client.local_controller import wake_controller

if TYPE_CHECKING:
    from mortal.controller.admission import Admission
    from mortal.specs import TrainingRun
    from mortal.state import CheckpointRow, RunRow, Store

SOURCE = re.compile(r"^(?P<run>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(:step-(?P<step>\d+))?$")


class ForkError(ClientError):
    """A fork or rollback refused; the message names the run and step."""


class CheckpointNotFound(ForkError):
    """The run has no recorded complete checkpoint of that step (or none at all)."""


class CheckpointIncomplete(ForkError):
    """The checkpoint is recorded but some of its files are gone from disk."""


class CheckpointInStorage(ForkError):
    """The checkpoint is in remote storage (spec.checkpoint.uri: s3://, gs://, ...), not on this machine."""


class RunExists(ForkError):
    """NEW is the name of an existing run."""


class CannotCarryOver(ForkError):
    """The overrides change something the checkpoint cannot carry over (specs/fork.py lists what)."""


class CheckpointOutside(ForkError):
    """The checkpoint row points outside the run's own checkpoints (mortal.state.containment): refused."""


def parse_source(source: str) -> tuple[str, int | None]:
    """RUN or RUN:step-N -> (run, step or None)."""
    match = SOURCE.match(source.strip())
    if match is None:
        raise ClientError(f"{source!r}: expected RUN or RUN:step-N (e.g. quickstart:step-20)")
    step = match.group("step")
    return match.group("run"), int(step) if step is not None else None


def complete_checkpoint(store: Store, run: str, step: int | None) -> CheckpointRow:
    """The run's recorded checkpoint of `step` (the newest with None), its files checked on disk."""
    from mortal.workers.actor.checkpoint import is_complete
    from mortal.workers.main import WORKLOAD_ANNOTATION

    owner = store.get_run(run)
    other_workload = bool(owner.annotations.get(WORKLOAD_ANNOTATION))  # e.g. simulated: own files
    uri = owner.spec.get("checkpoint", {}).get("uri")

    def whole(row: CheckpointRow) -> bool:
        folder = owned_folder(store, run, row, uri)
        return folder.is_dir() if other_workload else is_complete(folder)

    rows = store.list_checkpoints(run)
    if step is None:
        complete = [row for row in rows if whole(row)]
        if not complete:
            raise CheckpointNotFound(f"trainingrun {run!r} has no complete checkpoint yet")
        return complete[-1]
    row = next((r for r in rows if r.step == step), None)
    if row is None:
        kept = ", ".join(f"step-{r.step}" for r in rows) or "none"
        raise CheckpointNotFound(
            f"trainingrun {run!r} has no complete checkpoint of step {step} (it keeps {kept})"
        )
    if not whole(row):
        raise CheckpointIncomplete(
            f"checkpoint step-{step} of trainingrun {run!r} at {row.path} is incomplete "
            "on disk (files missing)"
        )
    return row


# Backends whose checkpoints are files under this machine's MORTAL_HOME: local, and ray, whose nodes share
# MORTAL_HOME with the controller (docs/ray.md). Modal's lie on its volume, out of this machine's reach.
FILES_HERE = ("local", "ray")


def refuse_files_elsewhere(run: str, backend: str, doing: str, error: type[ForkError] = ForkError) -> None:
    if backend not in FILES_HERE:
        raise error(
            f"trainingrun {run!r} runs on backend {backend!r}, whose checkpoints are not on this machine; "
            f"{doing} checkpoint files under MORTAL_HOME and is built for backends "
            f"{' and '.join(FILES_HERE)}"
        )


def checkpoint_folder(run: str, row: CheckpointRow) -> Path:
    """The folder on this machine of a recorded checkpoint: its path, or a file:// URL's (spec.checkpoint.uri
    on a mounted filesystem). CheckpointInStorage for remote storage, which fork reads nothing from."""
    from mortal.workers.actor.storage import local_path

    folder = local_path(row.path)
    if folder is None:
        raise CheckpointInStorage(
            f"checkpoint step-{row.step} of trainingrun {run!r} is in the storage of "
            f"spec.checkpoint.uri ({row.path}); "
            "fork reads checkpoints on this machine only: "
            f"download it with `mortalctl cp {run}:step-{row.step} DIR`"
        )
    return folder


def owned_folder(store: Store, run: str, row: CheckpointRow, uri: str | None, doing: str = "reading") -> Path:
    """checkpoint_folder, checked to lie inside what the run owns, symlinks inside it included
    (mortal.state.containment); a row pointing elsewhere gets a Warning event and CheckpointOutside."""
    from mortal.state.containment import PathOutside, owned_checkpoint, report_refused, tree_inside
    from mortal.workers.actor.storage import local_path

    folder = checkpoint_folder(run, row)
    try:
        # the folder checked (a relative row: the run's)
        owned = local_path(owned_checkpoint(run, row.path, uri))
        real = Path(os.path.realpath(owned or folder))
        return tree_inside(real.parent, real)  # what a copy or load would follow below it
    except PathOutside as exc:
        report_refused(store, run, f"{doing} checkpoint step-{row.step}", exc)
        raise CheckpointOutside(f"checkpoint step-{row.step} of trainingrun {run!r}: {exc}") from None


# -- fork --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Forked:
    run: TrainingRun
    parent: str
    step: int
    path: Path
    linked: bool  # hard links (no bytes copied) rather than a copy


def fork_run(
    store: Store,
    source: str,
    step: int | None,
    name: str,
    *,
    document: TrainingRun | None = None,
    fragment: dict[str, Any] | None = None,
    fragment_source: str = "<overrides>",
    fragment_lines: dict[tuple, int] | None = None,
    sets: list[str] | None = None,
) -> Forked:
    """Create run `name` from `source`'s checkpoint of `step` (newest when None). Its spec is `document`'s
    when given (MortalTrainer), else the parent's with `fragment` and `sets` merged over it."""
    from mortal.specs.fork import carry_over_problems, forked_document
    from mortal.state import NotFound, paths

    parent = store.get_run(source)  # NotFound: "trainingrun 'x' not found"
    parent_doc = parent.document()
    refuse_files_elsewhere(source, parent_doc.spec.backend, "forking copies")
    checkpoint = complete_checkpoint(store, source, step)
    try:
        store.get_run(name)
        raise RunExists(f"trainingrun {name!r} already exists; pick another name for the fork")
    except NotFound:
        pass
    if document is None:
        child = forked_document(
            _inherited(parent_doc.to_dict(include_status=False)),
            name,
            fragment,
            sets,
            fragment_source,
            fragment_lines,
        )
    else:
        child = document
    problems = carry_over_problems(parent_doc.spec, child.spec, checkpoint.step)
    if problems:
        listed = "\n  ".join(problems)
        raise CannotCarryOver(
            f"cannot fork {source}:step-{checkpoint.step} into {name!r}: the checkpoint cannot "
            f"carry over\n  {listed}"
        )
    dest = paths.checkpoints_dir(name) / f"step-{checkpoint.step}"
    if dest.exists():
        raise RunExists(
            f"{dest} already exists (left by an earlier run named {name!r}); remove it or pick another name"
        )
    admission = _admit(child, source, fragment_source) if document is None else None
    try:
        return _create(store, source, name, parent, checkpoint, child, dest)
    except BaseException:
        if admission is not None:
            admission.withdraw(store)
        raise


def _admit(child: TrainingRun, parent: str, fragment_source: str) -> Admission:
    """Admission for a fork made from overrides (MortalTrainer's document was admitted by the trainer): its
    spec checked in the parent's code snapshot, which the fork runs, then that snapshot installed as the
    fork's. A bad reward, tool or dataset the overrides name is refused here, not by a failing worker."""
    from mortal.controller.admission import AdmissionRefused, admit_runs

    try:
        with admit_runs([(child, fragment_source)], [], keep_from=parent) as admitted:
            return admitted[0]
    except AdmissionRefused as exc:
        where = f"{fragment_source} (the fork runs trainingrun {parent!r}'s code)"
        raise AdmissionRefused([replace(issue, source=where) for issue in exc.issues]) from None


def _create(
    store: Store,
    source: str,
    name: str,
    parent: RunRow,
    checkpoint: CheckpointRow,
    child: TrainingRun,
    dest: Path,
) -> Forked:
    """Copy the checkpoint into NEW's folder and create NEW with it recorded in one store transaction."""
    from mortal.state import Conflict

    linked = _copy_checkpoint(
        owned_folder(store, source, checkpoint, parent.spec.get("checkpoint", {}).get("uri"), "forking"),
        dest,
        name,
    )
    recorded = _upload_for_nodes(child, dest, checkpoint.step)
    meta = child.metadata
    try:
        row = store.fork_run(
            name,
            child.spec_dict(),
            meta.labels,
            meta.annotations,
            source,
            checkpoint.step,
            recorded,
            checkpoint.weight_version,
            provenance=checkpoint.provenance,
        )
    except Conflict:
        shutil.rmtree(dest, ignore_errors=True)
        raise RunExists(f"trainingrun {name!r} already exists; pick another name for the fork") from None
    how = "hard-linked" if linked else "copied"
    store.add_event(
        name,
        "Normal",
        "Forked",
        f"forked from {source} at step {checkpoint.step} (checkpoint {how} "
        f"to {recorded}); the first step trained is {checkpoint.step + 1}",
    )
    store.add_event(source, "Normal", "ForkCreated", f"trainingrun {name} forked from step {checkpoint.step}")
    wake_controller(name)
    return Forked(row.document(), source, checkpoint.step, dest, linked)


def _inherited(parent: dict[str, Any]) -> dict[str, Any]:
    """What a fork takes from its parent's document: not the watched folder's marks (the fork has no file
    there, and the folder deletes the runs it marked whose files are gone), and not `suspend` (a fork of a
    suspended run trains; `--set spec.suspend=true` forks it suspended)."""
    from mortal.controller.watchdir import SOURCE_ANNOTATION, SOURCE_LABEL

    meta = parent.get("metadata", {})
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if k != SOURCE_LABEL}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != SOURCE_ANNOTATION}
    spec = {k: v for k, v in parent["spec"].items() if k != "suspend"}
    return {**parent, "metadata": {**meta, "labels": labels, "annotations": annotations}, "spec": spec}


def _upload_for_nodes(child: TrainingRun, dest: Path, step: int) -> str:
    """What NEW's checkpoint row records: the copy here, or, for a Ray run whose nodes do not see this
    machine's MORTAL_HOME (ray.sharedFilesystem false), that copy uploaded to NEW's spec.checkpoint.uri
    (mortal.workers.actor.storage: the marker last, before the row), where its relaunched actor looks."""
    spec = child.spec
    if spec.backend != "ray" or spec.ray.shared_filesystem:
        return str(dest)
    from mortal.workers.actor.storage import CheckpointStorage, StorageError

    try:
        return CheckpointStorage(spec.checkpoint.uri, child.metadata.name).upload(dest, step)
    except StorageError as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise ForkError(f"cannot upload the fork's checkpoint: {exc}") from exc


def _copy_checkpoint(source: Path, dest: Path, run: str) -> bool:
    """Hard-link (else copy) every file into a hidden sibling, then rename it to `dest`; the marker is
    written anew (not linked) with NEW's name. True when every file was linked."""
    from mortal.workers.actor.checkpoint import MORTAL_FILE

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-fork-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    copied: list[str] = []

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
            copied.append(src)

    try:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
        if (source / MORTAL_FILE).is_file():  # the actor's marker (a simulated workload writes none)
            marker = json.loads((source / MORTAL_FILE).read_text())
            (tmp / MORTAL_FILE).unlink()
            (tmp / MORTAL_FILE).write_text(json.dumps({**marker, "run": run}, indent=1) + "\n")
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return not copied
