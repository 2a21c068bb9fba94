"""What answering a round of tool calls costs when the tools run model-written code: one rollout's calls
after another's (TRL's order) against different rollouts' at once (mortal's Toolbox.call_each).

    python bench/tool_calls.py [--rollouts 32] [--repeats 2] [--json out.json]

Why: a code agent's tool (CodeAgentEnvironment.run_tests, the shipped mbpp-mini agent) starts a sandbox
process for every call, and a round of a task's rollouts waits for all of them
before the next turn is generated. Each rollout gets its own environment, reset with a row of
builtin:mbpp-mini, and calls run_tests once with code that fails its tests (the common first attempt) and
once with the row's solution. Both modes run in this invocation on the same calls; each is timed
--repeats times and the fastest kept. The outcomes must be equal in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from mortal.specs.training import DatasetSpec
from mortal.workers.data import read_raw_rows
from mortal.workers.rollout import tools
from mortal.workers.rollout.builtin_tools import CodeAgentEnvironment
from mortal.workers.rollout.tools import Toolbox


def _calls(rows: list[dict[str, Any]], box: Toolbox) -> list[tuple[list[Any], list[dict[str, Any]]]]:
    """Per rollout: its environment's tools, and a failing then a passing run_tests call."""
    rollouts = []
    for row, environment in zip(rows, box.environments_for([None] * len(rows)), strict=True):
        environment.reset(**row)
        failing = row["solution"].split("\n")[0] + "\n    return None\n"
        calls = [
            {"type": "function", "function": {"name": "run_tests", "arguments": {"code": code}}}
            for code in (failing, row["solution"])
        ]
        rollouts.append((box.tools_for(environment), calls))
    return rollouts


def measure(rollouts: int, repeats: int, concurrent: int) -> tuple[float, list[list[str]]]:
    """Fastest seconds of one round of every rollout's two calls, and the outcomes' contents."""
    rows = read_raw_rows(DatasetSpec(name="builtin:mbpp-mini"))
    rows = [rows[i % len(rows)] for i in range(rollouts)]
    tools.CONCURRENT_ROLLOUTS = concurrent
    box = Toolbox(environments={None: CodeAgentEnvironment}, timeout_seconds=60)
    best, contents = float("inf"), []
    for _ in range(repeats):
        calls = _calls(rows, box)
        started = time.perf_counter()
        outcomes = box.call_each(calls)
        best = min(best, time.perf_counter() - started)
        contents = [[o.content for o in rollout] for rollout in outcomes]
    return best, contents


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    default = tools.CONCURRENT_ROLLOUTS
    one_by_one, expected = measure(args.rollouts, args.repeats, concurrent=1)
    at_once, got = measure(args.rollouts, args.repeats, concurrent=default)
    if got != expected:
        raise SystemExit("the outcomes differ between the two modes")
    passed = sum(c == "All tests passed." for rollout in got for c in rollout)
    result = {
        "bench": "tool_calls",
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "rollouts": args.rollouts,
        "calls": 2 * args.rollouts,
        "passed_calls": passed,
        "repeats": args.repeats,
        "one_rollout_after_another_seconds": round(one_by_one, 3),
        f"up_to_{default}_rollouts_at_once_seconds": round(at_once, 3),
        "speedup": round(one_by_one / at_once, 2),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
