"""The tool loop's continuous path against its lock-step path, one engine, the same requests, one invocation.

    python bench/tool_loop_paths.py --model PATH.gguf|FOLDER [--prompts 8] [--gens 4] [--rounds 2]

The calculator example (specs/examples/calculator-tools.yaml: its dataset, system prompt, tools, environment,
chat template and maxTokens) through mortal.workers.rollout.multiturn.MultiTurn on the transformers engine:
- continuous: every rollout a conversation of Engine.converse (turn_decode.py), kept in a decoder row across
  its turns, its tools run on a pool while the other rows decode, the shared prompt prefix prefilled once;
- lock-step: one engine call per round of turns, each history prefilled again (on the CPU the per-prompt
  path: `model.generate` per prompt, each later turn one rollout at a time).
Both sides alternate `--rounds` times over the same requests (seeds fixed). SmolLM2 as shipped seldom calls
a tool, so with that model this times the generation of each path, tool rounds where they happen. Prints
one JSON line: each side's seconds per task (each round's and the lowest), completion tokens (model and tool
tokens in completions), tool calls, completion tokens per second at each side's lowest, and continuous's over
lock-step's. Absolute seconds count only
from a GPU run; on the CPU the ratio is what this says.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "specs" / "examples" / "calculator-tools.yaml"


def example_setup(args: argparse.Namespace) -> tuple[list[Any], Any, Any, Any, Any]:
    """(requests, engine, tokenizer, toolbox, spec) for the example's first --prompts rows."""
    from mortal.specs import TrainingRun
    from mortal.workers import schedule
    from mortal.workers.data import load_rows
    from mortal.workers.messages import RolloutRequest
    from mortal.workers.models import load_tokenizer
    from mortal.workers.rollout.engines.transformers_engine import TransformersEngine
    from mortal.workers.rollout.tools import Toolbox

    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["model"] = {**document["spec"]["model"], "name": str(args.model), "dtype": "float32"}
    run = TrainingRun.model_validate(document)
    spec = run.spec
    rows = load_rows(spec.dataset)[: args.prompts]  # prompts with the system prompt, as rollouts get them
    requests = [
        RolloutRequest(
            prompt=row["prompt"], row=row, num_generations=args.gens, seed=schedule.task_seed(args.seed, 1, i)
        )
        for i, row in enumerate(rows)
    ]
    tokenizer = load_tokenizer(spec.model)
    engine = TransformersEngine.create(spec.model, tokenizer, device=args.device)
    return requests, engine, tokenizer, Toolbox.from_spec(spec.rollout), spec


def timed(loop: Any, requests: list[Any]) -> tuple[float, int, int]:
    """Seconds of one task's rollouts, their completion tokens and their tool calls."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    groups = loop.rollouts(requests)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = time.perf_counter() - started
    rollouts = [r for group in groups for r in group]
    return took, sum(len(r.completion_ids) for r in rollouts), sum(r.tool_calls for r in rollouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file or a Hugging Face folder")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from mortal.workers.rollout.engines import GenerationParams
    from mortal.workers.rollout.multiturn import MultiTurn

    requests, engine, tokenizer, toolbox, spec = example_setup(args)
    params = GenerationParams.from_spec(spec.generation)
    loops = {
        side: MultiTurn(engine, tokenizer, toolbox, params, spec.rollout.chat_template, continuous=continuous)
        for side, continuous in (("continuous", True), ("lock_step", False))
    }
    for loop in loops.values():  # warm-up: the decoder's first shapes, the tokenizer's caches
        timed(loop, requests[:1])
    seconds: dict[str, list[float]] = {side: [] for side in loops}
    tokens: dict[str, int] = {}
    calls: dict[str, int] = {}
    for _ in range(args.rounds):
        for side, loop in loops.items():
            took, tokens[side], calls[side] = timed(loop, requests)
            seconds[side].append(round(took, 3))
    lowest = {side: min(values) for side, values in seconds.items()}
    per_second = {side: round(tokens[side] / lowest[side], 2) for side in loops}
    print(
        json.dumps(
            {
                "device": args.device,
                "gpus": 0 if args.device == "cpu" else 1,
                "model": str(args.model),
                "rollouts": args.prompts * args.gens,
                "max_tokens": params.max_tokens,
                "seconds": seconds,
                "lowest": lowest,
                "completion_tokens": tokens,
                "tool_calls": calls,
                "tokens_per_second": per_second,
                "continuous_over_lock_step": round(per_second["continuous"] / per_second["lock_step"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
