"""What `mortalctl dashboard` shows, read from the store: the runs list and one run's page, as plain dicts.

Who calls it: the dashboard's WSGI app (controller/cli/dashboard.py), once per page or refresh; the
dicts it returns are both the JSON endpoints' bodies and what controller/cli/dashboard_html.py renders.
Cost: one store query per table per refresh, never one per run: the runs list is a single
`list_runs` (phase, step, reward and conditions are in each run's status block); a run's page is one
query each on runs, metrics, events, workers and checkpoints, and two on completions (the steps that
have samples, then the chosen step's samples, sorted once). The reward and loss series are cut from
one `list_metrics` of the whole run, which returns every metric of every step: a small read for runs of
hundreds of steps, a large one per refresh for runs of many thousands (not cached or read incrementally
yet: a resumed actor records earlier steps again, which a read `since_step` would miss).
What it must not do: write. It is handed a `ReadOnlyStore`, which has no write methods to call.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from mortal.controller.cli.completions import completion_dict
from mortal.controller.cli.context import CliError, run_document
from mortal.controller.cli.output import age

if TYPE_CHECKING:
    from mortal.state import RunRow, Store

CURVES = ("reward", "loss")  # the metrics drawn on a run's page, as the actor records them
CONDITION_TYPES = ("Ready", "WeightsInSync", "RewardHealthy", "CheckpointFresh", "Progressing")
EVENTS_SHOWN = 30
DEFAULT_SHOWN = 3  # worst and best completions of the step


class ReadOnlyStore:
    """The read methods of a Store, and nothing else: the dashboard cannot write, whatever its code does."""

    READS = ("get_run", "list_runs", "list_workers", "list_checkpoints", "list_events", "list_metrics",
             "list_completions", "completion_steps")

    def __init__(self, store: Store) -> None:
        self._store = store
        for name in self.READS:
            setattr(self, name, getattr(store, name))

    def close(self) -> None:
        self._store.close()


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat(timespec="seconds") if moment else None


def run_summary(row: RunRow) -> dict[str, Any]:
    """One run as the runs table shows it: name, phase, step/maxSteps, reward, conditions, age."""
    from mortal.specs import SpecError

    base = {"name": row.name, "created": _iso(row.created_at), "age": age(row.created_at)}
    try:
        run = run_document(row)
    except SpecError as err:  # stored by another mortal version: still listed, with what is wrong
        return {**base, "phase": row.phase, "step": None, "maxSteps": None, "reward": None,
                "conditions": [], "error": str(err)}
    s = run.status
    conditions = [{"type": c.type, "status": str(c.status), "reason": c.reason, "message": c.message,
                   "age": age(c.last_transition_time) if c.last_transition_time else None}
                  for c in s.conditions if c.type in CONDITION_TYPES]
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
    """The worst and best `shown` samples of `step` (default: the newest step with samples).

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
    return {"step": chosen, "steps": steps, "samples": len(rows), "unscored": len(rows) - len(scored),
            "worst": [completion_dict(r) for r in scored[:shown]],
            "best": [completion_dict(r) for r in reversed(scored[-shown:])] if scored else []}


def run_view(store: ReadOnlyStore, name: str, step: int | None = None, shown: int = DEFAULT_SHOWN) -> dict[str, Any]:
    """One run's page: its summary, curves, events, workers, checkpoints and a step's completions.

    NotFound for a run that is not there, CliError for a step without samples.
    """
    row = store.get_run(name)
    summary = run_summary(row)
    gpus = summary.get("gpus", {})
    workers = [{"role": w.role, "replica": w.replica, "incarnation": w.incarnation, "state": w.state,
                "gpu": gpus.get(w.role, "-"), "step": w.step, "weightVersion": w.weight_version,
                "heartbeat": age(w.heartbeat_at) if w.heartbeat_at else None, "exitCode": w.exit_code,
                "message": w.message, "handle": w.handle, "age": age(w.started_at)}
               for w in store.list_workers(name)]
    workers.sort(key=lambda w: (w["state"] in ("Succeeded", "Failed", "Lost", "Stopped"), w["role"],
                                w["replica"], -w["incarnation"]))
    return {
        "kind": "RunView",
        "run": summary,
        "curves": curves(store, name),
        "events": [{"type": e.type, "reason": e.reason, "message": e.message, "time": _iso(e.time),
                    "age": age(e.time)} for e in reversed(store.list_events(name, limit=EVENTS_SHOWN))],
        "workers": workers,
        "checkpoints": [{"step": c.step, "weightVersion": c.weight_version, "path": c.path,
                         "created": _iso(c.created_at), "age": age(c.created_at)}
                        for c in reversed(store.list_checkpoints(name))],
        "completions": completions(store, name, step, shown),
    }
