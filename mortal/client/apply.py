"""Applying TrainingRuns: read their documents, refuse or fit what the GPU cannot hold, write desired state.

Shared by `mortalctl apply` (and `delete -f`, `mortalctl test`, which read documents the same way) and
MortalTrainer.train(), which waits as apply does for a run of the same name being deleted. Refuses,
before anything is written, a model that certainly cannot fit the GPU it names (mortal.controller.fit).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mortal.client.errors import ClientError

if TYPE_CHECKING:
    from mortal.specs import TrainingRun


def read_documents(filenames: list[str], recursive: bool = False) -> list[TrainingRun]:
    """Every run in the given files, folders or '-' (stdin); all problems raised together as one SpecError."""
    return [run for run, _ in read_sourced_documents(filenames, recursive)]


def read_sourced_documents(filenames: list[str], recursive: bool = False) -> list[tuple[TrainingRun, str]]:
    """`read_documents`, each run with the file (or folder, or '-') it came from, for admission's messages."""
    from mortal.specs import SpecError, SpecIssue, load_path

    runs: list[tuple[TrainingRun, str]] = []
    issues: list[SpecIssue] = []
    for filename in filenames:
        try:
            runs += [
                (run, "<stdin>" if filename == "-" else filename)
                for run in load_path(filename, recursive=recursive)
            ]
        except SpecError as err:
            issues += err.issues
    sources: dict[str, list[str]] = {}
    for run, source in runs:
        sources.setdefault(run.name, []).append(source)
    for name, where in sources.items():
        if len(where) > 1:
            given = "in " + ", ".join(where) if len(set(where)) > 1 else f"{len(where)} times in {where[0]}"
            message = f"run {name!r} is given more than once ({given})"
            issues.append(SpecIssue("<arguments>", None, "metadata.name", message))
    if issues:
        raise SpecError(issues)
    return runs


def refuse_what_cannot_fit(runs: list[TrainingRun]) -> None:
    """Raise ClientError naming the field when a run's model certainly cannot fit the GPU it asks for
    (mortal.controller.fit); the parameter count comes from the model's files, when they are here."""
    from mortal.controller.backends.gpus import gpu_memory
    from mortal.controller.fit import certain_misfits
    from mortal.workers.models import count_parameters

    problems = []
    for run in runs:
        spec = run.spec
        if gpu_memory(spec.actor.gpu) is None and gpu_memory(spec.rollout.gpu) is None:
            continue  # CPU, or a GPU type whose memory is not in the table: nothing certain to say
        parameters = count_parameters(spec.model.name)
        if parameters is None:
            continue
        problems += [
            f"trainingrun/{run.name}: {m.field}: {m.message}" for m in certain_misfits(spec, parameters)
        ]
    if problems:
        raise ClientError(
            "the model cannot fit the GPU it asks for (nothing was applied):\n" + "\n".join(problems)
        )


def fit_micro_batches(runs: list[TrainingRun]) -> list[TrainingRun]:
    """Each run whose actor's default micro batch (the whole batch) is estimated not to fit its GPU, annotated
    with the largest one that does (mortal.controller.fit.fitting_micro_batch; heal.FITTED_ANNOTATION): the
    controller trains with it from the first launch, the same step in more passes. The spec is not changed;
    a note says what was chosen. Others as they are, and so is a run whose model files or GPU are not known
    here (the controller then halves the micro batch after an out-of-memory instead)."""
    from mortal.controller.fit import ModelShape, fitting_micro_batch
    from mortal.controller.heal import FITTED_ANNOTATION, SPLIT_DEPENDENT_LOSSES
    from mortal.workers.models import count_parameters, read_config

    fitted = []
    for run in runs:
        notes = {k: v for k, v in run.metadata.annotations.items() if k != FITTED_ANNOTATION}
        algorithm = run.spec.algorithm
        chooses = algorithm.micro_batch_size is None and algorithm.loss_type not in SPLIT_DEPENDENT_LOSSES
        config = read_config(run.spec.model.name) if chooses else None
        shape = ModelShape.from_config(config) if config else None
        parameters = count_parameters(run.spec.model.name) if shape else None
        choice = fitting_micro_batch(run.spec, parameters, shape) if shape and parameters else None
        if choice is not None:
            print(f"note: trainingrun/{run.name}: {choice.reason}", file=sys.stderr, flush=True)
            notes[FITTED_ANNOTATION] = str(choice.size)
        if notes != run.metadata.annotations:
            run = run.model_copy(update={"metadata": run.metadata.model_copy(update={"annotations": notes})})
        fitted.append(run)
    return fitted


# What a running run takes without its workers starting again: read by the controller each pass.
LIVE_FIELDS = frozenset({"suspend", "restartPolicy", "deadlines", "limits"})
LIVE_SUBFIELDS = {"rollout": frozenset({"replicas"}), "algorithm": frozenset({"maxSteps"})}
RUNNING_PHASES = frozenset({"Starting", "Running", "Recovering"})


