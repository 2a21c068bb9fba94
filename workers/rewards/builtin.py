"""Reward functions that ship with mortal, written exactly like TRL's (one score per completion).

Referenced from specs by import path, e.g. `function: mortal.workers.rewards.builtin:correct_answer`
(specs/examples/quickstart.yaml). Called by mortal.workers.rewards on the rollout side with
`prompts`, `completions` (text, or [{'role': 'assistant', 'content': ...}] for chat prompts),
`completion_ids` and every dataset column as keyword arguments; they work unchanged as
`reward_funcs` of TRL's GRPOTrainer. Pure functions: no I/O, no model, no state.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# A final answer may be a number, a fraction 'a/b' or a LaTeX \frac{a}{b} (math_answer and the math-answer
# env).
VALUE = re.compile(
    r"-?\\d?frac\{\s*-?[\d,]*\.?\d+\s*\}\{\s*-?[\d,]*\.?\d+\s*\}|-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"
)
HASH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
BOXED_ANSWER = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
LATEX_FRACTION = re.compile(r"(-?)\\d?frac\{\s*(-?[\d,]*\.?\d+)\s*\}\{\s*(-?[\d,]*\.?\d+)\s*\}")
FRACTION = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)/(\d[\d,]*(?:\.\d+)?)")


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


def parse_value(text: Any) -> float | None:
    """The first number, fraction ('3/4') or LaTeX fraction ('\\frac{3}{4}') in `text`, as a float."""
    if isinstance(text, int | float):
        return float(text)
    match = VALUE.search(str(text))
    if match is None:
        return None
    found = match.group()
    for pattern in (LATEX_FRACTION, FRACTION):
        parts = pattern.fullmatch(found)
        if parts is not None:
            *sign, top, bottom = parts.groups()
            numerator, denominator = float(top.replace(",", "")), float(bottom.replace(",", ""))
            if denominator == 0:
                return None
            return (-1.0 if sign and sign[0] else 1.0) * numerator / denominator
    return parse_number(found)


def answers_match(found: float | None, expected: Any, tolerance: float = 1e-6) -> bool:
    """`found` (a parsed answer) equals the value in `expected` within `tolerance`; False if either is
    missing."""
    target = parse_value(expected)
    return found is not None and target is not None and abs(found - target) <= tolerance


def correct_answer(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the first number in the completion equals `answer` (the arith anchor's reward)."""
    return [
        1.0 if answers_match(parse_number(completion_text(c)), a) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def short_answer(completions: list[Any], max_chars: int = 4, **kwargs: Any) -> list[float]:
    """1.0 when the stripped completion is at most `max_chars` characters (the anchor's `short`)."""
    return [1.0 if len(completion_text(c).strip()) <= max_chars else 0.0 for c in completions]


def format_number(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the whole completion is one number and nothing else (e.g. '42', '-3.5', '1,200')."""
    return [1.0 if NUMBER.fullmatch(completion_text(c).strip() or "x") else 0.0 for c in completions]


def final_number(text: str) -> float | None:
    """The answer a solution gives: '#### x', else '\\boxed{x}', else its last value (x: number or
    fraction)."""
    for pattern in (HASH_ANSWER, BOXED_ANSWER):
        found = [v for v in map(parse_value, pattern.findall(text)) if v is not None]
        if found:
            return found[-1]
    values = VALUE.findall(text)
    return parse_value(values[-1]) if values else None


def math_answer(
    completions: list[Any], answer: list[Any], tolerance: float = 1e-6, **kwargs: Any
) -> list[float]:
    """1.0 when the completion's final answer ('#### x', boxed, or last value) equals `answer` within
    `tolerance`."""
    return [
        1.0 if answers_match(final_number(completion_text(c)), a, tolerance) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]
