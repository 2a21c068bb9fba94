"""mortal.rewards: what a reward author imports (the seed's `from mortal.rewards import ...`).

    from mortal.rewards import RewardEnvironment, SandboxConfig
    from mortal.rewards.examples import CodeExecutionEnvironment, LLMJudgeEnvironment

Lazy re-exports only, like mortal/__init__.py: the code lives in mortal.workers.rewards,
mortal.workers.rewards.sandbox and mortal.workers.rewards.environments.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mortal.workers.rewards import RewardEnvironment
    from mortal.workers.rewards.environments import RewardCache
    from mortal.workers.rewards.sandbox import (
        ExecutionResult,
        Executor,
        FunctionConfig,
        Job,
        SandboxConfig,
        SandboxUnavailable,
    )

_EXPORTS = {
    "RewardEnvironment": "mortal.workers.rewards",
    "SandboxConfig": "mortal.workers.rewards.sandbox",
    "FunctionConfig": "mortal.workers.rewards.sandbox",
    "ExecutionResult": "mortal.workers.rewards.sandbox",
    "Executor": "mortal.workers.rewards.sandbox",
    "Job": "mortal.workers.rewards.sandbox",
    "SandboxUnavailable": "mortal.workers.rewards.sandbox",
    "RewardCache": "mortal.workers.rewards.environments",
}

__all__ = [
    "ExecutionResult",
    "Executor",
    "FunctionConfig",
    "Job",
    "RewardCache",
    "RewardEnvironment",
    "SandboxConfig",
    "SandboxUnavailable",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mortal.rewards' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
