"""Reward functions that ship with mortal, written exactly like TRL's (one score per completion).

Referenced from specs by import path, e.g. `function: mortal.workers.builtin_rewards:correct_answer`
(specs/examples/quickstart.yaml). Called by mortal.workers.rewards on the rollout side with
`prompts`, `completions` (text, or [{'role': 'assistant', 'content': ...}] for chat prompts),
`completion_ids` and every dataset column as keyword arguments; they work unchanged as
`reward_funcs` of TRL's GRPOTrainer. Pure functions: no I/O, no model, no state.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
HASH_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
BOXED_ANSWER = re.compile(r"\\boxed\{\s*(-?[\d,]*\.?\d+)\s*\}")


def completion_text(completion: Any) -> str:
    """The text of a completion in either of TRL's formats (text, or a list of chat messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def parse_number(text: Any) -> float | None:
    """'1,234' -> 1234.0; None when `text` holds no number."""
    if isinstance(text, int | float):
        return float(text)
    match = NUMBER.search(str(text))
    if match is None:
        return None
    try:
        return float(match.group().replace(",", ""))
    except ValueError:
        return None


def _equal(found: float | None, expected: Any) -> bool:
    target = parse_number(expected)
    return found is not None and target is not None and abs(found - target) < 1e-6


def correct_answer(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the first number in the completion equals `answer` (the arith anchor's reward)."""
    return [1.0 if _equal(parse_number(completion_text(c)), a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def short_answer(completions: list[Any], max_chars: int = 4, **kwargs: Any) -> list[float]:
    """1.0 when the stripped completion is at most `max_chars` characters (the anchor's `short`)."""
    return [1.0 if len(completion_text(c).strip()) <= max_chars else 0.0 for c in completions]


def format_number(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the whole completion is one number and nothing else (e.g. '42', '-3.5', '1,200')."""
    return [1.0 if NUMBER.fullmatch(completion_text(c).strip() or "x") else 0.0 for c in completions]


def final_number(text: str) -> float | None:
    """The answer a GSM8K-style solution gives: '#### n', else '\\boxed{n}', else its last number."""
    for pattern in (HASH_ANSWER, BOXED_ANSWER):
        found = pattern.findall(text)
        if found:
            return parse_number(found[-1])
    numbers = NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def math_answer(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer ('#### n', boxed, or last number) equals `answer`."""
    return [1.0 if _equal(final_number(completion_text(c)), a) else 0.0 for c, a in zip(completions, answer, strict=True)]
