"""`mortalctl get runs|events|checkpoints|completions|metrics`: what the store holds, as a table or documents.

`get runs` prints NAME PHASE STEP WEIGHTS CKPT ROLLOUT REWARD AGE (`-o wide` adds more: the latest loss,
ending with the training conditions that are False), or the runs as YAML/JSON that `apply -f -` reads
back; with `-w`, as kubectl, the table once and then a run's row again only when it changed. Only
reads the store. Resource names accept kubectl's singular, plural and short forms. A step's sampled
completions and a run's metrics have modules of their own (completions.py, metrics.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import typer
from rich.cells import cell_len

from mortal.client.cli import completions, events, metrics
from mortal.client.cli.context import TERMINAL_PHASES, CliError, parse_selector, run_document, state
from mortal.client.cli.output import (
    OUTPUT_FORMATS,
    age,
    fmt_float,
    print_table,
    say,
    to_json,
    to_yaml,
)
from mortal.client.cli.text import plain

if TYPE_CHECKING:
    from mortal.state import RunRow, Store

RUN_ALIASES = ("runs", "run", "trainingruns", "trainingrun", "tr")
RUN_HEADERS = ("NAME", "PHASE", "STEP", "WEIGHTS", "CKPT", "ROLLOUT", "REWARD", "AGE")
WIDE_HEADERS = ("ACTOR", "RESTARTS", "GENERATION", "LOSS", "LOSS-TYPE", "BACKEND", "MODEL", "CONDITIONS")
LOSS = "loss"  # the metric the actor records each step (mortal.workers.actor.metrics, TRL's name)
WATCH_POLL_SECONDS = 1.0
TRAINING_CONDITIONS = (
    "WeightsInSync",
    "RewardHealthy",
    "CheckpointFresh",
    "Progressing",
    "DeadlinesMet",
    "MemoryFits",
)

HELP = """Display one or many resources: runs, events, checkpoints, completions, metrics.

\b
Examples:
  # List all runs
  mortalctl get runs
\b
  # One run, with more columns, as YAML; runs by label, or several by name
  mortalctl get run quickstart -o wide
  mortalctl get run quickstart -o yaml
  mortalctl get runs -l team=rl
  mortalctl get runs quickstart code-agent
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

OutputOpt = typer.Option(
    None, "-o", "--output", metavar="FORMAT", help="Output format: wide, yaml, json or name."
)


def run_row(row: RunRow, wide: bool = False, loss: float | None = None) -> list[str]:
    """One table row of a run (wide adds actor, restarts, generations, the latest loss, loss type, backend,
    model, conditions)."""
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
            # one worker, any ranks
            f"{s.replicas.actor.ready}/{s.replicas.actor.desired if s.observed_generation else 1}",
            str(s.restarts),
            f"{s.observed_generation}/{row.generation}",
            "-" if loss is None else f"{loss:.4g}",
            spec.algorithm.loss_type,
            spec.backend,
            spec.model.name,
            training_conditions(s.conditions, failed=phase == "Failed"),
        ]
    return cells


def training_conditions(conditions: list, failed: bool = False) -> str:
    """The training conditions that are False (`WeightsInSync=False,...`); `ok` when none is, `-` before
    any. Ready is left out (READY and PHASE say it) but for a Failed run, which must not read `ok`."""
    types = (*TRAINING_CONDITIONS, "Ready") if failed else TRAINING_CONDITIONS
    known = [c for c in conditions if c.type in types]
    failing = [f"{c.type}=False" for c in known if c.status == "False"]
    if failing:
        return ",".join(failing)
    return "ok" if any(c.status == "True" for c in known) else "-"


def check_format(output: str | None, allowed: tuple[str, ...] = OUTPUT_FORMATS) -> str | None:
    if output is not None and output not in allowed:
        raise typer.BadParameter(f"{output!r} is not one of: {', '.join(allowed)}", param_hint="'-o'")
    return output


class RunsNotFound(CliError):
    """Names given to `get runs` that name no run; `found` holds the rows of the others."""

    def __init__(self, found: list[RunRow], missing: list[str]) -> None:
        self.found, self.missing = found, missing
        names = ", ".join(repr(plain(name)) for name in missing)
        super().__init__(f"trainingrun{'s' if len(missing) > 1 else ''} {names} not found")


