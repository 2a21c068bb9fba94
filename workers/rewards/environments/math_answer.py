"""`env: math-answer`: does the completion's final answer equal the row's answer?

Who calls it: RewardSet (a spec's `env: math-answer`), or TRL directly. The comparison is
mortal.workers.rewards.builtin' (`final_number`: '#### x', else '\\boxed{x}', else the last number,
fraction or \\frac in the text; numeric equality within `tolerance`), so the function reward
`mortal.workers.rewards.builtin:math_answer` and this environment always agree. Score 1.0 or 0.0;
None when the row's answer holds no number. Cache: off by default (scoring is cheaper than hashing).
"""

from __future__ import annotations

from typing import Any, ClassVar

from mortal.workers.rewards.builtin import answers_match, final_number, parse_value
from mortal.workers.rewards.environments.base import BuiltinEnvironment, Item, Log, Outcome, column


class MathAnswerEnvironment(BuiltinEnvironment):
    """Score = 1.0 when the final answer matches `answer_column` (see the module docstring)."""

    ENV = "math-answer"
    name = "math_answer"
    DEFAULT_CACHE = "off"
    SPEC_ARGS: ClassVar[tuple[str, ...]] = ("answer_column", "tolerance", *BuiltinEnvironment.SPEC_ARGS)

    def __init__(
        self,
        answer_column: str = "answer",
        tolerance: float = 1e-6,
        cache: str | None = None,
        cache_size: int = 4096,
        cache_path: str | None = None,
    ) -> None:
        super().__init__(cache, cache_size, cache_path)
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0 (got {tolerance})")
        self.answer_column, self.tolerance = answer_column, tolerance

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "answer_column": self.answer_column, "tolerance": self.tolerance}

    def score_items(self, items: list[Item], log: Log) -> list[Outcome]:
        outcomes = []
        for item in items:
            expected = column(item, self.answer_column, "math-answer")
            if parse_value(expected) is None:
                outcomes.append(Outcome(None))
            else:
                found = final_number(item.completion)
                outcomes.append(Outcome(1.0 if answers_match(found, expected, self.tolerance) else 0.0))
        return outcomes
