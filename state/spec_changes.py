"""Which spec changes a run cannot take, whoever writes them (`apply`, `scale`, a watched folder, the HTTP
store): the store refuses them in the transaction that would write them (ChangeRefused).

Who calls it: SqlStore.apply_run and SqlStore.update_spec, with the run's row as the transaction read it.
Why in the store: the same rule for every client, and checked against the row the write replaces, not one
read earlier. What it must not do: refuse what changes nothing. (A finished run's suspend or resume is
refused here too; `mortalctl suspend/resume` refuse it first with their own message.)
"""

from __future__ import annotations

from typing import Any

from mortal.specs.status import TERMINAL_PHASES
from mortal.state.tables import RunRow


def refused_change(row: RunRow, spec: dict[str, Any]) -> str | None:
    """Why `spec` may not replace `row`'s spec, or None. A finished run takes no change (a relaunch would
    not happen: fork it instead); maxSteps may not go below the step the run has reached (the actor would
    not stop there, and the run would end past its own maxSteps)."""
    if spec == row.spec:
        return None
    name = row.name
    step = int((row.status or {}).get("step") or 0)
    if row.phase in TERMINAL_PHASES:
        return (
            f"trainingrun {name!r} is {row.phase}; a finished run cannot be changed: fork it instead "
            f"(mortalctl fork {name}:step-{step} NEW)"
        )
    wanted = (spec.get("algorithm") or {}).get("maxSteps")
    if isinstance(wanted, int) and 0 < wanted < step:
        return (
            f"spec.algorithm.maxSteps {wanted} is below step {step}, which trainingrun {name!r} has "
            f"reached; set it to {step} or more (or roll the run back: mortalctl rollback {name} --to STEP)"
        )
    return None
