"""mortalctl: the kubectl-like command line of mortal (`main()` is the `mortalctl` console script).

    mortalctl apply -f specs/examples/quickstart.yaml --follow
    mortalctl get runs | describe run NAME | scale NAME rollout=4 | logs NAME -f | delete run NAME

This module builds the typer app from the verb modules and maps errors to exit codes: 0 ok, 1 a
user error (bad spec, not found, conflict; one paragraph on stderr, a traceback only with --debug),
2 a usage error (click's). Verbs change desired state in the store; none of them imports torch.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from mortal.client.cli import (
    apply,
    components,
    cp,
    dashboard,
    describe,
    env,
    evaluation,  # noqa: F401  (its `test eval` joins components' `test` group on import)
    fork,
    get,
    lifecycle,
    ops,
    sandbox,
    scale,
)
from mortal.client.cli.context import CliState
from mortal.client.cli.error_messages import error_message
from mortal.client.cli.text import plain

HELP = """mortalctl controls mortal, an operator for reinforcement-learning training of language models.

Declare a TrainingRun in YAML and apply it; a controller starts, scales, recovers and stops its
actor (trainer) and rollout (generation) workers. State lives in $MORTAL_STATE_URL, else in SQLite
at $MORTAL_HOME/state.db (MORTAL_HOME defaults to ~/.mortal).

\b
Examples:
  mortalctl apply -f specs/examples/quickstart.yaml --follow
  mortalctl get runs
  mortalctl scale quickstart rollout=4
"""

SECTIONS = {
    "Basic commands": (
        "apply",
        "get",
        "describe",
        "scale",
        "delete",
        "suspend",
        "resume",
        "logs",
        "dashboard",
    ),
    "Lineage": ("fork", "rollback"),
    "Trying parts of a run": ("test", "sandbox", "cp"),
    "Operations": ("controller", "env", "schema", "version"),
}


class MortalGroup(TyperGroup):
    """The root command: turns the errors a user can cause into exit 1 with a readable message."""

    def format_commands(self, ctx: typer.Context, formatter: Any) -> None:
        """Commands in kubectl-like sections rather than one alphabetical list."""
        width = max(len(name) for names in SECTIONS.values() for name in names)
        for title, names in SECTIONS.items():
            rows = []
            for name in names:
                command = self.get_command(ctx, name)
                if command is not None and not command.hidden:
                    rows.append(
                        (name.ljust(width), command.get_short_help_str(limit=formatter.width - 6 - width))
                    )
            with formatter.section(title):
                formatter.write_dl(rows)

    def invoke(self, ctx: typer.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # `mortalctl ... | head`: the reader has what it wanted; no error, as cat
            _quiet_stdout()
            raise typer.Exit(141) from None
        except Exception as exc:
            if _is_typer_signal(exc):
                raise
            cli = ctx.obj if isinstance(ctx.obj, CliState) else None
            debug = (cli.debug if cli else False) or _env_debug()
            if debug:
                traceback.print_exc(file=sys.stderr)
            typer.echo(plain(error_message(exc, debug), multiline=True), err=True)
            raise typer.Exit(1) from None


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not raise BrokenPipeError again
    (Python's documented way: docs.python.org, signal, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _is_typer_signal(exc: BaseException) -> bool:
    """typer's (vendored click's) own exits, aborts and usage errors: left for typer to handle."""
    return isinstance(exc, (typer.Exit, typer.Abort)) or type(exc).__module__.startswith("typer")


def _env_debug() -> bool:
    return os.environ.get("MORTAL_DEBUG", "").lower() in ("1", "true", "yes")


app = typer.Typer(
    cls=MortalGroup,
    name="mortalctl",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Print tracebacks of errors."),
    state_url: str | None = typer.Option(
        None,
        "--state-url",
        metavar="URL",
        help="State store: sqlite:///PATH or postgresql://USER@HOST/DB [env: MORTAL_STATE_URL; "
        "default: SQLite under MORTAL_HOME].",
    ),
    home: Path | None = typer.Option(
        None,
        "--home",
        metavar="DIR",
        help="mortal's folder for state, logs, checkpoints [env: MORTAL_HOME; default: ~/.mortal].",
    ),
) -> None:
    """The global options; any controller or worker started from here gets them through the environment."""
    if home is not None:
        os.environ["MORTAL_HOME"] = str(home.expanduser().resolve())
    if state_url:
        os.environ["MORTAL_STATE_URL"] = state_url
    cli = CliState(debug=debug or _env_debug(), state_url=state_url)
    ctx.obj = cli
    ctx.call_on_close(cli.close)


apply.register(app)
get.register(app)
describe.register(app)
scale.register(app)
lifecycle.register(app)
ops.register(app)
components.register(app)
sandbox.register(app)
env.register(app)
cp.register(app)
dashboard.register(app)
fork.register(app)


def main() -> None:
    """Console-script entry point (`mortalctl`)."""
    app(prog_name="mortalctl")


if __name__ == "__main__":
    main()
