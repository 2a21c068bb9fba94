"""`mortalctl scale [NAME] rollout=N [actor=N]`: change a run's worker counts, like `kubectl scale`.

A read-modify-write of the spec (`context.modify_spec`: compare-and-swap on resource_version,
re-read and retried on Conflict); `--current-replicas` is kubectl's precondition. Without NAME the
one active run is scaled; with several active runs it is an error that lists them. The new spec is
validated (a count the spec refuses, with the spec's own message) before it is written. Rollouts are
scaled live; the actor's ranks (actor.count) are read when the actor starts, which the command says.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import typer

from mortal.client.cli.context import (
    TERMINAL_PHASES,
    CliError,
    modify_spec,
    state,
)
from mortal.client.cli.text import plain
from mortal.client.local_controller import ensure_controller, wake_controller

if TYPE_CHECKING:
    from mortal.state import RunRow, Store

ROLES = {"rollout": ("rollout", "replicas"), "actor": ("actor", "count")}
"""role -> (spec block, field) holding its worker count."""

HELP = """Set the number of workers of a run's roles.

ROLE=N sets rollout (generation workers, scaled live; 0 pauses generation) or actor (its ranks,
actor.count: taken when the actor next starts, e.g. after suspend and resume).
Without NAME, the only active (not Succeeded/Failed) run is scaled.

\b
Examples:
  # Scale the quickstart run to 4 rollout workers
  mortalctl scale quickstart rollout=4
\b
  # The same when quickstart is the only active run
  mortalctl scale rollout=4
\b
  # Only if it currently has 2 (otherwise fail)
  mortalctl scale quickstart rollout=4 --current-replicas=2
"""


def parse_args(args: list[str], replicas: int | None) -> tuple[str | None, dict[str, int]]:
    """['quickstart', 'rollout=4'] -> ('quickstart', {'rollout': 4}); usage errors exit 2."""
    name: str | None = None
    counts: dict[str, int] = {}
    for arg in args:
        role, sep, value = arg.partition("=")
        if not sep:
            if name is not None:
                raise typer.BadParameter(f"two run names given ({name!r}, {arg!r}); scale one run at a time")
            name = arg.split("/", 1)[1] if arg.startswith(("trainingrun/", "run/", "tr/")) else arg
            continue
        if role not in ROLES:
            raise typer.BadParameter(f"unknown role {role!r} in {arg!r}; use rollout=N or actor=N")
        if not value.isdigit():
            raise typer.BadParameter(f"{arg!r}: the count must be a whole number >= 0")
        counts[role] = int(value)
    if replicas is not None:
        counts.setdefault("rollout", replicas)
    if not counts:
        raise typer.BadParameter("say what to scale, e.g. rollout=4 (or --replicas=4)")
    return name, counts


def active_run(store: Store) -> str:
    """The single run that is neither finished nor being deleted; an error listing them otherwise."""
    active = [r for r in store.list_runs(include_deleted=False) if r.phase not in TERMINAL_PHASES]
    if len(active) == 1:
        return active[0].name
    if not active:
        raise CliError("no active run to scale; name one: mortalctl scale NAME rollout=N")
    names = ", ".join(r.name for r in active)
    raise CliError(
        f"{len(active)} runs are active ({names}); name the one to scale: mortalctl scale NAME rollout=N"
    )


def current_count(row: RunRow, role: str) -> int:
    block, key = ROLES[role]
    return int(row.spec[block][key])


def scaled_spec(row: RunRow, counts: dict[str, int]) -> dict:
    """The row's spec with new counts, validated and normalized (SpecError if the spec refuses them)."""
    from mortal.specs import TrainingRun

    spec = copy.deepcopy(row.spec)
    for role, count in counts.items():
        block, key = ROLES[role]
        spec.setdefault(block, {})[key] = count
    return TrainingRun.from_record(row.name, spec).spec_dict()


def scale_run(store: Store, name: str, counts: dict[str, int], expect: int | None) -> tuple[RunRow, RunRow]:
    """Write the new counts (compare-and-swap, retried on Conflict); returns (before, after)."""

    def change(row: RunRow) -> dict:
        if expect is not None:
            role = next(iter(counts)) if len(counts) == 1 else "rollout"
            if current_count(row, role) != expect:
                raise CliError(
                    f"precondition failed: trainingrun/{name} has {role}={current_count(row, role)}, "
                    f"not --current-replicas={expect}"
                )
        return scaled_spec(row, counts)

    return modify_spec(store, name, change)


def scale_command(
    ctx: typer.Context,
    args: list[str] = typer.Argument(..., metavar="[NAME] ROLE=N", help="Run name (optional) and counts."),
    replicas: int | None = typer.Option(None, "--replicas", min=0, help="Shorthand for rollout=N."),
    current_replicas: int | None = typer.Option(
        None, "--current-replicas", min=0, help="Precondition: fail unless the role currently has this many."
    ),
    no_controller: bool = typer.Option(
        False, "--no-controller", help="Do not start a background controller."
    ),
) -> None:
    name, counts = parse_args(args, replicas)
    store = state(ctx).store
    name = name or active_run(store)
    before, after = scale_run(store, name, counts, current_replicas)
    change = ", ".join(
        f"{role}: {current_count(before, role)} -> {current_count(after, role)}" for role in counts
    )
    if after.resource_version == before.resource_version:
        typer.echo(plain(f"trainingrun/{name} unchanged ({change})"))
        return
    typer.echo(plain(f"trainingrun/{name} scaled ({change})"))
    if "actor" in counts and current_count(before, "actor") != current_count(after, "actor"):
        typer.echo(
            plain(
                f"note: the actor reads actor.count when it starts: trainingrun/{name} trains with "
                f"{current_count(after, 'actor')} ranks from its next start (mortalctl suspend {name}, "
                "then resume: from the newest checkpoint)"
            ),
            err=True,
        )
    wake_controller(name)
    ensure_controller(state(ctx).state_url, no_controller)


def register(app: typer.Typer) -> None:
    app.command("scale", help=HELP, short_help="Change how many workers a run has", no_args_is_help=True)(
        scale_command
    )
