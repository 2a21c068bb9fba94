"""`mortalctl apply -f FILE|DIR|-`: make the store's desired state match TrainingRun documents.

Prints `trainingrun/NAME created | configured | unchanged` per run, nudges or starts a controller, and
with --follow/--wait stays until the runs finish. Status in the documents is ignored, so `get -o yaml`
output applies. The reading, refusing and writing are mortal.client.apply's; admission's checks are
mortal.controller.admission's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer

from mortal.client import apply
from mortal.client.cli import follow
from mortal.client.cli.context import CliError, state
from mortal.client.cli.error_messages import error_message
from mortal.client.cli.text import plain
from mortal.client.local_controller import ensure_controller, finish_deletion, wake_controller

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


def apply_command(
    ctx: typer.Context,
    filenames: list[str] = typer.Option(
        ...,
        "-f",
        "--filename",
        metavar="FILE",
        help="A file, a folder of *.yaml files, or '-' for stdin (repeatable).",
    ),
    recursive: bool = typer.Option(
        False, "-R", "--recursive", help="Read folders given with -f recursively."
    ),
    follow_: bool = typer.Option(False, "--follow", help="Show live progress until the runs finish."),
    wait: bool = typer.Option(False, "--wait", help="Wait quietly until the runs finish."),
    timeout: float = typer.Option(
        0, "--timeout", metavar="SECONDS", help="With --follow/--wait: give up after this long (0 = never)."
    ),
    no_controller: bool = typer.Option(
        False, "--no-controller", help="Do not start a background controller [env: MORTAL_NO_CONTROLLER=1]."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Validate, print the admission checks and what would change, without writing.",
    ),
) -> None:
    from mortal.controller.admission import admit_runs

    cli = state(ctx)
    sourced = apply.read_sourced_documents(filenames, recursive)
    runs = [run for run, _ in sourced]
    if not runs:
        raise CliError(f"no TrainingRun documents found in {', '.join(filenames)}")
    for run in runs:
        for note in run.spec.notes():
            typer.echo(plain(f"note: trainingrun/{run.name}: {note}"), err=True)
    apply.refuse_what_cannot_fit(runs)
    if not dry_run:  # before admission installs the code snapshot in the run's folder, which the purge moves
        for run in runs:
            apply.wait_until_deleted(
                cli.store,
                run.name,
                on_wait=lambda name=run.name: finish_deletion(cli.state_url, no_controller, name),
            )
    with admit_runs(sourced, [Path.cwd()], dry_run) as admitted:
        for admission in admitted:
            for check in admission.checks if dry_run else admission.deferred:
                typer.echo(
                    plain(("check: " if dry_run else "note: ") + check.line(admission.run.name)), err=True
                )
        fitted = apply.fit_micro_batches(runs)
        for note in apply.launch_notes(cli.store, fitted) + apply.unapplied_notes(cli.store, fitted):
            typer.echo(plain(f"note: {note}"), err=True)
        results = apply.apply_runs(cli.store, fitted, dry_run)
        admissions = {admission.run.name: admission for admission in admitted}
        for result in results:  # a run never created leaves no code folder under its name
            if result.error is not None:
                admissions[result.name].withdraw(cli.store)
    suffix = " (dry run)" if dry_run else ""
    applied = [r for r in results if r.error is None]
    for result in applied:
        typer.echo(plain(f"trainingrun/{result.name} {result.outcome}{suffix}"))
    refused = [r for r in results if r.error is not None]
    if refused:  # as kubectl apply: each run's error after the others are applied, then exit 1
        sources = {run.name: source for run, source in sourced}
        for result in refused:
            typer.echo(plain(refusal_message(result, sources[result.name]), multiline=True), err=True)
    if not dry_run:  # a controller that dies starting raises: its error is the last word
        changed = [r.name for r in applied if r.outcome != "unchanged"]
        if changed:
            wake_controller(*changed)
        ensure_controller(cli.state_url, no_controller)
    if refused:
        raise typer.Exit(1)
    if not dry_run and (follow_ or wait):
        names = [r.name for r in results]
        ok = follow.follow_runs(cli.store, names, quiet=wait and not follow_, timeout=timeout or None)
        raise typer.Exit(0 if ok else 1)


def refusal_message(result: apply.Applied, source: str) -> str:
    """The error line of one run apply refused, naming the file it came from; a spec the three-way merge
    made invalid names the fields, as kept from the live run."""
    from mortal.specs import SpecError

    error = result.error
    if isinstance(error, SpecError):
        kept = f"{source} with the fields trainingrun/{result.name} keeps from its live spec"
        error = SpecError([replace(issue, source=kept) for issue in error.issues])
        return error_message(error)
    return f"{error_message(error)} ({source})"


def register(app: typer.Typer) -> None:
    app.command(
        "apply", help=HELP, short_help="Create or update runs from YAML or JSON files", no_args_is_help=True
    )(apply_command)
