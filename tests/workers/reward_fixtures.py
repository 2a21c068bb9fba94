"""Reward functions for the rewards and rollout tests, referenced by import path (`reward_fixtures:NAME`).

tests/workers is on sys.path during the tests (pytest's rootdir conftest) and on the PYTHONPATH of
the rollout worker processes the tests launch.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mortal.workers.rewards import RewardEnvironment

CALLS: list[dict[str, Any]] = []


def record_kwargs(completions, **kwargs):
    """Scores 1.0 and remembers what TRL-style arguments it was given."""
    CALLS.append({"completions": completions, **kwargs})
    return [1.0] * len(completions)


def length_of_answer(completions, answer, **kwargs):
    return [float(len(str(a))) for a in answer]


def only_first(completions, **kwargs):
    """Applies to the first completion only: None elsewhere (TRL's 'not applicable')."""
    return [0.5] + [None] * (len(completions) - 1)


def nan_scores(completions, **kwargs):
    return [float("nan")] * len(completions)


def raises(completions, **kwargs):
    raise ValueError("boom: cannot score this")


def wrong_length(completions, **kwargs):
    return [1.0]


def not_a_list(completions, **kwargs):
    return 1.0


def strings(completions, **kwargs):
    return ["good"] * len(completions)


def scaled(completions, scale=1.0, **kwargs):
    return [scale] * len(completions)


async def async_reward(completions, **kwargs):
    await asyncio.sleep(0)
    return [2.0] * len(completions)


def step_aware(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / max(trainer_state.max_steps, 1)] * len(completions)


def logs_things(completions, log_metric, log_extra, **kwargs):
    log_metric("my_metric", 3.0)
    log_extra("my_column", ["x"] * len(completions))
    return [0.0] * len(completions)


NOT_CALLABLE = 42


class ContainsWord(RewardEnvironment):
    """A RewardEnvironment scoring one completion at a time, configured by `args`."""

    name = "contains"

    def __init__(self, word: str = "yes") -> None:
        self.word = word

    def score(self, completion: str, prompt: str, **kwargs) -> float:
        return 1.0 if self.word in completion else 0.0


class AnswerInPrompt(RewardEnvironment):
    """Checks that score() sees the prompt text and this completion's dataset columns."""

    def score(self, completion: str, prompt: str, answer: str = "", **kwargs) -> float:
        return 1.0 if prompt.startswith("What is") and answer == "3" and "trainer_state" in kwargs else 0.0


def numpy_scores(completions, **kwargs):
    import numpy as np

    return np.arange(len(completions), dtype=np.float32)


def infinite(completions, **kwargs):
    return [float("inf")] * len(completions)


def too_big(completions, **kwargs):
    return [10**400] * len(completions)


def exits(completions, **kwargs):
    import sys

    sys.exit(0)


def exits_at_once(completions, **kwargs):
    import os

    os._exit(3)


def interrupts(completions, **kwargs):
    raise KeyboardInterrupt("user ctrl-c")


def server_down(completions, **kwargs):
    """What an environment's get_reward() raises through its proxy while the environment server is down."""
    from mortal.workers.rollout.environment_proxy import EnvironmentUnreachable

    raise EnvironmentUnreachable("the environment server at http://envs is unreachable")


def answers_only_step_0(completions, trainer_state, **kwargs):
    """Scores the first step's batch, then answers each call too late for a short timeoutSeconds (its
    abandoned thread ends soon after)."""
    if trainer_state.global_step == 0:
        return [1.0] * len(completions)
    time.sleep(0.5)
    return [1.0] * len(completions)


def not_applicable(completions, **kwargs):
    """Applies to no completion: None for each (TRL's 'not applicable'), at once."""
    return [None] * len(completions)
