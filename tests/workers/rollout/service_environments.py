"""Environment classes for the environment-service tests (tests/workers/rollout/test_environment_service.py).

A module of its own so that the child processes of a pool and the test's environment server import them by
reference ('service_environments:Ledger'), as they import a user's class.
"""

from __future__ import annotations

import enum
import os
import signal
import time
from typing import Any, Literal


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Ledger:
    """A stateful environment: `reset` opens the row's account, `deposit` adds to it, `balance` reads it.

    `hang` sleeps past any test deadline, `pid` says which process holds the instance, `fail` raises, `crash`
    kills its process (a reset for owner "crash" too)."""

    def __init__(self) -> None:
        self.total = 0
        self.owner: str | None = None
        self.history: list[int] = []

    def reset(self, owner: str = "nobody", opening: int = 0, **row: Any) -> str:
        if owner == "crash":  # a reset that kills its process every time
            os.kill(os.getpid(), signal.SIGKILL)
        self.owner, self.total, self.history = owner, opening, []
        return f" (account of {owner})"

    def deposit(self, amount: int, note: str | None = None) -> str:
        """Add money to the account.

        Args:
            amount: How much to add.
            note: A note kept with the deposit.
        """
        self.total += amount
        self.history.append(amount)
        return f"balance {self.total}"

    def balance(self) -> int:
        """The account's balance.

        Returns:
            The balance.
        """
        return self.total

    def paint(
        self, colour: Colour, shade: Literal["light", "dark"] = "light", tags: list[str] | None = None
    ) -> str:
        """Paint the account's card.

        Args:
            colour: The card's colour.
            shade: Light or dark (choices: ["light", "dark"])
            tags: Labels printed on the card.
        """
        return f"{shade} {colour.value if isinstance(colour, Colour) else colour} {tags or []}"

    def weigh(self, items: dict[str, float], pair: tuple[int, str], either: int | str = 0) -> float:
        """Weigh the items.

        Args:
            items: Each item's weight.
            pair: A count and a unit.
            either: A number or a name.
        """
        return sum(items.values())

    @staticmethod
    def rate(years: int) -> str:
        """The interest rate for a term.

        Args:
            years: The term in years.
        """
        return f"{years}%"

    def hang(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    def pid(self) -> int:
        """The process id of the environment.

        Returns:
            The pid.
        """
        return os.getpid()

    def crash(self) -> str:
        """Kill the environment's process.

        Returns:
            Never.
        """
        os.kill(os.getpid(), signal.SIGKILL)
        return "unreachable"

    def fail(self, why: str) -> str:
        """Raise.

        Args:
            why: The message.
        """
        raise RuntimeError(why)

    def get_reward(self) -> float:
        return float(self.total)

    @property
    def rich(self) -> bool:
        return self.total > 100

    def _private(self) -> None:
        raise AssertionError("never a tool")


class Broken:
    """An environment whose constructor raises."""

    def __init__(self) -> None:
        raise ValueError("no licence for the simulator")

    def reset(self, **row: Any) -> None:
        return None


class Undescribed:
    """A tool with neither docstring nor type hints: TRL cannot tell a model of it."""

    def reset(self, **row: Any) -> None:
        return None

    def look(self, where):  # undescribable on purpose
        return where


def served_elsewhere(
    completions: list[Any], environments: list[Any] | None = None, **kwargs: Any
) -> list[float]:
    """A reward: 1.0 for a rollout whose environment is a proxy (it lives outside the rollout worker)."""
    from mortal.workers.rollout.environment_proxy import EnvironmentProxy

    return [float(isinstance(e, EnvironmentProxy)) for e in environments or [None] * len(completions)]
