"""mortal: Kubernetes-style operator for RL (GRPO) training of language models. The public facade.

    from mortal import MortalTrainer, SingleNode, Distributed, GPUConfig, RewardEnvironment, TrainingRun

Names are imported on first use (module __getattr__), so `import mortal` and `mortalctl --help`
stay fast and never import torch or TRL. Everything else lives in mortal.client, mortal.specs, mortal.state,
mortal.controller and mortal.workers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mortal.client.modes import Distributed, GPUConfig, SingleNode
    from mortal.client.trainer import ControllerStartFailed, MortalTrainer, TrainingFailed
    from mortal.specs import TrainingRun
    from mortal.workers.rewards import RewardEnvironment

_EXPORTS = {
    "MortalTrainer": "mortal.client.trainer",
    "TrainingFailed": "mortal.client.trainer",
    "ControllerStartFailed": "mortal.client.trainer",
    "SingleNode": "mortal.client.modes",
    "Distributed": "mortal.client.modes",
    "GPUConfig": "mortal.client.modes",
    "TrainingRun": "mortal.specs",
    "RewardEnvironment": "mortal.workers.rewards",
}

__all__ = [
    "ControllerStartFailed",
    "Distributed",
    "GPUConfig",
    "MortalTrainer",
    "RewardEnvironment",
    "SingleNode",
    "TrainingFailed",
    "TrainingRun",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mortal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
