"""`mortalctl get runs|events|checkpoints|completions|metrics`: list what the store holds, as a table or as documents.

`get runs` prints NAME PHASE STEP WEIGHTS CKPT ROLLOUT REWARD AGE (`-o wide` adds more, ending with
the training conditions that are False), or the
runs as YAML/JSON that `apply -f -` reads back, and with `-w` keeps reprinting as they change. Only
reads the store. Resource names accept kubectl's singular, plural and short forms. A step's sampled
completions and a run's metrics have modules of their own (completions.py, metrics.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import typer
from rich.live import Live

from mortal.controller.cli import completions, metrics
from mortal.controller.cli.context import parse_selector, run_document, state
from mortal.controller.cli.output import (
    OUTPUT_FORMATS,
    age,
    console,
    fmt_float,
    print_renderable,
    print_table,
    table,
    to_json,
    to_yaml,
)

if TYPE_CHECKING:
    from mortal.state import RunRow, Store

RUN_ALIASES = ("runs", "run", "trainingruns", "trainingrun", "tr")
RUN_HEADERS = ("NAME", "PHASE", "STEP", "WEIGHTS", "CKPT", "ROLLOUT", "REWARD", "AGE")
WIDE_HEADERS = ("ACTOR", "RESTARTS", "GENERATION", "LOSS", "BACKEND", "MODEL", "CONDITIONS")
TRAINING_CONDITIONS = ("WeightsInSync", "RewardHealthy", "CheckpointFresh", "Progressing", "DeadlinesMet", "MemoryFits")

HELP = """Display one or many resources: runs, events, checkpoints, completions, metrics.

\b
Examples:
  # List all runs
  mortalctl get runs
\b
  # One run, with more columns, as YAML, or selected by label
  mortalctl get run quickstart -o wide
  mortalctl get run quickstart -o yaml
  mortalctl get runs -l team=rl
\b
  # Watch runs change until Ctrl-C
  mortalctl get runs -w
\b
  # What happened to a run, and its checkpoints
  mortalctl get events quickstart
  mortalctl get checkpoints quickstart
\b
  # What the model wrote at the newest step (the worst five), and how training went
  mortalctl get completions quickstart --worst 5
  mortalctl get metrics quickstart --name reward,loss --plot
