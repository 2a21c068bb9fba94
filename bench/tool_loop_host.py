"""The tool loop's own host work for one task, with the engine taken out: what a GPU waits on.

    python bench/tool_loop_host.py [--tokenizer FOLDER] [--prompts 8] [--gens 8] [--tasks 5] [--profile N]
                                   [--json out.json]

Why: on a GPU a tool-calling task's decode steps fill only part of its wall time (docs/benchmarks.md, the
turn profile); the rest is the host. Part of that host work is the tool loop's own (multiturn.MultiTurn): each
rollout's prompt rendered with its tools, each turn parsed with TRL's parse_response, the tools called, their
answers rendered. This times that part alone, on any machine, so that changes to it can be measured where no
GPU is.
How: the calculator example (specs/examples/calculator-tools.yaml: dataset, tools, environment, chat template)
through MultiTurn's continuous path over a ReplayEngine, new dataset rows each task (as a run's steps have),
whose `converse` answers at once with the turns a warm-started model says (bench/multiturn_gpu.py's
demonstrations: a calculator call, a submit call, the answer), as token ids of the example's template; every
turn goes through on_turn_end and its future as the transformers engine sends it, a round of every live
conversation's turns at a time. Prints one JSON line:
each task's seconds, the lowest and the median, turns and tool calls a task; --profile N lists the N
functions of most cumulative time of one more task (cProfile, every thread's calls as seen from the
calling one: the pool's work shows under its futures' waits).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn_gpu import arith_expression  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "specs" / "examples" / "calculator-tools.yaml"


def replayed_turns(tokenizer: Any, row: dict[str, Any]) -> list[list[int]]:
    """What a warm-started model says for a builtin:arith row, turn by turn, as the qwen2_5 template's ids."""
    expression, answer = arith_expression(row), str(row["answer"])

    def call(name: str, arguments: dict[str, str]) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"

    texts = [
        call("calculator", {"expression": expression}),
        call("submit", {"answer": answer}),
        answer + "<|im_end|>",
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@dataclass
class Replayed:
    """What each conversation of the task now running says (set per task), for the replay engine."""

    turns_of: list[list[list[int]]] = field(default_factory=list)


def replay_engine(replayed: Replayed) -> Any:
    """An Engine whose conversation i says `replayed.turns_of[i]` in order (prompts and seeds ignored)."""
    from mortal.workers.rollout.engines.base import Engine

    class ReplayEngine(Engine):
        name = "replay"

        def continues_turns(self) -> bool:
            return True

        def converse(self, prompts, seeds, params, on_turn_end) -> None:  # noqa: ANN001
            said = [0] * len(prompts)
            live = list(range(len(prompts)))
            while live:
                futures: list[tuple[int, Future | None]] = []
                for i in live:
                    turns = replayed.turns_of[i]
                    ids = turns[min(said[i], len(turns) - 1)]
                    said[i] += 1
                    futures.append((i, on_turn_end(i, ids, [0.0] * len(ids))))
                live = [i for i, future in futures if future is not None and future.result() is not None]

        def generate(self, prompts, n, seeds, params):  # noqa: ANN001
            raise NotImplementedError("the replay engine only converses")

        def load_weights(self, path, transport=None) -> None:  # noqa: ANN001
            raise NotImplementedError("the replay engine has no weights")

        @classmethod
        def create(cls, *args, **kwargs):  # noqa: ANN002, ANN003, ANN206
            raise NotImplementedError("made by replay_engine")

        def close(self) -> None:
            pass

    return ReplayEngine()


class Tasks:
    """The example's tool loop over a ReplayEngine, and each task's requests: the dataset's next --prompts
    rows, each --gens rollouts."""

    def __init__(self, args: argparse.Namespace) -> None:
        from mortal.specs import TrainingRun
        from mortal.workers.data import load_rows
        from mortal.workers.models import load_tokenizer
        from mortal.workers.rollout.engines import GenerationParams
        from mortal.workers.rollout.multiturn import MultiTurn
        from mortal.workers.rollout.tools import Toolbox

        document = yaml.safe_load(EXAMPLE.read_text())
        if args.tokenizer is not None:
            document["spec"]["model"] = {**document["spec"]["model"], "name": str(args.tokenizer)}
        spec = TrainingRun.model_validate(document).spec
        self.rows = load_rows(spec.dataset)
        self.tokenizer = load_tokenizer(spec.model)
        self.replayed = Replayed()
        params = GenerationParams.from_spec(spec.generation)
        toolbox = Toolbox.from_spec(spec.rollout)
        self.loop = MultiTurn(
            replay_engine(self.replayed), self.tokenizer, toolbox, params, spec.rollout.chat_template
        )
        self.prompts, self.gens = args.prompts, args.gens
        self.next_row = 0

    def next_requests(self) -> list[Any]:
        from mortal.workers import schedule
        from mortal.workers.messages import RolloutRequest

        if self.next_row + self.prompts > len(self.rows):
            raise SystemExit(f"the dataset has {len(self.rows)} rows: fewer --tasks or --prompts")
        rows = self.rows[self.next_row : self.next_row + self.prompts]
        self.next_row += self.prompts
        said = [replayed_turns(self.tokenizer, row) for row in rows]
        self.replayed.turns_of = [turns for turns in said for _ in range(self.gens)]
        return [
            RolloutRequest(
                prompt=row["prompt"], row=row, num_generations=self.gens, seed=schedule.task_seed(0, 1, i)
            )
            for i, row in enumerate(rows)
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokenizer", type=Path, help="a tokenizer folder (default: the example's model, SmolLM2's GGUF)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="list N functions of one task")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    tasks = Tasks(args)
    tasks.loop.rollouts(tasks.next_requests())  # untimed: imports, the template compiled
    seconds, turns, calls = [], 0, 0
    for _ in range(args.tasks):
        requests = tasks.next_requests()
        started = time.perf_counter()
        groups = tasks.loop.rollouts(requests)
        seconds.append(time.perf_counter() - started)
        rollouts = [r for group in groups for r in group]
        turns, calls = sum(r.turns for r in rollouts), sum(r.tool_calls for r in rollouts)
    out: dict[str, Any] = {
        "rollouts": args.prompts * args.gens,
        "tasks": [round(s, 4) for s in seconds],
        "lowest": round(min(seconds), 4),
        "median": round(statistics.median(seconds), 4),
        "turns_a_task": turns,
        "tool_calls_a_task": calls,
    }
    print(json.dumps(out), flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(tasks.loop.rollouts, tasks.next_requests())
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile)
        print(text.getvalue(), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
