"""Applying a document (mortal.state.apply_document): read, merge three ways, write over the version read.

A scale or suspend that lands between the read and the write is merged in on a second read, never
overwritten; a run being deleted and a refused change are reported, not retried.
"""

from __future__ import annotations

from typing import Any

import pytest

from mortal.specs import TrainingRun, load_text
from mortal.state import ApplyOutcome, ChangeRefused, Conflict, Store
from mortal.state.apply_document import apply_document

DOC = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata: {name: r, labels: {team: rl}}
spec:
  model: {name: tiny}
  dataset: {name: builtin:arith}
  rewards: [{function: my_rewards:score}]
  algorithm: {maxSteps: 5}
"""


def run_of(text: str = DOC) -> TrainingRun:
    [run] = load_text(text, "run.yaml")
    return run


class ScaledBetweenReadAndWrite:
    """The store as seen by apply_document, with a person's scale landing just before its first write."""

    def __init__(self, store: Store, replicas: int) -> None:
        self.store, self.replicas, self.writes = store, replicas, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def apply_run(self, *args: Any, **kwargs: Any) -> Any:
        self.writes += 1
        if self.writes == 1:
            row = self.store.get_run("r")
            spec = {**row.spec, "rollout": {**row.spec["rollout"], "replicas": self.replicas}}
            self.store.update_spec("r", spec, row.resource_version)
        return self.store.apply_run(*args, **kwargs)


def test_a_scale_between_the_read_and_the_write_is_merged_in_not_overwritten(store: Store) -> None:
    apply_document(store, run_of())
    racing = ScaledBetweenReadAndWrite(store, replicas=5)
    changed = run_of(DOC.replace("maxSteps: 5", "maxSteps: 9"))
    row, outcome = apply_document(racing, changed)  # type: ignore[arg-type]
    assert racing.writes == 2, "the first write met the scale's version and was made again"
    assert outcome is ApplyOutcome.configured
    assert (row.spec["rollout"]["replicas"], row.spec["algorithm"]["maxSteps"]) == (5, 9)


def test_the_first_apply_creates_and_the_same_document_again_changes_nothing(store: Store) -> None:
    row, outcome = apply_document(store, run_of())
    assert outcome is ApplyOutcome.created and row.labels == {"team": "rl"}
    assert row.applied == run_of().applied_config()
    assert apply_document(store, run_of())[1] is ApplyOutcome.unchanged


def test_a_run_being_deleted_and_a_refused_change_are_raised_at_once(store: Store) -> None:
    apply_document(store, run_of())
    store.mark_deleted("r")
    with pytest.raises(Conflict, match="being deleted"):
        apply_document(store, run_of())
    done = DOC.replace("name: r,", "name: done,")
    apply_document(store, run_of(done))
    row = store.get_run("done")
    store.write_status("done", {**row.status, "phase": "Succeeded"}, row.resource_version)
    with pytest.raises(ChangeRefused):
        apply_document(store, run_of(done.replace("maxSteps: 5", "maxSteps: 6")))


def test_a_dry_run_is_decided_by_the_store_and_writes_nothing(store: Store) -> None:
    """As kubectl's --dry-run=server: the store's own checks and outcome, its transaction rolled back."""
    row, outcome = apply_document(store, run_of(), dry_run=True)
    assert (outcome, row.name, row.spec["algorithm"]["maxSteps"]) == (ApplyOutcome.created, "r", 5)
    assert store.list_runs() == []
    live, _ = apply_document(store, run_of())
    changed = run_of(DOC.replace("maxSteps: 5", "maxSteps: 9"))
    row, outcome = apply_document(store, changed, dry_run=True)
    assert (outcome, row.spec["algorithm"]["maxSteps"], row.generation) == (ApplyOutcome.configured, 9, 2)
    after = store.get_run("r")
    assert (after.resource_version, after.spec) == (live.resource_version, live.spec)
    assert apply_document(store, run_of(), dry_run=True)[1] is ApplyOutcome.unchanged
    row = store.get_run("r")
    store.write_status("r", {**row.status, "phase": "Succeeded"}, row.resource_version)
    with pytest.raises(ChangeRefused):
        apply_document(store, changed, dry_run=True)
    store.mark_deleted("r")
    with pytest.raises(Conflict, match="being deleted"):
        apply_document(store, run_of(), dry_run=True)


def test_a_document_of_another_run_of_the_name_or_an_older_spec_is_refused_when_it_would_change_it(
    store: Store,
) -> None:
    """The uid and generation a document was read at (`get -o yaml` writes them) are checked only when
    applying it would change the run: a stale document applied again unchanged is let be."""
    from mortal.state import StaleDocument

    row, _ = apply_document(store, run_of())
    read = DOC.replace("metadata: {name: r,", f"metadata: {{name: r, uid: {row.uid}, generation: 1,")
    apply_document(store, run_of(read.replace("maxSteps: 5", "maxSteps: 6")))  # generation 1 -> 2
    with pytest.raises(StaleDocument, match=r"metadata.generation 1, now 2"):
        apply_document(store, run_of(read.replace("maxSteps: 5", "maxSteps: 7")))
    assert (
        apply_document(store, run_of(read.replace("maxSteps: 5", "maxSteps: 6")))[1] is ApplyOutcome.unchanged
    )
    other = read.replace(row.uid, "0" * 8 + row.uid[8:]).replace("generation: 1", "generation: 2")
    with pytest.raises(StaleDocument, match="an earlier run of this name"):
        apply_document(store, run_of(other.replace("maxSteps: 5", "maxSteps: 8")))
    assert store.get_run("r").spec["algorithm"]["maxSteps"] == 6
