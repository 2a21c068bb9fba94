"""What every mortalctl verb shares (mortal.client.cli.context)."""

from __future__ import annotations

from mortal.client.cli.context import TERMINAL_PHASES
from mortal.specs import TERMINAL_PHASES as SPEC_TERMINAL_PHASES


def test_the_cli_s_finished_phases_are_the_specs() -> None:
    """Spelled out in the CLI (it imports mortal.specs lazily); a phase added to the spec must reach it."""
    assert TERMINAL_PHASES == SPEC_TERMINAL_PHASES
