"""`mortalctl test reward | rollout -f RUN.yaml`: try one part of a run on this machine, without training.

Scores one completion with the run's rewards, or generates from its model with its generation settings,
before a run spends GPU hours finding out. The spec comes from the file (the run need not exist), and
rewards and model load as the rollout worker loads them. Nothing is written to the store.
What they must not do: hide what a reward did. A reward that raises or returns a bad value is
reported next to the others (`RewardSet.report`), with what it printed, and the command exits 1.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mortal.client.cli.context import CliError
from mortal.client.cli.output import console, say, table, to_json, to_yaml, user_output_to_stderr

if TYPE_CHECKING:
    from mortal.specs import TrainingRun

HELP = "Try a run's rewards or generation on this machine, without training."
REWARD_HELP = """Score one completion with the run's rewards.

Prints each reward's score, its weight, the weighted sum GRPO optimizes, and what each reward
function printed, logged or raised. Dataset columns the rewards read (e.g. `tests` for code
execution) come from --row: a JSON object, or the index of a row of the run's dataset.

\b
Examples:
  mortalctl test reward -f specs/examples/quickstart.yaml --completion 27 --row '{"answer": "27"}'
  mortalctl test reward -f run.yaml --row 3 --completion "$(cat answer.txt)"
"""
ROLLOUT_HELP = """Generate from the run's model with its generation settings, on this machine.

