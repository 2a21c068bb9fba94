"""`spec.limits`: a run's budgets (Kubernetes Job's activeDeadlineSeconds, and GPU-hours).

    limits: {maxDuration: 2h, maxGPUHours: 40}

Read by the controller's planner (mortal.controller.budgets decides when one is reached); the run
then writes a final checkpoint and ends Failed with reason DeadlineExceeded or BudgetExceeded.
`Duration` is how the spec writes a span of time: "90s", "30m", "2h", "1d", or plain seconds. Its
normal form (what the store keeps and `get -o yaml` prints) is the largest whole unit, so "120m" and
"2h" are the same spec. Pure: no I/O, nothing of mortal outside mortal.specs.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema

from mortal.specs.base import SpecModel, rule_error

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([dhms]?)\s*$")
DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*[dhms]?\s*$"


def parse_duration(value: Any) -> float:
    """Seconds from "90s", "30m", "2h", "1d", "1.5h" or a plain (int, float or numeric string) count of
    seconds; anything else, zero or negative raises a spec rule error that says what is accepted."""
    if isinstance(value, bool):
        raise rule_error(
            f"must be a duration such as 90s, 30m, 2h or 1d, or seconds as a number (got {value!r})"
        )
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (found := _DURATION.match(value)):
        seconds = float(found.group(1)) * UNITS[found.group(2) or "s"]
    else:
        raise rule_error(
            f"must be a duration such as 90s, 30m, 2h or 1d, or seconds as a number (got {value!r})"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise rule_error(f"must be a positive duration such as 90s, 30m, 2h or 1d (got {value!r})")
    return seconds


def format_duration(seconds: float) -> str:
    """The normal form: the largest unit that divides `seconds` whole ("2h", "90m", "45s", "1.5s")."""
    for unit, size in UNITS.items():
        if seconds >= size and float(seconds / size).is_integer():
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0},
                {"type": "string", "pattern": DURATION_PATTERN},
            ]
        }
    ),
]
"""A span of time: "90s", "30m", "2h", "1d", or seconds as a number; held as seconds (float)."""


class LimitsSpec(SpecModel):
    """Budgets of the run. Reaching one stops it: the actor writes a final checkpoint, and the run
    ends Failed with reason DeadlineExceeded (maxDuration) or BudgetExceeded (maxGPUHours)."""

    max_duration: Duration | None = Field(
        None,
        description="Longest time the run may be active: 90s, 30m, 2h, 1d, or seconds. Counted from its "
        "start, leaving out time while Suspended (Kubernetes Job's activeDeadlineSeconds). Absent: no limit.",
    )
    max_gpu_hours: float | None = Field(
        None,
        gt=0,
        alias="maxGPUHours",
        description="Most GPU-hours the run's workers may use: each worker's wall time x the GPUs it holds "
        "(colocated rollouts share the actor's and add none), summed over every worker the run launched, "
        "relaunches included. A CPU run uses none. Absent: no limit.",
    )
