"""The calculator example's environment with every tool call slowed by a fixed wait, for
bench/multiturn_gpu.py --tool-delay: a tool that waits (a sandbox, a web request) beside a fast one.

The wait is read from MORTAL_BENCH_TOOL_DELAY (seconds) when the class is built, so that the rollout
workers, which import this module by its reference, see the bench's value. The methods keep their names,
signatures and docstrings, so the tool schemas (and the warm-started model's calls) are the example's.
Importable where bench/ is on the path (the bench puts it on PYTHONPATH for the controller and workers).
"""

from __future__ import annotations

import os
import time

from mortal.workers.rollout.builtin_tools import ArithEnvironment

DELAY_ENV = "MORTAL_BENCH_TOOL_DELAY"


class SlowArithEnvironment(ArithEnvironment):
    """ArithEnvironment whose tools wait MORTAL_BENCH_TOOL_DELAY seconds before they answer. The methods
    are defined on the class, as tools must be (they are found on the class, as TRL finds them)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = float(os.environ.get(DELAY_ENV, "0"))

    def add(self, a: float, b: float) -> str:
        time.sleep(self.delay)
        return super().add(a, b)

    def submit(self, answer: str) -> str:
        time.sleep(self.delay)
        return super().submit(answer)

    add.__doc__ = ArithEnvironment.add.__doc__
    submit.__doc__ = ArithEnvironment.submit.__doc__
