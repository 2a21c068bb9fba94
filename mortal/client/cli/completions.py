"""`mortalctl get completions RUN`: what the model wrote at a step, with each reward and the advantage.

Reads the samples the actor records every step (spec.logging.completionsPerStep of them) from the
store; the newest step unless `--step` names another, sorted by total reward with `--worst K` /
`--best K`. The table shows one line per completion, whitespace folded: the end of the prompt (what
the completion continues) and the start of the completion, each cut with '…'; `-o json|yaml` prints
every field in full, and loads back to the same text. Only reads the store.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import typer

from mortal.client.cli.context import CliError, state
from mortal.client.cli.output import console, fmt_float, print_table, to_json, to_yaml

if TYPE_CHECKING:
    from mortal.state import CompletionRow, Store

PROMPT_WIDTH = 40
COMPLETION_WIDTH = 60
CELL_WIDTH = 16  # a log_extra column's cell

HELP = """List the completions the actor sampled at a step: rewards, advantage, prompt, completion.

\b
Examples:
  # The newest step's samples, the five worst of them, one step's best three
  mortalctl get completions quickstart
  mortalctl get completions quickstart --worst 5
  mortalctl get completions quickstart --step 12 --best 3
\b
  # Full text, to read or to process
  mortalctl get completions quickstart -o yaml
"""


class Format(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


def one_line(text: str, width: int, keep_end: bool = False) -> str:
    """`text` on one line (whitespace runs folded to a space), cut to `width` with '…' where it was cut."""
    flat = re.sub(r"\s+", " ", text).strip()
    if len(flat) <= width:
        return flat
    return "…" + flat[-(width - 1) :] if keep_end else flat[: width - 1] + "…"


def step_ranges(steps: list[int]) -> str:
    """Ascending steps as ranges: [1, 2, 3, 7] -> '1-3, 7'."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def pick_step(store: Store, run: str, step: int | None) -> int | None:
    """The step to show: `step` if it has samples (CliError naming --step if not), else the newest; None
    when the run has none yet."""
    steps = store.completion_steps(run)
    if step is None:
        return steps[-1] if steps else None
    if step not in steps:
        recorded = f"recorded: steps {step_ranges(steps)}" if steps else "none recorded yet"
        raise CliError(f"--step {step}: trainingrun/{run} has no completions at that step ({recorded})")
    return step


def completion_dict(row: CompletionRow) -> dict[str, Any]:
    """One sample with every field, full text (what -o json|yaml prints)."""
    return {
        "step": row.step,
        "sample": row.sample,
        "reward": row.reward,
        "rewards": row.rewards,
        "advantage": row.advantage,
        "weightVersion": row.weight_version,
        "extra": row.extra,
        "prompt": row.prompt,
        "completion": row.completion,
        "time": row.time.isoformat() if row.time else None,
    }


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return fmt_float(value)
    return one_line(str(value), CELL_WIDTH)


def completion_table(rows: list[CompletionRow]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells: STEP SAMPLE REWARD ADVANTAGE WEIGHTS, each reward, each log_extra column,
    then PROMPT (its end) and COMPLETION (its start)."""
    rewards = list(dict.fromkeys(name for r in rows for name in r.rewards))
    extra = list(dict.fromkeys(name for r in rows for name in r.extra))
    headers = [
        "STEP",
        "SAMPLE",
        "REWARD",
        "ADVANTAGE",
        "WEIGHTS",
        *rewards,
        *extra,  # names as the spec says
        "PROMPT",
        "COMPLETION",
    ]
    cells = [
        [
            str(r.step),
            str(r.sample),
            fmt_float(r.reward),
            "-" if r.advantage is None else f"{r.advantage:+.3f}",
            str(r.weight_version),
            *(_cell(r.rewards.get(n)) for n in rewards),
            *(_cell(r.extra.get(n)) for n in extra),
            one_line(r.prompt, PROMPT_WIDTH, keep_end=True),
            one_line(r.completion, COMPLETION_WIDTH),
        ]
        for r in rows
    ]
    return headers, cells


def get_completions(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="RUN", help="The run whose completions to show."),
    step: int | None = typer.Option(
        None, "--step", min=1, metavar="N", help="The optimizer step [default: the newest recorded]."
    ),
    worst: int | None = typer.Option(
        None, "--worst", min=1, metavar="K", help="Only the K with the lowest total reward, lowest first."
    ),
    best: int | None = typer.Option(
        None, "--best", min=1, metavar="K", help="Only the K with the highest total reward, highest first."
    ),
    output: Format = typer.Option(
        Format.table, "-o", "--output", help="table (text cut to fit a line), or json / yaml (full text)."
    ),
) -> None:
    """List a step's sampled completions: STEP SAMPLE REWARD ADVANTAGE WEIGHTS, each reward, PROMPT and
    COMPLETION."""
    from mortal.state import CompletionOrder

    if worst is not None and best is not None:
        raise typer.BadParameter("cannot be used together with --worst", param_hint="'--best'")
    store = state(ctx).store
    store.get_run(name)
    shown = pick_step(store, name, step)
    order = CompletionOrder.worst if worst else CompletionOrder.best if best else CompletionOrder.sample
    rows = [] if shown is None else store.list_completions(name, shown, order=order, limit=worst or best)
    if output != Format.table:
        doc = {
            "kind": "CompletionList",
            "run": name,
            "step": shown,
            "items": [completion_dict(r) for r in rows],
        }
        typer.echo(to_yaml(doc) if output == Format.yaml else to_json(doc), nl=False)
    elif rows:
        print_table(*completion_table(rows), "")
    else:
        console(stderr=True).print(f"No completions of trainingrun/{name} recorded yet.", markup=False)


def register(get_app: typer.Typer) -> None:
    get_app.command("completions", help=HELP)(get_completions)
    get_app.command("completion", hidden=True, help=HELP)(get_completions)