The prompt is --prompt TEXT (the dataset's system prompt is added, as in training) or row K of the
run's dataset (--row K), whose completions are then scored with the run's rewards too.

\b
Examples:
  mortalctl test rollout -f specs/examples/quickstart.yaml --row 0 -n 4
  mortalctl test rollout -f run.yaml --prompt "Write a haiku about rivers." --max-tokens 64
"""

test_app = typer.Typer(help=HELP, no_args_is_help=True)
# the options every `test` command shares (typer keeps no state in them: one object serves each command)
FILENAME = typer.Option(..., "-f", "--filename", metavar="FILE", help="The TrainingRun's YAML file.")
RUN_NAME = typer.Option(None, "--name", help="The run to use when the file holds several.")
OUTPUT = typer.Option(None, "-o", "--output", metavar="FORMAT", help="json or yaml: the whole result.")
DEVICE = typer.Option("auto", "--device", help="auto (a GPU when there is one), cpu or cuda.")


def load_run(filename: str, name: str | None) -> TrainingRun:
    """The one run in `filename`, or the one called `name`. Its modules import from this folder, as they
    do when it is applied from here (admission and the code snapshot take them from the applying folder;
    a console script does not put that folder on sys.path itself)."""
    from mortal.client.apply import read_documents

    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.insert(0, here)
    runs = read_documents([filename])
    if name is not None:
        runs = [run for run in runs if run.name == name] or _no_run(filename, name, runs)
    if len(runs) != 1:
        found = ", ".join(run.name for run in runs) or "none"
        raise CliError(f"{filename} holds {len(runs)} TrainingRuns ({found}): choose one with --name")
    return runs[0]


def _no_run(filename: str, name: str, runs: list) -> list:
    raise CliError(
        f"--name {name}: {filename} has no run of that name (it has {', '.join(r.name for r in runs)})"
    )


def dataset_row(run: TrainingRun, index: int, flag: str = "--row") -> dict[str, Any]:
    """Row `index` of the run's dataset as the actor hands it to rollouts (prompt normalized)."""
    from mortal.workers.data import load_rows

    rows = load_rows(run.spec.dataset)
    if not 0 <= index < len(rows):
        raise CliError(f"{flag} {index}: {run.spec.dataset.name} has rows 0..{len(rows) - 1}")
    return rows[index]


def parse_row(run: TrainingRun, value: str | None) -> dict[str, Any]:
    """--row: a JSON object of dataset columns, or the index of a dataset row."""
    from mortal.workers.data import normalize_prompt

    if value is None:
        return {}
    if value.strip().lstrip("-").isdigit():
        return dataset_row(run, int(value))
    try:
        row = json.loads(value)
    except json.JSONDecodeError as exc:
        raise CliError(
            f"--row: not JSON ({exc.msg} at character {exc.pos}); give an object or a row index"
        ) from None
    if not isinstance(row, dict):
        raise CliError(f"--row: a JSON object of dataset columns is needed (got a {type(row).__name__})")
    if "prompt" in row:
        row["prompt"] = normalize_prompt(row["prompt"], run.spec.dataset.system_prompt)
    return row


def weighted_sum(run: TrainingRun, scores: dict[str, float | None]) -> float | None:
    """The sum GRPO optimizes (mortal.workers.actor.samples.total_reward): a None score adds nothing."""
    from mortal.workers.actor.samples import total_reward
    from mortal.workers.messages import reward_names

    weights = dict(zip(reward_names(run.spec.rewards), (r.weight for r in run.spec.rewards), strict=True))
    return total_reward(scores, weights)


def weighted_sums(run: TrainingRun, scores: dict[str, list[float | None]], count: int) -> list[float | None]:
    """Each of `count` completions' weighted sum, from every reward's scores ({name: [score, ...]})."""
    return [weighted_sum(run, {name: values[k] for name, values in scores.items()}) for k in range(count)]


def run_rewards(run: TrainingRun) -> Any:
    """The run's RewardSet, built as the rollout worker builds it."""
    from mortal.workers.rewards import RewardSet

    return RewardSet.from_spec(
        run.spec.rewards,
        max_steps=run.spec.algorithm.max_steps,
        environment_classes_importable=run.spec.rollout.environment_service.mode != "http",
    )


def completion_ids(run: TrainingRun, text: str) -> tuple[list[int], str | None]:
    """The completion's token ids under the run's tokenizer, or [] and why, when it is not on this
    machine. Never downloads (a hub model only from the local cache) and never converts a GGUF model
    (its tokenizer is read from the file): a reward check must not wait minutes for ids most rewards
    never read."""
    from transformers import AutoTokenizer

    from mortal.workers.errors import FatalWorkerError
    from mortal.workers.models import load_tokenizer, resolve_model_source

    try:
        source = resolve_model_source(run.spec.model.name)
        if source.kind == "hub":
            tokenizer = AutoTokenizer.from_pretrained(source.location, local_files_only=True)
        elif source.kind == "gguf":
            tokenizer = AutoTokenizer.from_pretrained(
                Path(source.location).parent, gguf_file=Path(source.location).name
            )
        else:
            tokenizer = load_tokenizer(run.spec.model)
    except (FatalWorkerError, OSError) as exc:
        return (
            [],
            "completion_ids is [] (the model's tokenizer is not on this machine: "
            f"{str(exc).splitlines()[0]})",
        )
    return tokenizer.encode(text, add_special_tokens=False), None


@test_app.command("reward", help=REWARD_HELP, no_args_is_help=True)
def test_reward(
    filename: str = FILENAME,
    completion: str = typer.Option(..., "--completion", metavar="TEXT", help="The completion to score."),
    row: str | None = typer.Option(
        None, "--row", metavar="JSON|K", help="Dataset columns as JSON, or row K."
    ),
    prompt: str | None = typer.Option(
        None, "--prompt", metavar="TEXT", help="The prompt (default: the row's)."
    ),
    name: str | None = RUN_NAME,
    output: str | None = OUTPUT,
) -> None:
    from mortal.workers.data import normalize_prompt
    from mortal.workers.rewards import RewardSet

    check_output(output)
    run = load_run(filename, name)
    columns = parse_row(run, row)
    asked = normalize_prompt(prompt, run.spec.dataset.system_prompt) if prompt is not None else None
    the_prompt = asked if asked is not None else columns.get("prompt", "")
    message = completion if isinstance(the_prompt, str) else [{"role": "assistant", "content": completion}]
    ids, note = completion_ids(run, completion)
    reports = RewardSet.from_spec(run.spec.rewards, max_steps=run.spec.algorithm.max_steps).report(
        the_prompt, message, ids, columns
    )
    result = {
        "rewards": [
            {
                "name": r.name,
                "weight": entry.weight,
                "score": r.score,
                "error": r.error,
                "stdout": r.stdout,
                "stderr": r.stderr,
                "logMetric": r.logged.metrics,
                "logExtra": r.logged.extra,
            }
            for r, entry in zip(reports, run.spec.rewards, strict=True)
        ],
        "weightedSum": weighted_sum(run, {r.name: r.score for r in reports}),
        **({"note": note} if note else {}),
    }
    _print_reward_result(result, output)
    if any(r.error for r in reports):
        raise typer.Exit(1)


def dump(result: dict[str, Any], output: str) -> str:
    text = to_json(result) if output == "json" else to_yaml(result)
    return text if text.endswith("\n") else text + "\n"


def check_output(output: str | None) -> None:
    if output not in (None, "json", "yaml"):
        raise CliError(f"-o {output}: choose json or yaml (or leave it out for a table)")


def _print_reward_result(result: dict[str, Any], output: str | None) -> None:
    if output:
        typer.echo(dump(result, output), nl=False)
        return
    out = console()
    rows = [(r["name"], f"{r['weight']:g}", _score(r["score"]), r["error"] or "") for r in result["rewards"]]
    out.print(table(("REWARD", "WEIGHT", "SCORE", "ERROR"), rows))
    say(f"weighted sum: {_score(result['weightedSum'])}")
    for r in result["rewards"]:
        for stream in ("stdout", "stderr"):
            if r[stream]:
                say(f"--- {r['name']} {stream} ---\n{r[stream].rstrip()}")
        if r["logExtra"] or r["logMetric"]:
            say(f"--- {r['name']} logged --- {json.dumps({**r['logMetric'], **r['logExtra']})}")
    if result.get("note"):
        say(f"note: {result['note']}")


def _score(value: float | None) -> str:
    return "None (not applicable)" if value is None else f"{value:.4g}"


@test_app.command("rollout", help=ROLLOUT_HELP, no_args_is_help=True)
def test_rollout(
    filename: str = FILENAME,
    prompt: str | None = typer.Option(None, "--prompt", metavar="TEXT", help="The prompt to complete."),
    row: int | None = typer.Option(
        None, "--row", metavar="K", help="Use row K of the run's dataset (and score it)."
    ),
    n: int | None = typer.Option(
        None, "-n", metavar="N", help="Completions to sample [default: numGenerations]."
    ),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", metavar="N", help="Override generation.maxTokens."
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed (same seed, same completions on CPU)."),
    device: str = DEVICE,
    name: str | None = RUN_NAME,
    output: str | None = OUTPUT,
) -> None:
    check_output(output)
    if (prompt is None) == (row is None):
        raise CliError("give exactly one of --prompt TEXT and --row K")
    for flag, value in (("-n", n), ("--max-tokens", max_tokens)):
        if value is not None and value < 1:
            raise CliError(f"{flag} {value}: must be at least 1")
    run = load_run(filename, name)
    with user_output_to_stderr():
        result = generate(run, prompt, row, n or run.spec.algorithm.num_generations, max_tokens, seed, device)
    if output:
        typer.echo(dump(result, output), nl=False)
        return
    _print_rollout_result(result)


def generate(
    run: TrainingRun,
    prompt: str | None,
    row: int | None,
    n: int,
    max_tokens: int | None,
    seed: int,
    device: str,
) -> dict[str, Any]:
    """Sample `n` completions as a rollout worker would (same engine, tokenizer and settings); scored
    with the run's rewards when the prompt is a dataset row."""
    from mortal.workers.actor.samples import as_text
    from mortal.workers.data import normalize_prompt
    from mortal.workers.messages import RolloutRequest
    from mortal.workers.models import completion_message, encode_prompt, load_tokenizer
    from mortal.workers.rollout.engines import GenerationParams, select_engine
    from mortal.workers.rollout.multiturn import fitting

    columns = dataset_row(run, row) if row is not None else {}
    the_prompt = (
        columns["prompt"] if row is not None else normalize_prompt(prompt, run.spec.dataset.system_prompt)
    )
    where = device_for(device)
    tokenizer = load_tokenizer(run.spec.model)
    engine = select_engine(run.spec.generation.engine, where).create(run.spec.model, tokenizer, device=where)
    try:
        params = GenerationParams.from_spec(run.spec.generation)
        if max_tokens is not None:
            params = replace(params, max_tokens=max_tokens)
        if run.spec.rollout.uses_tools:
            request = RolloutRequest(
                prompt=the_prompt, row=columns or {"prompt": the_prompt}, num_generations=n, seed=seed
            )
            [rollouts] = tool_rollouts(run, engine, tokenizer, params, [request])
        else:  # a prompt longer than the model takes fails here as it would fail the run (PromptTooLong)
            request = RolloutRequest(
                prompt=the_prompt, row=columns or {"prompt": the_prompt}, num_generations=n, seed=seed
            )
            prompt_ids = fitting(
                request, encode_prompt(tokenizer, the_prompt), params.max_tokens, engine.max_model_len()
            )
            [outs] = engine.generate([prompt_ids], n, [seed], params)
    finally:
        engine.close()
    if run.spec.rollout.uses_tools:
        ids = [r.completion_ids for r in rollouts]
        messages = [r.messages for r in rollouts]
        texts = [as_text(m) for m in messages]
        scoring = tool_scoring(run, rollouts)
    else:
        ids = [c.ids for c in outs]
        texts = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        messages = [completion_message(tokenizer, the_prompt, i) for i in ids]
        scoring = {}
    result: dict[str, Any] = {
        "prompt": the_prompt,
        "engine": engine.name,
        "device": where,
        "completions": texts,
    }
    if run.spec.rollout.uses_tools:
        result |= {
            "turns": [r.turns for r in rollouts],
            "toolCalls": [r.tool_calls for r in rollouts],
            "toolFailures": [r.tool_failures for r in rollouts],
            "messages": messages,
        }
    if row is not None:
        scores = run_rewards(run).score(the_prompt, messages, ids, columns, **scoring)
        result["rewards"] = scores
        result["weightedSums"] = weighted_sums(run, scores, len(ids))
    return result


def tool_rollouts(
    run: TrainingRun, engine: Any, tokenizer: Any, params: Any, requests: list[Any]
) -> list[Any]:
    """Each request's tool-calling rollouts, through the rollout worker's own loop
    (mortal.workers.rollout.multiturn), the requests together as one task."""
    from mortal.workers.rollout.multiturn import MultiTurn
    from mortal.workers.rollout.tools import Toolbox

    toolbox = Toolbox.from_spec(run.spec.rollout)
    return MultiTurn(engine, tokenizer, toolbox, params, run.spec.rollout.chat_template).rollouts(requests)


def tool_scoring(run: TrainingRun, rollouts: list[Any]) -> dict[str, list[Any]]:
    """What a rollout worker passes its rewards beside one prompt's tool-calling rollouts: with an
    environment, each rollout's environment and its own prompt (the row's, with what the environment's
    `reset` returned appended), as TRL passes them; without one, nothing more."""
    if run.spec.rollout.environment is None:
        return {}
    return {"environments": [r.environment for r in rollouts], "prompts": [r.prompt for r in rollouts]}


def device_for(device: str) -> str:
    from mortal.workers.models import default_device

    if device not in ("auto", "cpu", "cuda"):
        raise CliError(f"--device {device}: choose auto, cpu or cuda")
    if device == "auto":
        return default_device()
    if device == "cuda" and default_device() != "cuda":
        raise CliError("--device cuda: this machine has no CUDA GPU; use --device cpu")
    return device


def _print_rollout_result(result: dict[str, Any]) -> None:
    say(f"prompt ({result['engine']} on {result['device']}): {json.dumps(result['prompt'])}")
    rewards = result.get("rewards", {})
    for k, text in enumerate(result["completions"]):
        scored = ""
        if rewards:
            parts = [f"{name} {_score(values[k])}" for name, values in rewards.items()]
            scored = f"  [{', '.join(parts)}; weighted {_score(result['weightedSums'][k])}]"
        if "turns" in result:
            scored += (
                f"  [{result['turns'][k]} turns, {result['toolCalls'][k]} tool calls, "
                f"{result['toolFailures'][k]} failed]"
            )
        say(f"--- completion {k}{scored} ---\n{text}")


def register(app: typer.Typer) -> None:
    app.add_typer(
        test_app, name="test", help=HELP, short_help="Try a run's rewards or generation, without training"
    )
