"""The controller on this machine, as a client sees it: woken on a change, started if none runs.

Called by the verbs that change desired state and by MortalTrainer.train(). Nothing is started with
--no-controller (MortalTrainer's start_controller=False) or MORTAL_NO_CONTROLLER=1 (tests, CI, a
controller run by systemd).
"""

from __future__ import annotations

import os
import sys

NO_CONTROLLER_ENV = "MORTAL_NO_CONTROLLER"


def controller_disabled(flag: bool) -> bool:
    """--no-controller, or MORTAL_NO_CONTROLLER=1."""
    return flag or os.environ.get(NO_CONTROLLER_ENV, "").lower() in ("1", "true", "yes")


def wake_controller(*names: str) -> None:
    """Tell a controller on this machine that these runs' desired state changed, so it acts now."""
    from mortal.controller.wake import notify

    for name in names or (None,):
        notify(name)


def ensure_controller(state_url: str | None, disabled: bool, announce: bool = True) -> None:
    """Start a background controller on `state_url`'s store unless one runs (or the user said not to); say so
    on stderr when one was started, or is still starting. Raises ControllerStartFailed when the one started
    exited during its start: what the caller wrote stays, with nothing to act on it."""
    if controller_disabled(disabled):
        return
    from mortal.controller.manager import START_TIMEOUT_SECONDS, ensure_background_controller

    started = ensure_background_controller(state_url)
    if started is None or not announce:
        return
    where = f"pid {started.pid}, log: {started.log}"
    if started.ready:
        print(f"controller started ({where})", file=sys.stderr, flush=True)
    else:
        print(
            f"controller still starting after {START_TIMEOUT_SECONDS:g}s ({where}); "
            "`mortalctl controller status` says whether it runs",
            file=sys.stderr,
            flush=True,
        )


def finish_deletion(state_url: str | None, disabled: bool, name: str, announce: bool = True) -> None:
    """A run of this name is being deleted and a caller waits for its purge, which is a controller's: start
    one unless one runs (one killed meanwhile, or `delete --no-controller`, left it Terminating), and wake
    it for the run."""
    ensure_controller(state_url, disabled, announce)
    wake_controller(name)
