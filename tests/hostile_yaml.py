"""Spec texts that attack the YAML reader, shared by the tests of every way a spec comes in.

billion_laughs()   a TrainingRun of a few hundred bytes whose nested aliases stand for 9**9 strings
deep_json(n)       a TrainingRun in JSON with a value nested n lists deep
bounded(call)      runs call(), returning (what it raised or returned, seconds, peak bytes allocated)
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

HEADER = "apiVersion: mortal/v1\nkind: TrainingRun\nmetadata: {name: lol}\nspec:\n  model: {name: tiny}\n"
# Limits the tests hold every entry point to: far below what expanding the aliases would take (minutes,
# gigabytes), far above what a refusal takes under tracemalloc on a loaded CI machine. Memory is the
# tight bound; time only tells "refused before expanding" from "expanded, then refused".
FAST_SECONDS = 10.0
SMALL_BYTES = 64 * 1024 * 1024


def billion_laughs(levels: int = 9) -> str:
    """Level 0 is nine strings; each next level is nine aliases of the one before it."""
    lines = ["  l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return HEADER + "\n".join(lines) + "\n"


def deep_json(levels: int) -> str:
    return (
        '{"apiVersion": "mortal/v1", "kind": "TrainingRun", "metadata": {"name": "deep"}, '
        '"spec": {"model": {"name": "tiny"}, "deep": ' + "[" * levels + "]" * levels + "}}"
    )


def bounded(call: Callable[[], Any]) -> tuple[Any, float, int]:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        outcome = call()
    except Exception as exc:  # the caller asserts on what was raised
        outcome = exc
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return outcome, seconds, peak
