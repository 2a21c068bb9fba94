"""`mortalctl apply -f FILE|DIR|-`: make the store's desired state match TrainingRun documents.

Prints `trainingrun/NAME created | configured | unchanged` per run (unchanged when the normalized
spec, labels and annotations are equal), nudges or starts a controller, and with --follow/--wait
stays until the runs finish. Status in the documents is ignored, so `get -o yaml` output applies.
Refuses, before writing anything, a run whose model certainly cannot fit the GPU it names
(`refuse_what_cannot_fit`, mortal.controller.fit), or that fails admission (mortal.controller.admission:
its rewards, tools, environments, model and dataset file, checked from this folder, whose code the
run then carries in its snapshot). Also holds `read_documents`, shared with `delete -f`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mortal.client.cli import follow
from mortal.client.cli.context import CliError, ensure_controller, state, wake_controller
from mortal.client.cli.text import plain

if TYPE_CHECKING:
    from mortal.specs import TrainingRun

HELP = """Create or update TrainingRuns from YAML or JSON files.

A run that does not exist is created; one whose spec, labels or annotations differ is configured
(its generation grows when the spec changes); an identical one is left unchanged. Status and
read-only metadata in the files are ignored, so the output of `get -o yaml` can be applied again.
Unless --no-controller is given, a background controller is started when none is running.

Before anything is written, each run is admitted: its rewards, tools and environments must import
from this folder (or be installed) with the signatures TRL calls, its model must be here or in the
Hugging Face cache, its dataset file must exist. The modules and files it takes from this folder are
snapshotted with the run, so its workers import them wherever the controller was started; editing
them and applying again says `configured`. Checks only a remote backend can make are printed as
deferred. --dry-run prints every check (docs/admission.md).

\b
Examples:
  # Train the quickstart example on this machine and watch it
  mortalctl apply -f specs/examples/quickstart.yaml --follow
\b
  # Apply every *.yaml file in a folder
  mortalctl apply -f runs/
\b
  # Apply what another command prints
  mortalctl get runs -o json | mortalctl apply -f -
"""


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
            runs += [(run, "<stdin>" if filename == "-" else filename)
                     for run in load_path(filename, recursive=recursive)]
        except SpecError as err:
            issues += err.issues
    seen: set[str] = set()
    for run, _ in runs:
        if run.name in seen:
            issues.append(SpecIssue("<arguments>", None, "metadata.name", f"run {run.name!r} is given twice"))
        seen.add(run.name)
    if issues:
        raise SpecError(issues)
    return runs


def refuse_what_cannot_fit(runs: list[TrainingRun]) -> None:
    """Raise CliError naming the field when a run's model certainly cannot fit the GPU it asks for
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
        problems += [f"trainingrun/{run.name}: {m.field}: {m.message}" for m in certain_misfits(spec, parameters)]
    if problems:
        raise CliError("the model cannot fit the GPU it asks for (nothing was applied):\n" + "\n".join(problems))


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
            typer.echo(f"note: trainingrun/{run.name}: {choice.reason}", err=True)
            notes[FITTED_ANNOTATION] = str(choice.size)
        if notes != run.metadata.annotations:
            run = run.model_copy(update={"metadata": run.metadata.model_copy(update={"annotations": notes})})
        fitted.append(run)
    return fitted


DELETION_WAIT_SECONDS = 120.0  # how long apply waits for a run of the same name to finish deleting
DELETION_POLL_SECONDS = 0.1


def apply_runs(store, runs: list[TrainingRun], dry_run: bool = False) -> list[tuple[str, str]]:
    """Write each run's desired state; returns (name, outcome) pairs in the order given."""
    results = []
    for run in runs:
        meta = run.metadata
        if dry_run:
            results.append((run.name, _dry_outcome(store, run)))
            continue
        _, outcome = store.apply_run(run.name, run.spec_dict(), labels=meta.labels, annotations=meta.annotations)
        results.append((run.name, str(outcome)))
    return results


