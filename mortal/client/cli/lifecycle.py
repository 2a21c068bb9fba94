"""`mortalctl delete | suspend | resume run NAME`: the verbs that stop, pause and restart runs.

They only change desired state (deleted_at, spec.suspend) and nudge the controller, which stops or
starts workers; checkpoints survive a delete unless --purge. Suspend and resume are spec writes
through `context.modify_spec`, so they are compare-and-swap like scale.
"""

from __future__ import annotations

import typer

from mortal.client.apply import read_documents
from mortal.client.cli.context import (
    TERMINAL_PHASES,
    CliError,
    modify_spec,
    state,
)
from mortal.client.cli.text import plain
from mortal.client.local_controller import ensure_controller, wake_controller

RUN_ALIASES = ("run", "runs", "trainingrun", "trainingruns", "tr")
NoController = typer.Option(False, "--no-controller", help="Do not start a background controller.")

DELETE_HELP = """Delete runs by name or by the files that define them.

The controller stops the run's workers, then removes its records. Checkpoints (and the run's
folder under MORTAL_HOME, moved to MORTAL_HOME/deleted/NAME-UID) are kept unless --purge is given;
the name can be applied again at once, as a new run that starts from scratch.

\b
Examples:
  mortalctl delete run quickstart
  mortalctl delete run quickstart --purge
  mortalctl delete -f specs/examples/quickstart.yaml
"""

SUSPEND_HELP = """Suspend runs: stop their workers and keep everything else (spec.suspend = true).

\b
Examples:
  mortalctl suspend run quickstart
"""

RESUME_HELP = """Resume suspended runs (spec.suspend = false); the actor continues from its latest checkpoint.

\b
Examples:
  mortalctl resume run quickstart
"""


def delete_names(
    ctx: typer.Context, names: list[str], purge: bool, ignore_not_found: bool, no_controller: bool
) -> None:
    from mortal.controller.watchdir import SOURCE_ANNOTATION
    from mortal.state import NotFound

    cli = state(ctx)
    deleted: list[str] = []
    for name in names:
        try:
            row = cli.store.mark_deleted(name, purge=purge)
        except NotFound:
            if ignore_not_found:
                continue
            raise
        deleted.append(name)
        # Deletion is asynchronous, as kubectl's: the controller stops the workers, then purges or moves.
        typer.echo(plain(f"trainingrun/{name} deleted ({what_happens_to_files(name, row.uid, purge)})"))
        if folder := row.annotations.get(SOURCE_ANNOTATION):
            typer.echo(
                plain(
                    f"note: trainingrun/{name} came from the watched folder {folder}: the controller "
                    "watching it applies its file again at the folder's next change; remove the file to "
                    "delete it for good"
                ),
                err=True,
            )
    if deleted:
        wake_controller(*deleted)
        ensure_controller(cli.state_url, no_controller)


def what_happens_to_files(name: str, uid: str, purge: bool) -> str:
    """What the controller's purge will do with the run's folder, asked as the purge asks it
    (controller.backends.base): a folder that is a link, or a `deleted` folder that is one, is left where
    it is, never followed, so the answer must not promise a move or a removal."""
    from mortal.controller.backends.base import own_run_folder, set_aside_paths
    from mortal.state import paths
    from mortal.state.containment import PathOutside

    try:
        if purge:
            own_run_folder(name)
        else:
            set_aside_paths(name, uid)
    except PathOutside as exc:
        return f"the controller stops its workers and leaves its files where they are: {exc}"
    if purge:
        return "the controller stops its workers, then purges its checkpoints"
    kept = paths.kept_run_dir(name, uid) / "checkpoints"
    return f"the controller stops its workers, then moves its checkpoints to {kept}"