def select_runs(store: Store, names: list[str] | None, selector: str | None) -> list[RunRow]:
    """The named runs, in the order named, that match the label selector; every matching run when no
    name is given. NotFound names every missing run, after the lookups (kubectl prints what it found
    first: print_found_runs does)."""
    from mortal.state import NotFound

    labels = parse_selector(selector)
    if not names:
        return store.list_runs(labels=labels or None)
    rows, missing = [], []
    for name in dict.fromkeys(names):
        try:
            row = store.get_run(name)
        except NotFound:
            missing.append(name)
            continue
        if labels.items() <= row.labels.items():
            rows.append(row)
    if missing:
        raise RunsNotFound(rows, missing)
    return rows


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
        return "".join(f"trainingrun/{plain(r.name)}\n" for r in rows)
    return None


def latest_loss(store: Store, row: RunRow) -> float | None:
    """The loss of the newest step the actor recorded one for (None before any)."""
    step = (row.status or {}).get("step") or 0
    rows = store.list_metrics(row.name, name=LOSS, since_step=step) if step else []
    rows = rows or store.list_metrics(row.name, name=LOSS)  # a step between loss records (or a resume)
    return rows[-1].value if rows else None


def run_rows(store: Store, rows: list[RunRow], wide: bool) -> list[list[str]]:
    return [run_row(r, wide, latest_loss(store, r) if wide else None) for r in rows]


def print_runs(store: Store, rows: list[RunRow], output: str | None, single: bool) -> None:
    text = render_runs(rows, output, single)
    if text is not None:
        typer.echo(text, nl=False)  # documents are data: JSON and YAML escape control characters themselves
        return
    wide = output == "wide"
    headers = RUN_HEADERS + (WIDE_HEADERS if wide else ())
    print_table(headers, run_rows(store, rows, wide), "No resources found.")
    _say_if_unsupervised(store, rows)


def _say_if_unsupervised(store: Store, rows: list[RunRow]) -> None:
    """A note on stderr when runs are active and no controller runs: their phases are what the last one
    wrote (a run shown Running may have stopped since), and nothing heals them until one starts."""
    from mortal.controller.manager import controller_running

    active = [r for r in rows if r.phase not in TERMINAL_PHASES and not r.spec.get("suspend")]
    if active and not controller_running(store):
        typer.echo(
            "note: no controller is running: the phases above are as one last wrote them; "
            "`mortalctl controller` runs one (any apply, scale or resume starts one in the background)",
            err=True,
        )


class RowWatch:
    """`kubectl get -w`'s table: the header and each row once, then a run's row again only when it changed.

    Columns keep the widths of the first listing (a wider cell later pushes its row's columns along)."""

    def __init__(self, headers: tuple[str, ...]) -> None:
        self.headers = headers
        self.widths: list[int] = []
        self.shown: dict[str, list[str]] = {}

    def lines(self, rows: list[list[str]]) -> list[str]:
        """The lines to print for this listing (rows: a run's cells, its name first)."""
        age_column = self.headers.index("AGE")
        changed = [
            [plain(c) for c in cells]
            for cells in rows
            if _without(self.shown.get(cells[0]), age_column) != _without(cells, age_column)
        ]
        self.shown.update({cells[0]: cells for cells in rows})
        out = []
        if not self.widths and not changed:  # no run yet: the header waits for the first row, as kubectl's
            return out
        if not self.widths:
            self.widths = [
                max(cell_len(c) for c in column) for column in zip(self.headers, *changed, strict=True)
            ]
            out.append(self._line(list(self.headers)))
        return out + [self._line(cells) for cells in changed]

    def _line(self, cells: list[str]) -> str:
        return "   ".join(
            c + " " * (w - cell_len(c)) for c, w in zip(cells, self.widths, strict=True)
        ).rstrip()


def _without(cells: list[str] | None, column: int) -> list[str] | None:
    return None if cells is None else cells[:column] + cells[column + 1 :]


