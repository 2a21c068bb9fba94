"""The one wait of the real-process tests: poll a condition until it holds, or fail saying what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    check: Callable[[], T],
    timeout: float = 20.0,
    what: str = "condition",
    interval: float = 0.05,
    give_up: Callable[[], bool] | None = None,
    details: Callable[[], str] | None = None,
) -> T:
    """Return `check()`'s first truthy value. AssertionError naming `what` after `timeout` seconds, or
    as soon as `give_up()` is true (e.g. the process under test exited); `details()` adds context."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline or (give_up is not None and give_up()):
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what} (last: {value!r}){extra}"
            )
        time.sleep(interval)
