"""Events as `get events` and `describe` list them: a reason repeated in a row is one line, with its count.

Who calls it: mortal/client/cli/get.py and describe.py, on the events the store returns (oldest first).
Why: a fast run saves a checkpoint or lags a rollout every few seconds, and those events pushed the rare
ones (Launched, Scaled, Restarted) out of the newest few that a listing shows. kubectl shows such repeats
as one line, "3m (x12 over 10m)"; so do we. A line whose repeats said different things shows the newest
message after kubectl's "(combined from similar events): ", so that a user knows older ones differ;
-o yaml/json lists the events themselves, unfolded.
`fold` is pure; `newest_lines` reads the store's events page by page, back only as far as it must.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from mortal.client.cli.output import age

if TYPE_CHECKING:
    from mortal.state import Store

EVENT_PAGE = 500  # events read from the store at a time, newest first, until the lines shown are whole
EVENTS_READ_AT_MOST = 20_000  # beyond it, the oldest line's count is a lower bound ("x500+")
COMBINED_PREFIX = "(combined from similar events): "  # kubectl's words, so that users know them


@dataclass(frozen=True)
class FoldedEvent:
    """One line: the newest of `count` events in a row of one run with one type and reason."""

    run: str
    type: str
    reason: str
    message: str
    first_time: datetime | None
    time: datetime | None
    count: int
    at_least: bool = False  # reading stopped inside this line's repeats: `count` is a lower bound
    combined: bool = False  # the repeats' messages were not all the same: `message` is the newest's

    @property
    def shown_message(self) -> str:
        """The message a listing prints: kubectl's prefix when older repeats said something else."""
        return f"{COMBINED_PREFIX}{self.message}" if self.combined else self.message

    def last_seen(self, now: datetime | None = None) -> str:
        """kubectl's LAST SEEN: the newest event's age, and for a repeat "(xN over AGE)" of the first."""
        newest = age(self.time, now)
        if self.count == 1:
            return newest
        count = f"{self.count}+" if self.at_least else str(self.count)
        return f"{newest} (x{count} over {age(self.first_time, now)})"


def fold(events: Sequence[Any], shown: int) -> list[FoldedEvent]:
    """The newest `shown` lines of `events` (oldest first, as EventRow), repeats in a row folded."""
    lines: list[FoldedEvent] = []
    for event in events:
        last = lines[-1] if lines else None
        if last is not None and (last.run, last.type, last.reason) == (event.run, event.type, event.reason):
            lines[-1] = replace(
                last,
                message=event.message,
                time=event.time,
                count=last.count + 1,
                combined=last.combined or event.message != last.message,
            )
        else:
            lines.append(
                FoldedEvent(event.run, event.type, event.reason, event.message, event.time, event.time, 1)
            )
    return lines[-shown:] if shown > 0 else []


def newest_lines(store: Store, run: str | None, shown: int) -> list[FoldedEvent]:
    """The newest `shown` lines of a run's events (all runs' with None), each with every repeat counted:
    pages are read back until a line older than those shown begins, or EVENTS_READ_AT_MOST were read."""
    stored: list[Any] = []
    while True:
        before = stored[0].id if stored else None
        page = store.list_events(run, limit=EVENT_PAGE, before_id=before)
        stored = page + stored
        lines = fold(stored, shown + 1)
        if len(page) < EVENT_PAGE or len(lines) > shown:
            return lines[-shown:] if shown > 0 else []
        if len(stored) >= EVENTS_READ_AT_MOST:  # every line read is shown; the oldest may go on further back
            return [replace(lines[0], at_least=True), *lines[1:]]