def watch_runs(
    store: Store, names: list[str] | None, selector: str | None, output: str | None, timeout: float
) -> None:
    """Until Ctrl-C (or `timeout` seconds): kubectl's watch, the listing then each change (a row or a
    document)."""
    deadline = time.monotonic() + timeout if timeout else None
    wide = output == "wide"
    watch = RowWatch(RUN_HEADERS + (WIDE_HEADERS if wide else ()))
    seen: dict[str, int] = {}
    said_empty = False
    try:
        while deadline is None or time.monotonic() < deadline:
            rows = select_runs(store, names, selector)
            if not rows and not seen and not watch.widths and not said_empty:
                say("No resources found.", stderr=True)
                said_empty = True
            if output in (None, "wide"):
                lines = watch.lines(run_rows(store, rows, wide))
                if lines:
                    typer.echo("\n".join(lines))
            else:
                changed = [r for r in rows if seen.get(r.name) != r.resource_version]
                seen.update({r.name: r.resource_version for r in rows})
                if changed:
                    text = (
                        render_runs(changed, output, single=True)
                        if output != "yaml"
                        else "".join("---\n" + render_runs([r], "yaml", True) for r in changed)
                    )
                    typer.echo(text, nl=False)
            time.sleep(WATCH_POLL_SECONDS)
    except KeyboardInterrupt:
        pass


def get_runs(
    ctx: typer.Context,
    names: list[str] | None = typer.Argument(
        None, metavar="[NAME]...", help="Run names; all runs when omitted."
    ),
    output: str | None = OutputOpt,
    selector: str | None = typer.Option(
        None, "-l", "--selector", metavar="KEY=VALUE", help="Label selector, e.g. -l team=rl,tier=a."
    ),
    watch: bool = typer.Option(
        False, "-w", "--watch", help="After listing, keep printing changes until Ctrl-C."
    ),
    timeout: float = typer.Option(
        0, "--timeout", metavar="SECONDS", help="With -w: stop watching after this long (0 = never)."
    ),
) -> None:
    """List runs: NAME PHASE STEP WEIGHTS CKPT ROLLOUT REWARD AGE (aliases: run, trainingruns, tr)."""
    check_format(output)
    store = state(ctx).store
    if watch:
        watch_runs(store, names, selector, output, timeout)
        return
    single = names is not None and len(set(names)) == 1
    try:
        rows = select_runs(store, names, selector)
    except RunsNotFound as missing:  # as kubectl: the runs found, then the error naming the others
        if missing.found:
            print_runs(store, missing.found, output, single=False)
        raise
    print_runs(store, rows, output, single=single)


def event_dict(event) -> dict[str, Any]:
    return {
        "run": event.run,
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
        "time": event.time.isoformat() if event.time else None,
    }


def get_events(
    ctx: typer.Context,
    name: str | None = typer.Argument(
        None, metavar="NAME", help="A run name; events of all runs when omitted."
    ),
    output: str | None = OutputOpt,
    limit: int = typer.Option(
        50,
        "--limit",
        min=1,
        help="Show at most this many of the newest events (a table line of repeats counts once).",
    ),
) -> None:
    """List events (what happened to runs), oldest first: LAST SEEN TYPE REASON OBJECT MESSAGE. A reason
    repeated in a row is one line, its LAST SEEN saying how often: 3m (x12 over 10m)."""
    check_format(output, ("yaml", "json"))
    store = state(ctx).store
    if name:
        store.get_run(name)
    if output:
        doc = {"kind": "EventList", "items": [event_dict(e) for e in store.list_events(name, limit=limit)]}
        typer.echo(to_yaml(doc) if output == "yaml" else to_json(doc), nl=False)
        return
    lines = events.newest_lines(store, name, limit)
    rows = [(e.last_seen(), e.type, e.reason, f"trainingrun/{e.run}", e.shown_message) for e in lines]
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
        items = [
            {
                "step": c.step,
                "weightVersion": c.weight_version,
                "path": c.path,
                "created": c.created_at.isoformat() if c.created_at else None,
            }
            for c in rows
        ]
        doc = {"kind": "CheckpointList", "run": name, "items": items}
        typer.echo(to_yaml(doc) if output == "yaml" else to_json(doc), nl=False)
        return
    table_rows = [(c.step, c.weight_version, c.path, age(c.created_at)) for c in rows]
    print_table(("STEP", "WEIGHTS", "PATH", "AGE"), table_rows, f"No checkpoints of trainingrun/{name} yet.")


def register(app: typer.Typer) -> None:
    get_app = typer.Typer(
        help=HELP,
        short_help="Show runs, events, checkpoints, completions or metrics",
        no_args_is_help=True,
        rich_markup_mode=None,
    )
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