"""

OutputOpt = typer.Option(None, "-o", "--output", metavar="FORMAT", help="Output format: wide, yaml, json or name.")


def run_row(row: RunRow, wide: bool = False) -> list[str]:
    """One table row of a run (wide adds actor, restarts, generations, loss, backend, model, conditions)."""
    from mortal.specs import SpecError

    try:
        run = run_document(row)
    except SpecError:  # stored by an older/newer mortal: still list it, `describe` says what is wrong
        cells = [row.name, row.phase] + ["?"] * (len(RUN_HEADERS) - 3) + [age(row.created_at)]
        return cells + ["?"] * len(WIDE_HEADERS) if wide else cells
    s, spec = run.status, run.spec
    phase = "Terminating" if row.deleted_at is not None else str(s.phase)
    rollout_desired = s.replicas.rollout.desired if s.observed_generation else spec.rollout.replicas
    cells = [
        row.name,
        phase,
        f"{s.step}/{spec.algorithm.max_steps}",
        str(s.weight_version),
        str(s.last_checkpoint.step) if s.last_checkpoint else "-",
        f"{s.replicas.rollout.ready}/{rollout_desired}",
        fmt_float(s.reward),
        age(row.created_at),
    ]
    if wide:
        cells += [
            f"{s.replicas.actor.ready}/{s.replicas.actor.desired if s.observed_generation else 1}",  # one worker, any ranks
            str(s.restarts),
            f"{s.observed_generation}/{row.generation}",
            spec.algorithm.loss_type,
            spec.backend,
            spec.model.name,
            training_conditions(s.conditions),
        ]
    return cells


def training_conditions(conditions: list) -> str:
    """The training conditions that are False (`WeightsInSync=False,...`), `ok` when none is, `-` before any."""
    known = [c for c in conditions if c.type in TRAINING_CONDITIONS]
    failing = [f"{c.type}=False" for c in known if c.status == "False"]
    if failing:
        return ",".join(failing)
    return "ok" if any(c.status == "True" for c in known) else "-"


def check_format(output: str | None, allowed: tuple[str, ...] = OUTPUT_FORMATS) -> str | None:
    if output is not None and output not in allowed:
        raise typer.BadParameter(f"{output!r} is not one of: {', '.join(allowed)}", param_hint="'-o'")
    return output


def select_runs(store: Store, name: str | None, selector: str | None) -> list[RunRow]:
    """The named run (NotFound if absent) or every run matching the label selector."""
    labels = parse_selector(selector)
    if name:
        row = store.get_run(name)
        return [row] if labels.items() <= row.labels.items() else []
    return store.list_runs(labels=labels or None)


def render_runs(rows: list[RunRow], output: str | None, single: bool) -> str | None:
    """Documents (yaml/json/name) as text; None for the table formats, which print through rich.

    JSON of a named run is the run itself; otherwise a TrainingRunList (kubectl's List), even of
    one or none. YAML is one document per run. `apply -f -` reads every form back.
    """
    from mortal.specs import API_VERSION, dump_runs

    if output == "json" and not single:
        items = [run_document(r).to_dict() for r in rows]
        return to_json({"apiVersion": API_VERSION, "kind": "TrainingRunList", "items": items})
    if output in ("yaml", "json"):
        return dump_runs([run_document(r) for r in rows], output)
    if output == "name":
        return "".join(f"trainingrun/{r.name}\n" for r in rows)
    return None


def print_runs(rows: list[RunRow], output: str | None, single: bool) -> None:
    text = render_runs(rows, output, single)
    if text is not None:
        typer.echo(text, nl=False)
        return
    wide = output == "wide"
    headers = RUN_HEADERS + (WIDE_HEADERS if wide else ())
    print_table(headers, [run_row(r, wide) for r in rows], "No resources found.")


def watch_runs(store: Store, name: str | None, selector: str | None, output: str | None, timeout: float) -> None:
    """Until Ctrl-C (or `timeout` seconds): a live table on a terminal, else a reprint on every change."""
    deadline = time.monotonic() + timeout if timeout else None
    out = console()
    seen: dict[str, Any] = {}
    live = Live(console=out, auto_refresh=False) if out.is_terminal and output in (None, "wide") else None
    try:
        if live:
            live.start()
        while deadline is None or time.monotonic() < deadline:
            rows = select_runs(store, name, selector)
            versions = {r.name: r.resource_version for r in rows}
            if live is not None:  # a terminal: redraw every second, so AGE moves too
                _show_watch(live, rows, rows, output)
            elif versions != seen:
                changed = [r for r in rows if seen.get(r.name) != r.resource_version] if seen else rows
                seen = versions
                _show_watch(live, rows, changed, output)
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        if live:
            live.stop()


def _show_watch(live: Live | None, rows: list[RunRow], changed: list[RunRow], output: str | None) -> None:
    wide = output == "wide"
    headers = RUN_HEADERS + (WIDE_HEADERS if wide else ())
    if live is not None:
        live.update(table(headers, [run_row(r, wide) for r in rows]), refresh=True)
    elif output in (None, "wide"):
        print_renderable(table(headers, [run_row(r, wide) for r in rows]))
        typer.echo("")
    else:
        typer.echo(render_runs(changed, output, single=True) if output != "yaml" else
                   "".join("---\n" + render_runs([r], "yaml", True) for r in changed), nl=False)


def get_runs(
    ctx: typer.Context,
    name: str | None = typer.Argument(None, metavar="NAME", help="A run name; all runs when omitted."),
    output: str | None = OutputOpt,
    selector: str | None = typer.Option(None, "-l", "--selector", metavar="KEY=VALUE", help="Label selector, e.g. -l team=rl,tier=a."),
    watch: bool = typer.Option(False, "-w", "--watch", help="After listing, keep printing changes until Ctrl-C."),
    timeout: float = typer.Option(0, "--timeout", metavar="SECONDS", help="With -w: stop watching after this long (0 = never)."),
) -> None:
    """List runs: NAME PHASE STEP WEIGHTS CKPT ROLLOUT REWARD AGE (aliases: run, trainingruns, tr)."""
    check_format(output)
    store = state(ctx).store
    if watch:
        watch_runs(store, name, selector, output, timeout)
        return
    print_runs(select_runs(store, name, selector), output, single=name is not None)


def event_dict(event) -> dict[str, Any]:
    return {"run": event.run, "type": event.type, "reason": event.reason, "message": event.message,
            "time": event.time.isoformat() if event.time else None}


def get_events(
    ctx: typer.Context,
    name: str | None = typer.Argument(None, metavar="NAME", help="A run name; events of all runs when omitted."),
    output: str | None = OutputOpt,
    limit: int = typer.Option(50, "--limit", min=1, help="Show at most this many of the newest events."),
) -> None:
    """List events (what happened to runs), oldest first: LAST SEEN TYPE REASON OBJECT MESSAGE."""
    check_format(output, ("yaml", "json"))
    store = state(ctx).store
    if name:
        store.get_run(name)
    events = store.list_events(name, limit=limit)
    if output:
        doc = {"kind": "EventList", "items": [event_dict(e) for e in events]}
        typer.echo(to_yaml(doc) if output == "yaml" else to_json(doc), nl=False)
        return
    rows = [(age(e.time), e.type, e.reason, f"trainingrun/{e.run}", e.message) for e in events]
    print_table(("LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"), rows, "No events found.")


def get_checkpoints(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME", help="The run whose checkpoints to list."),
    output: str | None = OutputOpt,
) -> None:
    """List a run's complete checkpoints, oldest first: STEP WEIGHTS PATH AGE."""
    check_format(output, ("yaml", "json"))
    store = state(ctx).store
    store.get_run(name)
    rows = store.list_checkpoints(name)
    if output:
        items = [{"step": c.step, "weightVersion": c.weight_version, "path": c.path,
                  "created": c.created_at.isoformat() if c.created_at else None} for c in rows]
        doc = {"kind": "CheckpointList", "run": name, "items": items}
        typer.echo(to_yaml(doc) if output == "yaml" else to_json(doc), nl=False)
        return
    table_rows = [(c.step, c.weight_version, c.path, age(c.created_at)) for c in rows]
    print_table(("STEP", "WEIGHTS", "PATH", "AGE"), table_rows, f"No checkpoints of trainingrun/{name} yet.")


def register(app: typer.Typer) -> None:
    get_app = typer.Typer(help=HELP, short_help="Show runs, events, checkpoints, completions or metrics",
                          no_args_is_help=True, rich_markup_mode=None)
    for i, alias in enumerate(RUN_ALIASES):
        get_app.command(alias, hidden=i > 0)(get_runs)
    get_app.command("events")(get_events)
    get_app.command("event", hidden=True)(get_events)
    get_app.command("ev", hidden=True)(get_events)
    get_app.command("checkpoints")(get_checkpoints)
    get_app.command("checkpoint", hidden=True)(get_checkpoints)
    get_app.command("ckpt", hidden=True)(get_checkpoints)
    completions.register(get_app)
    metrics.register(get_app)
    app.add_typer(get_app, name="get")

