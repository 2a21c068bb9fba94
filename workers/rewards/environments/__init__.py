"""The built-in reward environments: code-execution, llm-judge and math-answer (a spec's `env:`).

    from mortal.workers.rewards.environments import CodeExecutionEnvironment, LLMJudgeEnvironment,
    MathAnswerEnvironment

Who uses it: mortal.workers.rewards.load_reward (through `factory.build_environment`, for `env:`
entries) and users through the facade `mortal.rewards.examples`. Each environment is a
RewardEnvironment (a TRL reward function) with a reward cache (cache.py).
"""

from __future__ import annotations

from mortal.workers.rewards.environments.base import BuiltinEnvironment, Item, Outcome
from mortal.workers.rewards.environments.cache import RewardCache
from mortal.workers.rewards.environments.code_execution import CodeExecutionEnvironment, extract_code
from mortal.workers.rewards.environments.llm_judge import LLMJudgeEnvironment, parse_score
from mortal.workers.rewards.environments.math_answer import MathAnswerEnvironment

ENVIRONMENTS: dict[str, type[BuiltinEnvironment]] = {
    "code-execution": CodeExecutionEnvironment,
    "llm-judge": LLMJudgeEnvironment,
    "math-answer": MathAnswerEnvironment,
}

__all__ = [
    "ENVIRONMENTS",
    "BuiltinEnvironment",
    "CodeExecutionEnvironment",
    "Item",
    "LLMJudgeEnvironment",
    "MathAnswerEnvironment",
    "Outcome",
    "RewardCache",
    "extract_code",
    "parse_score",
]
