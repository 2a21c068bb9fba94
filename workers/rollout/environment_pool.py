"""A pool of child processes that host environment instances (spec.rollout.environmentService mode
processPool, and the instances behind an environment server).

Who calls it: mortal.workers.rollout.environment_proxy (the proxies' backend: `create`, `request`, `alive`,
`release`), built by mortal.workers.rollout.tools.Toolbox.from_spec in the rollout worker and by
mortal.workers.rollout.environment_server on an environment server. Each child
(mortal.workers.rollout.environment_host) holds several instances and answers one request at a time; an
instance goes to the child holding the fewest. A child that dies (killed, a segfault in the environment's
native code) is noticed by the request that meets it, and started again on the next; a request past its
deadline kills its child (and everything that child started: its own process group). Unlike a thread, a
process can be stopped, so a hung environment costs its deadline and a restart, never a leaked thread.
Either way every instance of that child is gone: `EnvironmentLost` tells the proxies, which rebuild theirs
and replay it (mortal.workers.rollout.environment_proxy).
Why a subprocess rather than multiprocessing's spawn: spawn runs the parent's __main__ module again in the
child (the whole worker's imports); this child imports only its own module, mortal.workers.references and
the environment's class. The parent's sys.path travels in PYTHONPATH, so the child imports what it does.
What it must not do: hold a lock while it waits for a child to start without a deadline, or leave children
behind (each watches its parent; `close`, also run at exit, kills them).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Any

from mortal.workers.rollout.environment_proxy import (
    EnvironmentBuildFailed,
    EnvironmentLost,
    EnvironmentRaised,
    EnvironmentTimedOut,
)

log = logging.getLogger("mortal.worker")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # one pickled request or answer; a tool's text is far smaller
START_SECONDS = 60.0  # a child's start: Python, mortal's few modules; the environment's import is in `create`
DROP_SECONDS = 5.0
EXIT_READ_SECONDS = 2.0  # how long a child whose pipe closed is given to exit, so its exit code can be told


@dataclass(frozen=True)
class Handle:
    """An instance: its child, which start of that child it was built in, and its id there."""

    host: Host
    generation: int
    iid: int


class Host:
    """One child process; its lock is held for each request (the child answers one at a time)."""

    def __init__(self, index: int, max_bytes: int, start_seconds: float) -> None:
        self.index = index
        self.max_bytes = max_bytes
        self.start_seconds = start_seconds
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None
        self.connection: Connection | None = None
        self.generation = 0  # which start this is; instances of an earlier one are gone
        self.instances: set[int] = set()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the child (the lock held) and wait for its hello; EnvironmentLost when it does not come."""
        ours, theirs = Pipe(duplex=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        command = [
            sys.executable,
            "-m",
            "mortal.workers.rollout.environment_host",
            str(theirs.fileno()),
            str(self.max_bytes),
        ]
        try:
            self.process = subprocess.Popen(
                command,
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.connection = ours
        self.generation += 1
        self.instances = set()
        try:
            if not ours.poll(self.start_seconds):
                raise EnvironmentLost(
                    f"environment process {self.index} did not start in {self.start_seconds:g} s"
                )
            status, pid = pickle.loads(ours.recv_bytes(self.max_bytes))
        except (EOFError, OSError) as exc:
            self.stop()
            raise EnvironmentLost(f"environment process {self.index} ended as it started: {exc}") from exc
        except EnvironmentLost:
            self.stop()
            raise
        log.info("environment process %d started (pid %s)", self.index, pid)

    def stop(self) -> None:
        """Kill the child and what it started (its process group), and forget its instances."""
        process, self.process = self.process, None
        if self.connection is not None:
            self.connection.close()
            self.connection = None
        self.instances = set()
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("environment process %d (pid %d) did not end after SIGKILL", self.index, process.pid)

    def exchange(self, request: tuple[Any, ...], seconds: float, what: str) -> Any:
        """One request and its answer (the lock held): the value, or EnvironmentRaised when the environment's
        code raised; EnvironmentLost when the child died or does not know the instance; EnvironmentTimedOut
        (the child killed) past `seconds`."""
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.max_bytes:
            raise EnvironmentRaised(
                "ValueError",
                f"the arguments of {what} are {len(data)} bytes, over the {self.max_bytes}-byte limit of an "
                "environment process's messages",
            )
        connection = self.connection
        if connection is None or not self.running:
            self.stop()
            raise EnvironmentLost(f"environment process {self.index} is gone")
        try:
            connection.send_bytes(data)
            answered = connection.poll(seconds)
        except OSError as exc:
            self._died(what, exc)
        if not answered:
            pid = self.process.pid if self.process is not None else None
            self.stop()
            log.warning(
                "%s did not answer within %g s: environment process %d (pid %s) killed",
                what,
                seconds,
                self.index,
                pid,
            )
            raise EnvironmentTimedOut(what, seconds)
        try:
            answer = pickle.loads(connection.recv_bytes(self.max_bytes))
        except (EOFError, OSError) as exc:
            self._died(what, exc)
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "raised":
            raise EnvironmentRaised(answer[1], answer[2])
        raise EnvironmentLost(str(answer[1]))

    def _died(self, what: str, exc: BaseException) -> Any:
        """The child closed its end: EnvironmentLost saying how it ended. Its exit is waited for a moment:
        the pipe closes as the process dies, a little before its exit code can be read."""
        process = self.process
        pid = process.pid if process is not None else None
        code = None
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(timeout=EXIT_READ_SECONDS)
        self.stop()
        if code is None:
            how = "it closed its end while running and was killed"
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        raise EnvironmentLost(
            f"environment process {self.index} (pid {pid}) died during {what} ({how}; {type(exc).__name__})"
        ) from exc


class ProcessPool:
    """`processes` children, started when first needed; the backend of processPool proxies."""

    def __init__(
        self, processes: int, max_bytes: int = MAX_MESSAGE_BYTES, start_seconds: float = START_SECONDS
    ) -> None:
        if processes < 1:
            raise ValueError("an environment process pool needs at least one process")
        self.hosts = [Host(i, max_bytes, start_seconds) for i in range(processes)]
        self._ids = itertools.count(1)
        self._placing = threading.Lock()
        self.closed = False
        atexit.register(_close_pool, weakref.ref(self))

    def __repr__(self) -> str:
        return f"ProcessPool({len(self.hosts)} processes)"

    def create(self, reference: str, seconds: float) -> Handle:
        """A new instance of `reference` on the child with the fewest; EnvironmentBuildFailed when the class
        cannot be imported or its constructor raises there."""
        with self._placing:
            host = min(self.hosts, key=lambda h: (len(h.instances), h.index))
            iid = next(self._ids)
            host.instances.add(iid)  # counted at once, so instances built together spread out
        with host.lock:
            try:
                if self.closed:
                    raise EnvironmentLost("the environment process pool is closed")
                if not host.running:
                    host.start()
                host.instances.add(iid)
                host.exchange(("create", iid, reference), seconds, f"building {reference}")
            except EnvironmentRaised as exc:
                host.instances.discard(iid)
                raise EnvironmentBuildFailed(f"building {reference}() failed: {exc.kind}: {exc}") from exc
            except BaseException:
                host.instances.discard(iid)
                raise
            return Handle(host, host.generation, iid)

    def alive(self, handle: Handle) -> bool:
        host = handle.host
        return handle.generation == host.generation and host.running

    def request(self, handle: Handle, op: str, payload: Any, seconds: float, what: str) -> Any:
        host = handle.host
        with host.lock:
            if handle.generation != host.generation:
                raise EnvironmentLost(
                    f"environment process {host.index} was replaced since this instance was built"
                )
            return host.exchange((op, handle.iid, payload), seconds, what)

    def release(self, handle: Handle) -> None:
        host = handle.host
        with host.lock:
            if handle.generation != host.generation or not host.running:
                return
            host.instances.discard(handle.iid)
            with contextlib.suppress(EnvironmentLost, EnvironmentTimedOut, EnvironmentRaised):
                host.exchange(("drop", handle.iid, None), DROP_SECONDS, "dropping an instance")

    def pid(self, handle: Handle) -> int | None:
        """The process id of the child holding the instance (None when it is gone): for tests and logs."""
        process = handle.host.process
        return process.pid if process is not None and self.alive(handle) else None

    def close(self) -> None:
        """Kill every child."""
        self.closed = True
        for host in self.hosts:
            with host.lock:
                host.stop()


def _close_pool(ref: weakref.ReferenceType[ProcessPool]) -> None:
    pool = ref()
    if pool is not None and not pool.closed:
        pool.close()
