"""`mortalctl get metrics RUN`: a run's step metrics, one row a step, or their curves in the terminal.

Reads what the actor records every step (mortal.workers.actor.metrics: reward, loss, kl, entropy,
tokens_per_second, ... as TRL and the actor name them) with `Store.list_metrics`. `--name` picks
the columns (`--name all` for every one); `--plot` draws each as a chart with plotext, stacked, one
per name, sharing the step axis; `-o json|yaml` prints every value. Only reads the store.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

import typer

from mortal.client.cli.completions import Format
from mortal.client.cli.context import CliError, state
from mortal.client.cli.output import console, print_table, to_json, to_yaml
from mortal.client.cli.text import plain

if TYPE_CHECKING:
    from mortal.state import MetricRow

DEFAULT_NAMES = ("reward", "reward_std", "loss", "kl", "entropy", "completions/mean_length", "step_seconds")
CHART_ROWS = 14  # terminal rows per chart
MAX_CHART_WIDTH = 120

HELP = """Show a run's step metrics: a column per metric, or --plot their curves.

\b
Examples:
  # The usual columns (reward, reward_std, loss, kl, entropy, mean length, seconds a step)
  mortalctl get metrics quickstart
\b
  # Chosen metrics, as charts in the terminal
  mortalctl get metrics quickstart --name reward,loss --plot
\b
  # Every metric, every step
  mortalctl get metrics quickstart --name all -o json
"""

Steps = dict[int, dict[str, float]]


def by_step(rows: list[MetricRow]) -> Steps:
    """{step: {name: value}}, steps ascending."""
    out: Steps = {}
    for row in rows:
        out.setdefault(row.step, {})[row.name] = row.value
    return out


def choose_names(wanted: str | None, recorded: list[str], run: str) -> list[str]:
    """The metric names to show: `wanted` (comma-separated; 'all' = every one), else the usual ones
    recorded (every one if none of those is). CliError naming --name for one never recorded."""
    if wanted is None:
        return [n for n in DEFAULT_NAMES if n in recorded] or recorded
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    if names == ["all"]:
        return recorded
    for name in names:
        if name not in recorded:
            close = difflib.get_close_matches(name, recorded, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (recorded: {', '.join(recorded)})"
            raise CliError(f"--name {name}: trainingrun/{run} has no metric {name!r}{hint}")
    return names or recorded


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def step_ticks(steps: list[int], most: int = 8) -> list[int]:
    """At most `most` (+1) whole steps to label the x axis with, first and last included."""
    return sorted(set(steps[:: max(1, len(steps) // most)]) | {steps[-1]})


def chart(steps: Steps, names: list[str], width: int, colors: bool) -> str:
    """One line chart per name, stacked, step on the x axis (plotext, imported only here)."""
    import plotext

    plotext.terminal.limit(width=False, height=False)  # the size given here, even past one screen
    figure = plotext.figure.clear()
    figure.plot_size(width, CHART_ROWS * len(names))
    if len(names) > 1:  # a grid of one is not a grid to plotext: one chart is the figure itself
        figure.subplots(len(names), 1)
    panels = [figure.subplot(row, 1) for row in range(1, len(names) + 1)] if len(names) > 1 else [figure]
    for panel, name in zip(panels, names, strict=True):
        panel.plot_size(width, CHART_ROWS)
        points = [(s, values[name]) for s, values in steps.items() if name in values]
        if points:
            xs, ys = zip(*points, strict=True)
            panel.draw(panel.signal(list(xs), list(ys)).lines())
        ticks = step_ticks(list(steps))
        panel.ruler("x").ticks(ticks, [str(t) for t in ticks])
        panel.title(plain(name))
    panels[-1].label("step")
    return figure.build().string(colorless=not colors)


def get_metrics(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="RUN", help="The run whose metrics to show."),
    names: str | None = typer.Option(
        None,
        "--name",
        metavar="NAME,...",
        help="Metrics to show, comma-separated, or 'all' "
        "[default: reward, reward_std, loss, kl, entropy, completions/mean_length, step_seconds].",
    ),
    plot: bool = typer.Option(
        False, "--plot", help="Draw each metric's curve over the steps in the terminal."
    ),
    output: Format = typer.Option(
        Format.table, "-o", "--output", help="table, json or yaml (not with --plot)."
    ),
) -> None:
    """Show a run's step metrics: STEP and a column per metric, or --plot their curves."""
    if plot and output != Format.table:
        raise typer.BadParameter("--plot draws charts; leave -o out", param_hint="'-o'")
    store = state(ctx).store
    store.get_run(name)
    steps = by_step(store.list_metrics(name))
    if not steps:
        console(stderr=True).print(f"No metrics of trainingrun/{name} recorded yet.", markup=False)
        return
    chosen = choose_names(names, sorted({n for values in steps.values() for n in values}), name)
    if plot:
        out = console()
        typer.echo(chart(steps, chosen, min(out.width, MAX_CHART_WIDTH), colors=out.is_terminal))
    elif output == Format.table:
        print_table(
            ["STEP", *chosen],  # metric names as recorded: what --name takes
            [[str(s), *(_fmt(values.get(n)) for n in chosen)] for s, values in steps.items()],
            "",
        )
    else:
        items = [
            {"step": s, "values": {n: values[n] for n in chosen if n in values}}
            for s, values in steps.items()
        ]
        doc = {"kind": "MetricList", "run": name, "items": items}
        typer.echo(to_yaml(doc) if output == Format.yaml else to_json(doc), nl=False)


def register(get_app: typer.Typer) -> None:
    get_app.command("metrics", help=HELP)(get_metrics)
    get_app.command("metric", hidden=True, help=HELP)(get_metrics)
