"""Apply a TrainingRun document to the store: read the live run, merge three ways, write if it has not moved.

Who calls it: `mortalctl apply` (mortal.client.apply), the watched folder (mortal.controller.watchdir) and
MortalTrainer. The merge is mortal.specs.three_way_merge's; this is its read-merge-write against the store,
as a Kubernetes client's update is:
1. read the run (none: it is created),
2. merge the document over its spec (the fields the document sets win; a scale or suspend made since the
   last apply stays),
3. write, carrying the resource_version merged against; a Conflict means something wrote in between (a
   scale, a suspend, the controller's status), so read and merge again, a few times at most.

It must not retry a refusal (ChangeRefused: a finished run, a maxSteps below the step reached), a document
read from an earlier state of the run (StaleDocument: `get -o yaml` kept while the run was scaled), or a run
being deleted: those are the caller's to report.
"""

from __future__ import annotations

from typing import Any

from mortal.specs.run import TrainingRun
from mortal.state.errors import ChangeRefused, Conflict, NotFound, StaleDocument
from mortal.state.store import ApplyOutcome, Store
from mortal.state.tables import RunRow

# Writes that may land between a read and a write are a person's scale or suspend and the controller's
# status writes; each retry re-reads, so only a store written without pause exhausts these.
MERGE_ATTEMPTS = 8


def merged_spec(run: TrainingRun, live: RunRow | None) -> dict[str, Any]:
    """The spec applying `run` writes over `live` (None: no such run), in normal form."""
    if live is None:
        return run.spec_dict()
    return run.applied_spec(live.spec, live.applied)


def apply_document(
    store: Store,
    run: TrainingRun,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    dry_run: bool = False,
) -> tuple[RunRow, ApplyOutcome]:
    """Create or update `run` (its own labels and annotations unless given); SpecError when a field kept
    from the live run does not fit the document's, Conflict when the run is being deleted. `dry_run`: the
    store decides and checks everything and writes nothing (Store.apply_run)."""
    labels = run.metadata.labels if labels is None else labels
    annotations = run.metadata.annotations if annotations is None else annotations
    live = _live_row(store, run.name)
    merged = merged_spec(run, live)
    if live is not None:
        refuse_stale(run, live, merged)
    for attempt in range(1, MERGE_ATTEMPTS + 1):
        try:
            return store.apply_run(
                run.name,
                merged,
                labels=labels,
                annotations=annotations,
                applied=run.applied_config(),
                resource_version=0 if live is None else live.resource_version,
                dry_run=dry_run,
            )
        except ChangeRefused:
            raise
        except Conflict:  # the run as it is now: merged against on the next attempt
            live = _live_row(store, run.name)
            if attempt == MERGE_ATTEMPTS or (live is not None and live.deleted_at is not None):
                raise
            merged = merged_spec(run, live)
    raise AssertionError("unreachable: the last attempt returns or raises")


def refuse_stale(run: TrainingRun, live: RunRow, merged: dict[str, Any]) -> None:
    """StaleDocument when the document would change the run's spec and says which run and spec it was read
    from (the uid and generation `get -o yaml` writes) while the live run is another or its spec changed
    since, as kubectl refuses an object modified since it was read. A document that does not say (a file
    written by hand) is merged, and one that changes nothing (applied again) is let be."""
    meta = run.metadata
    if merged == live.spec:
        return
    if meta.uid is not None and meta.uid != live.uid:
        raise StaleDocument(
            f"trainingrun/{run.name}: the document is of an earlier run of this name (metadata.uid "
            f"{meta.uid}; the run now is {live.uid}): remove metadata.uid to apply it to this run"
        )
    if meta.generation is not None and meta.generation != live.generation:
        raise StaleDocument(
            f"trainingrun/{run.name} has changed since the document was read (metadata.generation "
            f"{meta.generation}, now {live.generation}: a scale, suspend or apply since): get it again "
            "(`mortalctl get runs NAME -o yaml`), or remove metadata.generation to apply over the changes"
        )


def _live_row(store: Store, name: str) -> RunRow | None:
    try:
        return store.get_run(name)
    except NotFound:
        return None
