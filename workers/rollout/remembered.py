"""Values a tool loop computes once a key (rendered prompts, parsed turns, tool answers' suffixes), and the
key its tools contribute.

Who uses it: mortal.workers.rollout.multiturn and mortal.workers.rollout.turn_parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Remembered:
    """Values computed once a key, at most `limit` kept: past it every one is forgotten at once (a task's keys
    repeat within the task, seldom across tasks, so no order of use is worth tracking). Why not
    functools.lru_cache: the keys are what a caller builds from unhashable arguments (token lists, message
    dicts), and the values come from the MultiTurn's own tokenizer and template."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._values: dict[Any, Any] = {}

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        if key not in self._values:
            if len(self._values) >= self.limit:
                self._values.clear()
            self._values[key] = compute()
        return self._values[key]


def tool_functions(tools: list[Any]) -> tuple[Any, ...]:
    """The functions behind `tools`: a bound method of each rollout's environment has its class's function,
    which is what its schema depends on."""
    return tuple(getattr(tool, "__func__", tool) for tool in tools)
