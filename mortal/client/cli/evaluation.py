"""`mortalctl test eval -f RUN.yaml --rows A:B [--model DIR]`: how well a model does on rows of the run's
dataset, scored by the run's rewards, without training.

Who uses it: a user comparing a checkpoint with the model it started from on rows the run did not train on
(held-out tasks: the pass rate of a code agent, the accuracy of a calculator). The rows are generated as a
rollout worker generates a task (the same engine, settings and tool loop; every row one request of n
completions, a seed per row), then scored with every reward of the spec. Nothing is written to the store.
What it prints: each reward's mean over all completions (for a 0/1 reward, the share that passed), the mean
weighted sum, and each row's. A reward that raises fails the command, as in a worker.
What it must not do: train, write anything, or read a model other than the spec's or --model's.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

import typer
from pydantic import ValidationError

from mortal.client.cli.components import (
    DEVICE,
    FILENAME,
    OUTPUT,
    RUN_NAME,
    check_output,
    device_for,
    dump,
    load_run,
    run_rewards,
    test_app,
    tool_rollouts,
    tool_scoring,
    weighted_sums,
)
from mortal.client.cli.context import CliError
from mortal.client.cli.output import console, say, table, user_output_to_stderr
from mortal.workers.errors import FatalWorkerError

if TYPE_CHECKING:
    from mortal.specs import TrainingRun

EVAL_HELP = """Score a model on rows of the run's dataset with the run's rewards, without training.

--rows A:B takes rows A to B-1 (held-out rows: ones the run does not train on); --model evaluates another
model than the spec's (a checkpoint folder), so a checkpoint and its base can be compared on the same rows
and seeds.

\b
Examples:
  mortalctl test eval -f specs/examples/code-agent.yaml --rows 40:50 -n 4
  mortalctl test eval -f run.yaml --rows 0:32 --model ~/.mortal/runs/run/checkpoints/step-200 -o json
"""


@test_app.command("eval", help=EVAL_HELP, no_args_is_help=True)
def test_eval(
    filename: str = FILENAME,
    rows: str = typer.Option(..., "--rows", metavar="A:B", help="Rows A to B-1 of the run's dataset."),
    model: str | None = typer.Option(
        None, "--model", metavar="NAME", help="Evaluate this model (a checkpoint folder), not the spec's."
    ),
    n: int | None = typer.Option(
        None, "-n", metavar="N", help="Completions per row [default: numGenerations]."
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (each row's is made from it and the row)."),
    device: str = DEVICE,
    name: str | None = RUN_NAME,
    output: str | None = OUTPUT,
) -> None:
    check_output(output)
    if n is not None and n < 1:
        raise CliError(f"-n {n}: must be at least 1")
    run = load_run(filename, name)
    if model is not None:
        run = with_model(run, model)
    selected = row_range(run, rows)
    try:
        with user_output_to_stderr():
            result = evaluate(
                run, selected, n or run.spec.algorithm.num_generations, seed, device_for(device)
            )
    except FatalWorkerError as exc:  # what a worker would fail the run with: a model or reward that fails
        raise CliError(f"{f'--model {model}: ' if model is not None else ''}{exc.message}") from None
    if output:
        typer.echo(dump(result, output), nl=False)
        return
    _print(result)


def with_model(run: TrainingRun, model: str) -> TrainingRun:
    """The run with spec.model.name replaced, checked as the spec's own field is."""
    from mortal.specs.training import ModelSpec

    try:
        spec_model = ModelSpec.model_validate({**run.spec.model.model_dump(by_alias=True), "name": model})
    except ValidationError as exc:
        raise CliError(f"--model {model}: {exc.errors()[0]['msg']}") from None
    return run.model_copy(update={"spec": run.spec.model_copy(update={"model": spec_model})})


def row_range(run: TrainingRun, value: str) -> range:
    """--rows A:B as the range of dataset rows it names (refused outside the dataset, or empty)."""
    from mortal.workers.data import load_rows

    start, colon, stop = value.partition(":")
    if not colon or not start.strip().isdigit() or not stop.strip().isdigit():
        raise CliError(f"--rows {value}: write A:B (rows A to B-1), e.g. 0:16")
    selected = range(int(start), int(stop))
    count = len(load_rows(run.spec.dataset))
    if not selected or selected.stop > count:
        raise CliError(
            f"--rows {value}: {run.spec.dataset.name} has rows 0..{count - 1}; A:B needs A < B <= {count}"
        )
    return selected


