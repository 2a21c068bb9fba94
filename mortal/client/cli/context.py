"""What every mortalctl verb shares: the global options, the store and user errors.

Called by the verb modules through `state(ctx)`; `main.py` builds the `CliState` from the global
options. The store is opened on first use (so `--help` and `schema` never connect), and only
mortal.state, mortal.specs and mortal.controller entry points are imported here, lazily: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import typer

from mortal.client.errors import ClientError

if TYPE_CHECKING:
    from mortal.specs import TrainingRun
    from mortal.state import RunRow, Store

# mortal.specs.TERMINAL_PHASES, spelled out: this module imports mortal.specs (pydantic) only lazily, so
# that --help starts fast; tests/client/cli/test_cli_context.py holds the two equal.
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


class CliError(ClientError):
    """A user error found by the command line's own modules (mortal.client.errors has the rest): exit 1."""


@dataclass
class CliState:
    """The global options of one mortalctl invocation, and the store it opened."""

    debug: bool = False
    state_url: str | None = None
    _store: Store | None = field(default=None, repr=False)

    @property
    def store(self) -> Store:
        if self._store is None:
            from mortal.state import open_store

            self._store = open_store(self.state_url)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def state(ctx: typer.Context) -> CliState:
    """The CliState of this invocation (a default one when a verb is invoked on its own, as in tests)."""
    root = ctx.find_root()
    if not isinstance(root.obj, CliState):
        root.obj = CliState()
        root.call_on_close(root.obj.close)
    return root.obj


def run_document(row: RunRow) -> TrainingRun:
    """A stored run as the TrainingRun document `get -o yaml` prints and `apply` reads back."""
    return row.document()


def parse_selector(selector: str | None) -> dict[str, str]:
    """`-l team=rl,tier=a` -> {'team': 'rl', 'tier': 'a'} (equality selectors only, kubectl's simplest
    form)."""
    if not selector:
        return {}
    labels: dict[str, str] = {}
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        key, value = key.strip(), value.strip().removeprefix("=")
        if not sep or not key:
            raise typer.BadParameter(f"{term!r} is not key=value; use e.g. -l team=rl", param_hint="'-l'")
        labels[key] = value
    return labels


def modify_spec(
    store: Store, name: str, change: Callable[[RunRow], dict | None], retries: int = 5
) -> tuple[RunRow, RunRow]:
    """Read-modify-write of a run's spec: `change(row)` returns the new spec (None = nothing to do).

    The write is a compare-and-swap on resource_version; on Conflict the run is read again and
    `change` re-applied, a few times. Returns (before, after); after is before when nothing changed.
    """
    from mortal.state import ChangeRefused, Conflict

    for attempt in range(retries):
        row = store.get_run(name)
        if row.deleted_at is not None:
            raise CliError(f"trainingrun {name!r} is being deleted")
        spec = change(row)
        if spec is None or spec == row.spec:
            return row, row
        try:
            return row, store.update_spec(name, spec, row.resource_version)
        except ChangeRefused as exc:  # not a race: reading again would not help
            raise CliError(str(exc)) from None
        except Conflict:
            if attempt == retries - 1:
                raise
    raise AssertionError("unreachable")
