"""mortal.rewards.examples: the built-in environments, under the seed's import path.

    from mortal.rewards.examples import CodeExecutionEnvironment, LLMJudgeEnvironment, MathAnswerEnvironment

Lazy re-exports of mortal.workers.rewards.environments (a spec names them `env: code-execution`,
`env: llm-judge`, `env: math-answer`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mortal.workers.rewards.environments import (
        CodeExecutionEnvironment,
        LLMJudgeEnvironment,
        MathAnswerEnvironment,
        extract_code,
    )

_NAMES = ("CodeExecutionEnvironment", "LLMJudgeEnvironment", "MathAnswerEnvironment", "extract_code")
__all__ = ["CodeExecutionEnvironment", "LLMJudgeEnvironment", "MathAnswerEnvironment", "extract_code"]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'mortal.rewards.examples' has no attribute {name!r}")
    value = getattr(importlib.import_module("mortal.workers.rewards.environments"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