def wait_until_deleted(store, name: str, timeout: float | None = None) -> None:
    """A run of this name being deleted: wait until the controller has purged it (and set its folder aside),
    so that `delete` then `apply` at once creates the new run (a new uid) with a folder of its own instead of
    failing; CliError after `timeout`."""
    import time

    from mortal.controller.snapshot import being_deleted

    timeout = DELETION_WAIT_SECONDS if timeout is None else timeout
    deadline = time.monotonic() + timeout
    said = False
    while being_deleted(store, name):
        if not said:
            typer.echo(f"trainingrun/{name} is being deleted: waiting for the controller to finish", err=True)
            said = True
        if time.monotonic() >= deadline:
            raise CliError(f"trainingrun/{name} is still being deleted after {timeout:g}s; is a "
                           "controller running? (mortalctl get runs shows it Terminating)")
        time.sleep(DELETION_POLL_SECONDS)


def _dry_outcome(store, run: TrainingRun) -> str:
    """What apply would say, computed without writing."""
    from mortal.state import NotFound

    try:
        row = store.get_run(run.name)
    except NotFound:
        return "created"
    same = (row.spec, row.labels, row.annotations) == (run.spec_dict(), run.metadata.labels, run.metadata.annotations)
    return "unchanged" if same else "configured"


def apply_command(
    ctx: typer.Context,
    filenames: list[str] = typer.Option(
        ..., "-f", "--filename", metavar="FILE", help="A file, a folder of *.yaml files, or '-' for stdin (repeatable)."
    ),
    recursive: bool = typer.Option(False, "-R", "--recursive", help="Read folders given with -f recursively."),
    follow_: bool = typer.Option(False, "--follow", help="Show live progress until the runs finish."),
    wait: bool = typer.Option(False, "--wait", help="Wait quietly until the runs finish."),
    timeout: float = typer.Option(0, "--timeout", metavar="SECONDS", help="With --follow/--wait: give up after this long (0 = never)."),
    no_controller: bool = typer.Option(
        False, "--no-controller", help="Do not start a background controller [env: MORTAL_NO_CONTROLLER=1]."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate, print the admission checks and what would change, without writing."),
) -> None:
    from mortal.controller.admission import admit_runs

    cli = state(ctx)
    sourced = read_sourced_documents(filenames, recursive)
    runs = [run for run, _ in sourced]
    if not runs:
        raise CliError(f"no TrainingRun documents found in {', '.join(filenames)}")
    for run in runs:
        for note in run.spec.notes():
            typer.echo(plain(f"note: trainingrun/{run.name}: {note}"), err=True)
    refuse_what_cannot_fit(runs)
    if not dry_run:  # before admission installs the code snapshot in the run's folder, which the purge moves
        for run in runs:
            wait_until_deleted(cli.store, run.name)
    with admit_runs(sourced, [Path.cwd()], dry_run) as admitted:
        for admission in admitted:
            for check in admission.checks if dry_run else admission.deferred:
                typer.echo(plain(("check: " if dry_run else "note: ") + check.line(admission.run.name)), err=True)
        results = apply_runs(cli.store, fit_micro_batches(runs), dry_run)
    suffix = " (dry run)" if dry_run else ""
    for name, outcome in results:
        typer.echo(plain(f"trainingrun/{name} {outcome}{suffix}"))
    if dry_run:
        return
    changed = [name for name, outcome in results if outcome != "unchanged"]
    if changed:
        wake_controller(*changed)
    ensure_controller(cli, no_controller)
    if follow_ or wait:
        names = [name for name, _ in results]
        ok = follow.follow_runs(cli.store, names, quiet=wait and not follow_, timeout=timeout or None)
        raise typer.Exit(0 if ok else 1)


def register(app: typer.Typer) -> None:
    app.command("apply", help=HELP, short_help="Create or update runs from YAML or JSON files", no_args_is_help=True)(apply_command)
