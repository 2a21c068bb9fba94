"""mortal.rewards: what a reward author imports (the seed's `from mortal.rewards import ...`).

    from mortal.rewards import RewardEnvironment, SandboxConfig
    from mortal.rewards.examples import CodeExecutionEnvironment, LLMJudgeEnvironment

Lazy re-exports only, like mortal/__init__.py: the code lives in mortal.workers.rewards,
mortal.workers.sandbox and mortal.workers.environments.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mortal.workers.environments import RewardCache
    from mortal.workers.rewards import RewardEnvironment
    from mortal.workers.sandbox import (
        ExecutionResult,
        Executor,
        FunctionConfig,
        Job,
        SandboxConfig,
        SandboxUnavailable,
    )

_EXPORTS = {
    "RewardEnvironment": "mortal.workers.rewards",
    "SandboxConfig": "mortal.workers.sandbox",
    "FunctionConfig": "mortal.workers.sandbox",
    "ExecutionResult": "mortal.workers.sandbox",
    "Executor": "mortal.workers.sandbox",
    "Job": "mortal.workers.sandbox",
    "SandboxUnavailable": "mortal.workers.sandbox",
    "RewardCache": "mortal.workers.environments",
}

__all__ = ["ExecutionResult", "Executor", "FunctionConfig", "Job", "RewardCache", "RewardEnvironment", "SandboxConfig",
           "SandboxUnavailable"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mortal.rewards' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