def delete_run(
    ctx: typer.Context,
    names: list[str] = typer.Argument(..., metavar="NAME", help="Runs to delete."),
    purge: bool = typer.Option(False, "--purge", help="Also remove checkpoints and the run's folder."),
    ignore_not_found: bool = typer.Option(
        False, "--ignore-not-found", help="Treat a missing run as deleted."
    ),
    no_controller: bool = NoController,
) -> None:
    """Delete runs by name (aliases: runs, trainingrun, tr)."""
    delete_names(ctx, names, purge, ignore_not_found, no_controller)


def delete_group(
    ctx: typer.Context,
    filenames: list[str] = typer.Option(
        None,
        "-f",
        "--filename",
        metavar="FILE",
        help="Delete the runs defined in these files or folders ('-' = stdin).",
    ),
    recursive: bool = typer.Option(
        False, "-R", "--recursive", help="Read folders given with -f recursively."
    ),
    purge: bool = typer.Option(
        False, "--purge", help="With -f: also remove checkpoints and the runs' folders."
    ),
    ignore_not_found: bool = typer.Option(
        False, "--ignore-not-found", help="With -f: treat a missing run as deleted."
    ),
    no_controller: bool = NoController,
) -> None:
    if ctx.invoked_subcommand is not None:
        if filenames:
            raise typer.BadParameter("give either -f FILE or `run NAME`, not both", param_hint="'-f'")
        return
    if not filenames:
        raise typer.BadParameter("say what to delete: `delete run NAME` or `delete -f FILE`")
    names = [run.name for run in read_documents(filenames, recursive)]
    delete_names(ctx, names, purge, ignore_not_found, no_controller)


def set_suspend(ctx: typer.Context, names: list[str], suspend: bool, no_controller: bool) -> None:
    """Write spec.suspend on each run; a finished run cannot be suspended or resumed."""
    cli = state(ctx)
    verb = "suspended" if suspend else "resumed"

    def change(row):
        if row.phase in TERMINAL_PHASES:
            raise CliError(f"trainingrun/{row.name} is {row.phase}; a finished run cannot be {verb}")
        return {**row.spec, "suspend": suspend}

    changed: list[str] = []
    for name in names:
        before, after = modify_spec(cli.store, name, change)
        if after.resource_version == before.resource_version:
            typer.echo(plain(f"trainingrun/{name} unchanged (already {verb})"))
            continue
        changed.append(name)
        typer.echo(plain(f"trainingrun/{name} {verb}"))
    if changed:
        wake_controller(*changed)
        ensure_controller(cli.state_url, no_controller)


def suspend_run(
    ctx: typer.Context,
    names: list[str] = typer.Argument(..., metavar="NAME", help="Runs to suspend."),
    no_controller: bool = NoController,
) -> None:
    """Suspend runs (aliases: runs, trainingrun, tr)."""
    set_suspend(ctx, names, True, no_controller)


def resume_run(
    ctx: typer.Context,
    names: list[str] = typer.Argument(..., metavar="NAME", help="Runs to resume."),
    no_controller: bool = NoController,
) -> None:
    """Resume suspended runs (aliases: runs, trainingrun, tr)."""
    set_suspend(ctx, names, False, no_controller)


def _group(help_text: str, short: str, command, callback=None) -> typer.Typer:
    group = typer.Typer(
        help=help_text, short_help=short, rich_markup_mode=None, no_args_is_help=callback is None
    )
    if callback is not None:
        group.callback(invoke_without_command=True)(callback)
    for i, alias in enumerate(RUN_ALIASES):
        group.command(alias, hidden=i > 0)(command)
    return group


def register(app: typer.Typer) -> None:
    app.add_typer(
        _group(DELETE_HELP, "Delete runs (checkpoints are kept)", delete_run, delete_group), name="delete"
    )
    app.add_typer(
        _group(SUSPEND_HELP, "Stop a run's workers, keeping its state", suspend_run), name="suspend"
    )
    app.add_typer(_group(RESUME_HELP, "Start a suspended run again", resume_run), name="resume")
