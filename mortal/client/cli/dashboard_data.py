"""What `mortalctl dashboard` shows, read from the store: the runs list and one run's page, as plain dicts.

The dicts are both the JSON endpoints' bodies and what dashboard_html.py renders. A refresh makes one
store query per table, never one per run. A run's metrics are read whole each time: a resumed actor
records earlier steps again, which a read `since_step` would miss. A text longer than TEXT_SHOWN is
cut with a marker naming the endpoint that returns it whole (`full_item`), so a refresh stays small.
What it must not do: write. It is handed a `ReadOnlyStore`, which has no write methods to call.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from mortal.client.cli.completions import completion_dict
from mortal.client.cli.context import CliError, run_document
from mortal.client.cli.output import age

if TYPE_CHECKING:
    from mortal.state import CheckpointRow, CompletionRow, EventRow, RunRow, Store

CURVES = ("reward", "loss")  # the metrics drawn on a run's page, as the actor records them
CONDITION_TYPES = ("Ready", "WeightsInSync", "RewardHealthy", "CheckpointFresh", "Progressing")
EVENTS_SHOWN = 30
DEFAULT_SHOWN = 3  # worst and best completions of the step
TEXT_SHOWN = 2000  # characters of one text in a page or refresh; the full_item endpoints have all of it
CUT = "… [cut: {total} characters in all; the full text: {url}]"


class ReadOnlyStore:
    """The read methods of a Store, and nothing else: the dashboard cannot write, whatever its code does."""

    READS = (
        "get_run",
        "list_runs",
        "list_workers",
        "list_checkpoints",
        "list_events",
        "list_metrics",
        "list_completions",
        "completion_steps",
    )

    def __init__(self, store: Store) -> None:
        self._store = store
        for name in self.READS:
            setattr(self, name, getattr(store, name))

    def close(self) -> None:
        self._store.close()


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat(timespec="seconds") if moment else None


def cut(text: str | None, url: str) -> str | None:
    """`text` if short, else its start and a marker saying how long it is and where the whole of it is."""
    if text is None or len(text) <= TEXT_SHOWN:
        return text
    return text[:TEXT_SHOWN] + CUT.format(total=f"{len(text):,}", url=url)


def api_url(run: str, *parts: Any) -> str:
    from urllib.parse import quote

    return "/api/runs/" + "/".join(quote(str(p), safe="") for p in (run, *parts))


def run_summary(row: RunRow) -> dict[str, Any]:
    """One run as the runs table shows it: name, phase, step/maxSteps, reward, conditions, age (texts cut)."""
    whole = summary_whole(row)
    url = api_url(row.name, "status")
    for condition in whole["conditions"]:
        condition["reason"], condition["message"] = (
            cut(condition["reason"], url),
            cut(condition["message"], url),
        )
    for key in ("message", "error"):
        if key in whole:
            whole[key] = cut(whole[key], url)
    return whole


def summary_whole(row: RunRow) -> dict[str, Any]:
    """run_summary with every text whole (what /api/runs/NAME/status returns)."""
    from mortal.specs import SpecError

    base = {"name": row.name, "created": _iso(row.created_at), "age": age(row.created_at)}
    try:
        run = run_document(row)
    except SpecError as err:  # stored by another mortal version: still listed, with what is wrong
        return {
            **base,
            "phase": row.phase,
            "step": None,
            "maxSteps": None,
            "reward": None,
            "conditions": [],
            "error": str(err),
        }
    s = run.status
    conditions = [
        {
            "type": c.type,
            "status": str(c.status),
            "reason": c.reason,
            "message": c.message,
            "age": age(c.last_transition_time) if c.last_transition_time else None,
        }
        for c in s.conditions
        if c.type in CONDITION_TYPES
    ]
    conditions.sort(key=lambda c: CONDITION_TYPES.index(c["type"]))
    return {
        **base,
        "phase": "Terminating" if row.deleted_at is not None else str(s.phase),
        "step": s.step,
        "maxSteps": run.spec.algorithm.max_steps,
        "reward": s.reward,
        "weightVersion": s.weight_version,
        "restarts": s.restarts,
        "message": s.message,
        "model": run.spec.model.name,
        "backend": run.spec.backend,
        "gpus": {"actor": run.spec.actor.gpu, "rollout": run.spec.rollout.gpu},
        "conditions": conditions,
    }


def runs_view(store: ReadOnlyStore) -> dict[str, Any]:
    """Every run, by name (one `list_runs`)."""
    return {"kind": "RunList", "items": [run_summary(row) for row in store.list_runs()]}


def curves(store: ReadOnlyStore, run: str) -> dict[str, list[list[float]]]:
    """{name: [[step, value], ...]} of the CURVES recorded, steps ascending (one `list_metrics`)."""
    series: dict[str, list[list[float]]] = {name: [] for name in CURVES}
    for row in store.list_metrics(run):
        if row.name in series:
            series[row.name].append([row.step, row.value])
    return series


def completions(store: ReadOnlyStore, run: str, step: int | None, shown: int) -> dict[str, Any]:
    """The worst and best `shown` samples of `step` (default: the newest step with samples), texts cut.

    CliError when `step` has no samples. The worst are lowest total reward first, the best highest
    first, unscored samples in neither (they are counted).
    """
    from mortal.state import CompletionOrder

    steps = store.completion_steps(run)
    if step is not None and step not in steps:
        raise CliError(f"trainingrun/{run} has no completions at step {step}")
    chosen = step if step is not None else (steps[-1] if steps else None)
    rows = [] if chosen is None else store.list_completions(run, chosen, order=CompletionOrder.worst)
    scored = [r for r in rows if r.reward is not None]
    return {
        "step": chosen,
        "steps": steps,
        "samples": len(rows),
        "unscored": len(rows) - len(scored),
        "worst": [_sample(run, r) for r in scored[:shown]],
        "best": [_sample(run, r) for r in reversed(scored[-shown:])] if scored else [],
    }


def _sample(run: str, row: CompletionRow) -> dict[str, Any]:
    whole = completion_dict(row)
    url = api_url(run, "completions", row.step, row.sample)
    return {**whole, "prompt": cut(whole["prompt"], url), "completion": cut(whole["completion"], url)}


def _event(run: str, e: EventRow) -> dict[str, Any]:
    url = api_url(run, "events", e.id)
    return {
        "id": e.id,
        "type": e.type,
        "reason": cut(e.reason, url),
        "message": cut(e.message, url),
        "time": _iso(e.time),
        "age": age(e.time),
    }


def _checkpoint(run: str, c: CheckpointRow) -> dict[str, Any]:
    return {
        "step": c.step,
        "weightVersion": c.weight_version,
        "path": cut(c.path, api_url(run, "checkpoints", c.step)),
        "created": _iso(c.created_at),
        "age": age(c.created_at),
    }


def run_view(
    store: ReadOnlyStore, name: str, step: int | None = None, shown: int = DEFAULT_SHOWN
) -> dict[str, Any]:
    """One run's page: its summary, curves, events, workers, checkpoints and a step's completions.

    NotFound for a run that is not there, CliError for a step without samples.
    """
    row = store.get_run(name)
    summary = run_summary(row)
    gpus = summary.get("gpus", {})
    workers = [
        {
            "id": w.id,
            "role": w.role,
            "replica": w.replica,
            "incarnation": w.incarnation,
            "state": w.state,
            "gpu": gpus.get(w.role, "-"),
            "step": w.step,
            "weightVersion": w.weight_version,
            "heartbeat": age(w.heartbeat_at) if w.heartbeat_at else None,
            "exitCode": w.exit_code,
            "message": cut(w.message, api_url(name, "workers", w.id)),
            "handle": cut(w.handle, api_url(name, "workers", w.id)),
            "age": age(w.started_at),
        }
        for w in store.list_workers(name)
    ]
    workers.sort(
        key=lambda w: (
            w["state"] in ("Succeeded", "Failed", "Lost", "Stopped"),
            w["role"],
            w["replica"],
            -w["incarnation"],
        )
    )
    return {
        "kind": "RunView",
        "run": summary,
        "curves": curves(store, name),
        "events": [_event(name, e) for e in reversed(store.list_events(name, limit=EVENTS_SHOWN))],
        "workers": workers,
        "checkpoints": [_checkpoint(name, c) for c in reversed(store.list_checkpoints(name))],
        "completions": completions(store, name, step, shown),
    }


def full_item(store: ReadOnlyStore, name: str, kind: str, key: list[str]) -> dict[str, Any]:
    """One item of a run's page with its texts whole: what a cut text's marker points to.

    kind/key: status; events/ID (among the EVENTS_SHOWN newest, what the page shows); workers/ID;
    checkpoints/STEP; completions/STEP/SAMPLE. NotFound (a 404) for anything else."""
    from mortal.state import NotFound

    row = store.get_run(name)
    found: Any = None
    if kind == "status" and not key:
        found = summary_whole(row)
    elif kind == "events" and len(key) == 1:
        found = next(
            (
                {"id": e.id, "type": e.type, "reason": e.reason, "message": e.message, "time": _iso(e.time)}
                for e in store.list_events(name, limit=EVENTS_SHOWN)
                if str(e.id) == key[0]
            ),
            None,
        )
    elif kind == "workers" and len(key) == 1:
        found = next(
            (
                {
                    "id": w.id,
                    "role": w.role,
                    "replica": w.replica,
                    "incarnation": w.incarnation,
                    "state": w.state,
                    "message": w.message,
                    "handle": w.handle,
                }
                for w in store.list_workers(name)
                if str(w.id) == key[0]
            ),
            None,
        )
    elif kind == "checkpoints" and len(key) == 1:
        found = next(
            (
                {
                    "step": c.step,
                    "weightVersion": c.weight_version,
                    "path": c.path,
                    "created": _iso(c.created_at),
                }
                for c in store.list_checkpoints(name)
                if str(c.step) == key[0]
            ),
            None,
        )
    elif (
        kind == "completions"
        and len(key) == 2
        and key[0].isdigit()
        and int(key[0]) in store.completion_steps(name)
    ):
        found = next(
            (
                completion_dict(c)
                for c in store.list_completions(name, int(key[0]))
                if str(c.sample) == key[1]
            ),
            None,
        )
    if found is None:
        raise NotFound(
            f"trainingrun/{name} has no {'/'.join([kind, *key])} here (events: the {EVENTS_SHOWN} newest)"
        )
    return found
