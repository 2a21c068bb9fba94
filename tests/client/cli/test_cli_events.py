"""Event lines (mortal.client.cli.events): a reason repeated in a row is one line, with kubectl's count."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from clihelpers import QUICKSTART

from mortal.client.cli import events
from mortal.client.cli.events import fold, newest_lines
from mortal.state import open_store

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def event(
    reason: str, minute: int, run: str = "r", type: str = "Normal", message: str = ""
) -> SimpleNamespace:
    return SimpleNamespace(
        run=run,
        type=type,
        reason=reason,
        message=message or f"{reason} at {minute}",
        time=T0 + timedelta(minutes=minute),
    )


def test_repeats_in_a_row_fold_into_their_newest_with_a_count() -> None:
    stored = [event("Launched", 0), *(event("CheckpointSaved", m) for m in range(1, 11)), event("Scaled", 11)]
    lines = fold(stored, shown=50)
    assert [(e.reason, e.count) for e in lines] == [("Launched", 1), ("CheckpointSaved", 10), ("Scaled", 1)]
    saved = lines[1]
    assert (saved.message, saved.first_time, saved.time) == (
        "CheckpointSaved at 10",
        T0 + timedelta(minutes=1),
        T0 + timedelta(minutes=10),
    )
    assert saved.last_seen(now=T0 + timedelta(minutes=12)) == "2m (x10 over 11m)"
    assert lines[0].last_seen(now=T0 + timedelta(minutes=12)) == "12m"


def test_a_line_whose_repeats_said_different_things_says_so_as_kubectl_does() -> None:
    same = [event("RewardFailed", m, type="Warning", message="accuracy raised KeyError") for m in range(3)]
    differing = [*same, event("RewardFailed", 3, type="Warning", message="length raised ValueError")]
    [alike] = fold(same, shown=50)
    assert (alike.count, alike.shown_message) == (3, "accuracy raised KeyError")
    [mixed] = fold(differing, shown=50)
    assert mixed.count == 4
    assert mixed.shown_message == "(combined from similar events): length raised ValueError"


def test_only_the_same_run_type_and_reason_in_a_row_fold() -> None:
    stored = [
        event("Restarted", 0, type="Warning"),
        event("Restarted", 1),
        event("Restarted", 2, run="other"),
        event("Lagging", 3),
        event("Restarted", 4),
    ]
    assert [e.count for e in fold(stored, shown=50)] == [1, 1, 1, 1, 1]


def test_the_newest_lines_are_kept() -> None:
    stored = [event(f"R{i}", i) for i in range(5)]
    assert [e.reason for e in fold(stored, shown=2)] == ["R3", "R4"]


class StoredEvents:
    """A store's list_events over a list, with ids, paging back as the Store contract says."""

    def __init__(self, stored: list[SimpleNamespace]) -> None:
        self.stored = [SimpleNamespace(**vars(e), id=i + 1) for i, e in enumerate(stored)]
        self.reads = 0

    def list_events(self, run, limit=50, before_id=None):
        self.reads += 1
        older = [e for e in self.stored if before_id is None or e.id < before_id]
        return older[-limit:]


def test_pages_are_read_back_until_the_oldest_line_shown_is_whole(monkeypatch) -> None:
    monkeypatch.setattr(events, "EVENT_PAGE", 4)
    store = StoredEvents(
        [event("Old", 0), event("Launched", 1), *(event("CheckpointSaved", m) for m in range(2, 12))]
    )
    lines = newest_lines(store, "r", shown=2)
    assert [(e.reason, e.count) for e in lines] == [("Launched", 1), ("CheckpointSaved", 10)]
    assert store.reads == 3, "the page holding Old, before Launched, says Launched is whole"


def test_a_count_cut_short_by_the_reading_limit_says_it_is_a_lower_bound(monkeypatch) -> None:
    monkeypatch.setattr(events, "EVENT_PAGE", 4)
    monkeypatch.setattr(events, "EVENTS_READ_AT_MOST", 8)
    store = StoredEvents([event("CheckpointSaved", m) for m in range(20)])
    [line] = newest_lines(store, "r", shown=5)
    assert (line.count, line.at_least) == (8, True)
    assert "(x8+ over " in line.last_seen(now=T0 + timedelta(hours=1))


def test_get_events_keeps_a_rare_event_in_view_behind_many_repeats(cli, store_url) -> None:
    """A fast run's checkpoints no longer push its Launched out of the listing; -o json lists every event."""
    cli("apply", "-f", str(QUICKSTART))
    store = open_store(store_url)
    try:
        store.add_event("quickstart", "Normal", "Launched", "launched actor-0")
        for step in range(1, 61):
            store.add_event("quickstart", "Normal", "CheckpointSaved", f"checkpoint step {step} saved")
    finally:
        store.close()
    lines = cli("get", "events", "quickstart", "--limit", "2").stdout.splitlines()
    assert len(lines) == 3 and "Launched" in lines[1]
    assert "(x60 over " in lines[2] and "checkpoint step 60 saved" in lines[2]
    items = json.loads(cli("get", "events", "quickstart", "--limit", "2", "-o", "json").stdout)["items"]
    assert [e["message"] for e in items] == ["checkpoint step 59 saved", "checkpoint step 60 saved"]
    described = cli("describe", "run", "quickstart").stdout
    assert "launched actor-0" in described and "(x60 over " in described
