"""Calls of user code with a deadline: a reward function or a tool that may block forever (an API that never
answers) is abandoned past its deadline instead of stopping the worker.

Who calls it: mortal.workers.rewards (each reward call) and mortal.workers.rollout.tools (each tool call)
through `Abandoner.call`; mortal.workers.runtime installs `register_stack_dump` at a worker's start, so the
controller can ask a stuck worker for its stacks (SIGUSR1, where its backend can signal the process) before
it kills it, and calls `dump_stacks` from the heartbeat thread when the request comes through the store.
Why a thread rather than a subprocess: a reward function gets the task's objects (environments, the
trainer state, log callbacks) and may keep state between calls, which a subprocess could not share. Python
cannot stop a thread, so a call past its deadline is abandoned (a daemon thread, left to finish or die
with the process), and `Abandoner` bounds how many may pile up: past `limit` still running, the worker
raises `TooManyAbandonedCalls` (exit 75), and the controller relaunches it with a fresh process.
What it must not do: swallow what the call raises (the caller decides what an exception means), or let the
call's own SystemExit or KeyboardInterrupt end the worker (they reach the caller as CallExited), nor its
os._exit (guard_process_exit: raised in the call as ExitCalled, a SystemExit, which then does the same).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

log = logging.getLogger("mortal.worker")

STACK_DUMP_SIGNAL = signal.SIGUSR1
DEFAULT_ABANDONED_LIMIT = 8  # calls past their deadline still running before the worker asks to be relaunched


class CallTimedOut(Exception):
    """A call ran past its deadline and was abandoned (its thread may still be running)."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} did not return within {seconds:g} s")
        self.what = what
        self.seconds = seconds


class ExitCalled(SystemExit):
    """os._exit(code) called by user code inside a call (guard_process_exit): raised in its place."""

    def __str__(self) -> str:
        return f"os._exit({self.code})"


class CallExited(Exception):
    """The call itself raised SystemExit or KeyboardInterrupt (user code calling sys.exit, or raising
    either): an error of the call's, not a request to end this worker. Left as they are, the worker would
    exit with the user's code (0: a rollout relaunched in a loop that looks healthy) without naming the
    reward or tool; as an Exception, the caller reports it as it reports anything else the call raised."""

    def __init__(self, what: str, raised: SystemExit | KeyboardInterrupt) -> None:
        if isinstance(raised, ExitCalled):
            super().__init__(f"{what} called {raised}")
        else:
            said = f": {raised}" if str(raised) else ""
            super().__init__(f"{what} raised {type(raised).__name__}{said}")
        self.raised = raised


_in_call = threading.local()  # `pid`: set on a call's thread while user code runs there
_process_exit = os._exit  # the real one


def _guarded_exit(code: int) -> NoReturn:
    if getattr(_in_call, "pid", None) == os.getpid():  # a forked child's own exit is not the call's
        raise ExitCalled(code)
    _process_exit(code)


def guard_process_exit() -> None:
    """Make os._exit called by user code on a call's thread raise ExitCalled there instead of ending the
    process. Why a patch: os._exit ends the process at once (no exception, no `finally`, not a line in the
    log), so a reward that called it killed the rollout without a word naming it. Elsewhere (the worker's
    own threads, a child forked inside a call, whose exit multiprocessing makes with os._exit) it is the real
    one."""
    os._exit = _guarded_exit


class TooManyAbandonedCalls(RuntimeError):
    """So many abandoned calls still run that this process should be replaced (exit 75: relaunched)."""


def register_stack_dump(file: Any = None) -> bool:
    """Dump every thread's Python stack to `file` (stderr: the worker's log) when STACK_DUMP_SIGNAL comes.
    faulthandler writes from its C signal handler, so even a thread stuck in C code (a socket read) is
    shown. False where the platform has no such signal."""
    try:
        faulthandler.register(STACK_DUMP_SIGNAL, file=file or sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError):
        return False
    return True


def dump_stacks(reason: str, file: Any = None) -> None:
    """Every thread's stack to `file` (stderr: the worker's log), after a line saying why."""
    out = file or sys.stderr
    print(f"--- stacks of every thread: {reason} ---", file=out, flush=True)
    faulthandler.dump_traceback(file=out, all_threads=True)
    out.flush()


class Abandoner:
    """Runs calls on daemon threads with a deadline; counts the abandoned ones that still run."""

    def __init__(self, limit: int = DEFAULT_ABANDONED_LIMIT) -> None:
        guard_process_exit()
        self.limit = limit
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()

    @property
    def abandoned(self) -> int:
        """Abandoned calls whose threads are still running."""
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()]
            return len(self._abandoned)

    def call(self, fn: Callable[..., Any], seconds: float, what: str, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs)'s value or exception; CallTimedOut past `seconds` (stacks dumped to the log
        first); TooManyAbandonedCalls when `limit` abandoned calls already run (before starting another)."""
        if self.abandoned >= self.limit:
            raise TooManyAbandonedCalls(
                f"{self.limit} calls past their deadline are still running in this worker "
                f"(the newest: {what}); relaunching it for a fresh process"
            )
        box: dict[str, Any] = {}

        def target() -> None:
            _in_call.pid = os.getpid()
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed back to the caller's thread as it is
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"mortal-call-{what}"[:60], daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            with self._lock:
                self._abandoned.append(thread)
            dump_stacks(
                f"{what} still running after {time.monotonic() - started:.1f} s "
                f"(deadline {seconds:g} s); abandoned in thread {thread.name}"
            )
            raise CallTimedOut(what, seconds)
        if "error" in box:
            error = box["error"]
            if isinstance(error, SystemExit | KeyboardInterrupt):
                raise CallExited(what, error) from error
            raise error
        return box.get("value")
