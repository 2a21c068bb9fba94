"""Fault injection for crash tests: `MORTAL_FAILPOINT=<name>` kills this process (SIGKILL) at `hit(name)`.

Who calls it: the reconciler, at the points of the launch protocol a crash must be survivable from
(`launch:after-intent`, `launch:after-launch`), and run_controller before it says it started
(`controller:before-ready`). Tests start a controller with the variable set and check that the next
controller converges, or that the client that started it says it died. Without the variable it costs
one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "MORTAL_FAILPOINT"


def hit(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
