"""The built-in reward functions' old import path, kept so that specs stored before they moved into
the reward package (`function: mortal.workers.builtin_rewards:correct_answer`) still load; new specs
name `mortal.workers.rewards.builtin`. Nothing else may import from here."""

from mortal.workers.rewards.builtin import *  # noqa: F403