def evaluate(run: TrainingRun, selected: range, n: int, seed: int, device: str) -> dict[str, Any]:
    """Generate `n` completions of each selected row as a rollout task would, score them, summarise."""
    from mortal.workers import schedule
    from mortal.workers.data import load_rows
    from mortal.workers.models import load_tokenizer
    from mortal.workers.rollout.engines import select_engine

    spec = run.spec
    dataset = load_rows(spec.dataset)
    rows = [dataset[k] for k in selected]
    seeds = [schedule.task_seed(seed, 0, k) for k in selected]
    rewards = run_rewards(run)
    tokenizer = load_tokenizer(spec.model)
    engine = select_engine(spec.generation.engine, device).create(spec.model, tokenizer, device=device)
    try:
        scores = _generated_and_scored(run, engine, tokenizer, rewards, rows, seeds, n)
    finally:
        engine.close()
    scored = [
        {"row": k, "rewards": row_scores, "weightedSums": weighted_sums(run, row_scores, n)}
        for k, row_scores in zip(selected, scores, strict=True)
    ]
    return summary(run, selected, n, device, engine.name, scored)


def _generated_and_scored(
    run: TrainingRun,
    engine: Any,
    tokenizer: Any,
    rewards: Any,
    rows: list[dict[str, Any]],
    seeds: list[int],
    n: int,
) -> list[dict[str, list[float | None]]]:
    """Each row's reward scores ({name: [score per completion]}): one engine call for every row (a task),
    through the tool loop when the run has tools, scored as the rollout worker scores them."""
    from mortal.workers.messages import RolloutRequest
    from mortal.workers.models import completion_message, encode_prompt
    from mortal.workers.rollout.engines import GenerationParams

    spec = run.spec
    params = GenerationParams.from_spec(spec.generation)
    if not spec.rollout.uses_tools:
        outs = engine.generate([encode_prompt(tokenizer, row["prompt"]) for row in rows], n, seeds, params)
        scores = []
        for row, group in zip(rows, outs, strict=True):
            ids = [c.ids for c in group]
            messages = [completion_message(tokenizer, row["prompt"], i) for i in ids]
            scores.append(rewards.score(row["prompt"], messages, ids, row))
        return scores
    requests = [
        RolloutRequest(prompt=row["prompt"], row=row, num_generations=n, seed=s)
        for row, s in zip(rows, seeds, strict=True)
    ]
    return [
        rewards.score(
            row["prompt"],
            [r.messages for r in group],
            [r.completion_ids for r in group],
            row,
            **tool_scoring(run, group),
        )
        for row, group in zip(rows, tool_rollouts(run, engine, tokenizer, params, requests), strict=True)
    ]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summary(
    run: TrainingRun, selected: range, n: int, device: str, engine: str, scored: list[dict[str, Any]]
) -> dict[str, Any]:
    """Each reward's mean over every completion of every row, the weighted sum's, and each row's."""
    names = list(scored[0]["rewards"]) if scored else []
    return {
        "model": run.spec.model.name,
        "dataset": run.spec.dataset.name,
        "rows": f"{selected.start}:{selected.stop}",
        "completionsPerRow": n,
        "engine": engine,
        "device": device,
        "rewards": {name: _mean([v for s in scored for v in s["rewards"][name]]) for name in names},
        "weightedMean": _mean([v for s in scored for v in s["weightedSums"]]),
        "perRow": [{"row": s["row"], "weightedMean": _mean(s["weightedSums"])} for s in scored],
    }


def _number(value: float | None) -> str:
    return "None (not applicable)" if value is None else f"{value:.3f}"


def _print(result: dict[str, Any]) -> None:
    say(
        f"rows {result['rows']} of {result['dataset']}, {result['completionsPerRow']} completions each, "
        f"{result['model']} ({result['engine']} on {result['device']})"
    )
    out = console()
    means = [(name, _number(mean)) for name, mean in result["rewards"].items()]
    out.print(table(("REWARD", "MEAN"), means))
    say(f"weighted sum, mean: {_number(result['weightedMean'])}")
    per_row = [(str(r["row"]), _number(r["weightedMean"])) for r in result["perRow"]]
    out.print(table(("ROW", "WEIGHTED MEAN"), per_row))