def fields_read_at_launch(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The spec fields (camelCase, dotted) that differ between `before` and `after` and that workers read
    only when they are launched: a running run takes them when its workers next start."""
    changed = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old == new or key in LIVE_FIELDS:
            continue
        live = LIVE_SUBFIELDS.get(key)
        if live is not None and isinstance(old, dict) and isinstance(new, dict):
            changed += [
                f"spec.{key}.{sub}"
                for sub in sorted(set(old) | set(new))
                if sub not in live and old.get(sub) != new.get(sub)
            ]
        else:
            changed.append(f"spec.{key}")
    return changed


def launch_notes(store, runs: list[TrainingRun]) -> list[str]:
    """For each run that exists and runs: a note naming the fields its change would reach only at the
    workers' next start, and how to get there (suspend, then resume)."""
    from mortal.specs import SpecError
    from mortal.state.apply_document import merged_spec

    notes = []
    for run, row in _existing(store, runs):
        if row.phase not in RUNNING_PHASES or row.spec.get("suspend"):
            continue
        try:
            fields = fields_read_at_launch(row.spec, merged_spec(run, row))
        except SpecError:  # the merge does not fit: apply_runs reports it for this run
            continue
        if fields:
            notes.append(
                f"trainingrun/{run.name} is {row.phase}: its workers read {', '.join(fields)} when they "
                f"start, so the change takes effect when they next do (mortalctl suspend {run.name}, "
                "then resume: from the newest checkpoint)"
            )
    return notes


DELETION_WAIT_SECONDS = 120.0  # how long apply waits for a run of the same name to finish deleting
DELETION_POLL_SECONDS = 0.1


@dataclass
class Applied:
    """What applying one run did: its outcome (created, configured, unchanged), or what refused it."""

    name: str
    outcome: str | None = None
    error: Exception | None = None


def apply_runs(store, runs: list[TrainingRun], dry_run: bool = False) -> list[Applied]:
    """Write each run's desired state, in the order given. As `kubectl apply -f DIR`, a run refused (its
    merge does not fit, the store refuses the change, it is being deleted) does not stop the others: its
    error is in its result, for the caller to report after the rest are written."""
    from mortal.controller.snapshot import being_deleted
    from mortal.specs import SpecError
    from mortal.state import Conflict, InvalidValue
    from mortal.state.apply_document import apply_document

    results = []
    for run in runs:
        try:
            outcome = str(apply_document(store, run, dry_run=dry_run)[1])
        except Conflict as exc:
            if dry_run and being_deleted(store, run.name):  # apply waits for the purge, then creates it
                results.append(Applied(run.name, "created (once the deletion in progress ends)"))
            else:
                results.append(Applied(run.name, error=exc))
            continue
        except (SpecError, InvalidValue) as exc:  # ChangeRefused and InvalidName are among them
            results.append(Applied(run.name, error=exc))
            continue
        results.append(Applied(run.name, outcome))
    return results


def unapplied_notes(store, runs: list[TrainingRun]) -> list[str]:
    """For each existing run the store keeps no last-applied configuration of (a fork, or one applied before
    mortal kept one): this apply keeps every field the file leaves out, as kubectl warns of an object
    without its last-applied annotation."""
    notes = []
    for run, row in _existing(store, runs):
        if row.applied is None and row.deleted_at is None:
            notes.append(
                f"trainingrun/{run.name} has no last-applied configuration (a fork, or applied before "
                "mortal kept one): this apply keeps every field the file leaves out, and records the "
                "file's fields, so the next apply resets those it drops"
            )
    return notes


def _existing(store, runs: list[TrainingRun]) -> Iterator[tuple[TrainingRun, Any]]:
    """Each run the store holds, with its row (the others are skipped)."""
    from mortal.state import NotFound

    for run in runs:
        try:
            row = store.get_run(run.name)
        except NotFound:
            continue
        yield run, row


def wait_until_deleted(
    store, name: str, timeout: float | None = None, on_wait: Callable[[], None] | None = None
) -> None:
    """A run of this name being deleted: wait until the controller has purged it (and set its folder aside),
    so that `delete` then `apply` at once creates the new run (a new uid) with a folder of its own instead of
    failing; ClientError after `timeout`. `on_wait` runs once, when there is something to wait for: the
    caller starts a controller there (the purge is the controller's, and none may run)."""
    import time

    from mortal.controller.snapshot import being_deleted

    timeout = DELETION_WAIT_SECONDS if timeout is None else timeout
    deadline = time.monotonic() + timeout
    said = False
    while being_deleted(store, name):
        if not said:
            print(
                f"trainingrun/{name} is being deleted: waiting for the controller to finish",
                file=sys.stderr,
                flush=True,
            )
            said = True
            if on_wait is not None:
                on_wait()
        if time.monotonic() >= deadline:
            raise ClientError(
                f"trainingrun/{name} is still being deleted after {timeout:g}s; is a "
                "controller running? (mortalctl get runs shows it Terminating)"
            )
        time.sleep(DELETION_POLL_SECONDS)
