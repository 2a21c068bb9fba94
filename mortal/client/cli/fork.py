"""`mortalctl fork RUN[:step-N] NEW` and `mortalctl rollback RUN --to step-N`: start again from a checkpoint.

Thin verbs: they parse the arguments, call mortal.client.fork and mortal.client.rollback (which
MortalTrainer shares), and print what was done.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from mortal.client.cli.context import CliError, state
from mortal.client.cli.text import plain
from mortal.client.fork import fork_run, parse_source
from mortal.client.local_controller import ensure_controller
from mortal.client.rollback import rollback_run

FORK_HELP = """Create run NEW from RUN's checkpoint of step N (default: its newest complete one).

NEW's spec is RUN's with the overrides merged over it: -f FILE is a YAML fragment rooted at the
document (spec: ... and/or metadata: {labels, annotations}; null removes a key), --set PATH=VALUE sets
one key by its dotted camelCase path. NEW resumes from the checkpoint as a preempted run would:
weights, optimizer, scheduler, RNG and data position; its first step is N+1, and its learning rate
is NEW's spec's. The model, LoRA on/off, rank, alpha and target modules, and the backend cannot change
(the checkpoint's weights would not fit). `describe run NEW` shows where it came from.

\b
Examples:
  mortalctl fork quickstart:step-20 quickstart-lr --set spec.algorithm.learningRate=1e-6
  mortalctl fork quickstart quickstart-long --set spec.algorithm.maxSteps=60 -f more-rewards.yaml
"""

ROLLBACK_HELP = """Roll RUN back to its checkpoint of step N and train on from there.

A running run is suspended first (its workers stop), then every step after N is forgotten: later
checkpoints, metrics and sampled completions. The later checkpoints' folders are kept under
$MORTAL_HOME/runs/RUN/rolled-back/ (removed with --drop-later) and are no longer the run's, so the
resume starts from N. The run resumes if it was running; a suspended one stays suspended.
A finished run cannot be rolled back: fork it instead.

\b
Examples:
  mortalctl rollback quickstart --to step-20
  mortalctl rollback quickstart --to step-20 --drop-later
"""


def fork_command(
    ctx: typer.Context,
    source: str = typer.Argument(
        ..., metavar="RUN[:step-N]", help="The run, and optionally the checkpoint's step."
    ),
    name: str = typer.Argument(..., metavar="NEW", help="The new run's name."),
    filename: Path | None = typer.Option(
        None,
        "-f",
        "--filename",
        metavar="FILE",
        help="YAML overrides rooted at the document (spec: ..., metadata: ...).",
    ),
    sets: list[str] = typer.Option(
        None,
        "--set",
        metavar="PATH=VALUE",
        help="Override one key, e.g. spec.algorithm.learningRate=1e-6 (repeatable).",
    ),
    no_controller: bool = typer.Option(
        False, "--no-controller", help="Do not start a background controller."
    ),
) -> None:
    from mortal.specs import is_dns1123_label

    cli = state(ctx)
    run, step = parse_source(source)
    if not is_dns1123_label(name):
        raise CliError(f"{name!r}: NEW must be a DNS-1123 label (lowercase letters, digits and '-')")
    fragment, lines = _read_fragment(filename) if filename is not None else (None, None)
    forked = fork_run(
        cli.store,
        run,
        step,
        name,
        fragment=fragment,
        fragment_source=str(filename or "<overrides>"),
        fragment_lines=lines,
        sets=list(sets or []),
    )
    typer.echo(
        plain(
            f"trainingrun/{name} created, forked from {run} at step {forked.step} "
            f"(first step {forked.step + 1})"
        )
    )
    ensure_controller(cli.state_url, no_controller)


def _read_fragment(path: Path) -> tuple[dict[str, Any] | None, dict[tuple, int]]:
    from mortal.specs import SpecError, SpecIssue
    from mortal.specs.fork import load_fragment

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([SpecIssue(str(path), None, "", f"cannot read: {exc}")]) from None
    return load_fragment(text, str(path))


def rollback_command(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help="The run to roll back."),
    to: str = typer.Option(..., "--to", metavar="step-N", help="The checkpoint to go back to, e.g. step-20."),
    drop_later: bool = typer.Option(
        False, "--drop-later", help="Remove the later checkpoints instead of keeping them."
    ),
    timeout: float = typer.Option(
        120.0, "--timeout", metavar="SECONDS", help="How long to wait for workers to stop."
    ),
    no_controller: bool = typer.Option(
        False, "--no-controller", help="Do not start a background controller."
    ),
) -> None:
    match = re.fullmatch(r"(?:step-)?(\d+)", to.strip())
    if match is None:
        raise typer.BadParameter(f"{to!r} is not step-N (e.g. step-20)", param_hint="'--to'")
    cli = state(ctx)
    done = rollback_run(
        cli.store,
        run,
        int(match.group(1)),
        drop_later,
        stop_timeout=timeout,
        on_suspend=lambda: ensure_controller(cli.state_url, no_controller),
    )
    later = ", ".join(f"step-{s}" for s in done.later) or "none"
    where = f" (kept in {done.kept_in})" if done.kept_in else (" (removed)" if done.later else "")
    then = "resumed" if done.resumed else "still suspended (mortalctl resume run to continue)"
    typer.echo(
        plain(f"trainingrun/{run} rolled back to step {done.step}; later checkpoints: {later}{where}; {then}")
    )
    if done.resumed:
        ensure_controller(cli.state_url, no_controller)


def register(app: typer.Typer) -> None:
    app.command(
        "fork", help=FORK_HELP, short_help="Start a new run from a run's checkpoint", no_args_is_help=True
    )(fork_command)
    app.command(
        "rollback",
        help=ROLLBACK_HELP,
        short_help="Roll a run back to an earlier checkpoint",
        no_args_is_help=True,
    )(rollback_command)
