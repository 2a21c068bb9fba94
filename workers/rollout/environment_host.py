"""The child process of an environment process pool: it builds environment instances and answers calls on
them, one at a time, over a socket its parent handed it.

Who runs it: mortal.workers.rollout.environment_pool starts `python -m mortal.workers.rollout.environment_host
FD` (its own process group, so that killing it also ends what the environment started) and speaks to it on
FD with length-prefixed pickles (multiprocessing's Connection): each request is (op, instance id, payload),
each answer ("ok", value), ("raised", exception type name, message) when the environment's code raised, or
("lost", message) when the instance is unknown here. Pickles are fine: both ends are our own processes, and
what the environment returns is trusted as much as it would be in the worker. Answers over `max_bytes` are
refused with a "raised" answer rather than sent.
What it must not do: write to stdout or stderr itself (the environment's own prints go to the worker's log),
outlive its parent (a watchdog ends it when the parent is gone, even while a call hangs), or import more than
the environment needs: it starts on every replacement.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from mortal.workers.errors import exception_text

PARENT_CHECK_SECONDS = 1.0


def _awaited(value: Any) -> Any:
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class Host:
    """The instances this process holds, and what each request does to them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.instances: dict[int, Any] = {}
        self.classes: dict[str, Any] = {}

    def answer(self, request: Any) -> tuple[Any, ...]:
        op, iid, payload = request
        if op == "create":
            return ("ok", self._create(iid, payload))
        if op == "drop":
            self.instances.pop(iid, None)
            return ("ok", None)
        if iid not in self.instances:
            return ("lost", f"instance {iid} is not in environment process {os.getpid()}")
        instance = self.instances[iid]
        if op == "reset":
            args, kwargs = payload
            observation = _awaited(instance.reset(*args, **kwargs))
            return ("ok", observation if isinstance(observation, str) else None)
        if op == "call":
            name, args, kwargs = payload
            # str(result), as TRL makes a tool message's content: what the model reads, and always sendable
            return ("ok", str(_awaited(getattr(instance, name)(*args, **kwargs))))
        if op == "get_reward":
            return ("ok", _awaited(instance.get_reward()))
        if op == "attribute":
            return ("ok", getattr(instance, payload))
        return ("lost", f"unknown request {op!r}")

    def _create(self, iid: int, reference: str) -> None:
        from mortal.workers import references

        cls = self.classes.get(reference)
        if cls is None:
            cls = self.classes[reference] = references.resolve(reference)
        self.instances[iid] = cls()

    def encoded(self, request: Any) -> bytes:
        """The pickled answer to `request`; what the environment raised becomes a "raised" answer."""
        try:
            answer = self.answer(request)
        except BaseException as exc:  # the environment's code: whatever it raises is answered, not fatal here
            answer = ("raised", type(exc).__name__, exception_text(exc))
        try:
            data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an unpicklable value (an attribute holding a lock, a generator)
            data = pickle.dumps(
                ("raised", "TypeError", f"the value cannot be sent to the rollout worker: {exc}"),
            )
        if len(data) > self.max_bytes:
            data = pickle.dumps(
                (
                    "raised",
                    "ValueError",
                    f"the answer is {len(data)} bytes, over the {self.max_bytes}-byte limit of an "
                    "environment process's messages",
                )
            )
        return data


def watch_parent(parent: int) -> None:
    """End this process as soon as its parent is gone (a hung call must not keep it alive)."""
    while True:
        time.sleep(PARENT_CHECK_SECONDS)
        if os.getppid() != parent:
            os._exit(0)


def main(argv: list[str]) -> int:
    fd, max_bytes = int(argv[0]), int(argv[1])
    os.set_inheritable(fd, False)  # what the environment starts must not hold our end open
    threading.Thread(
        target=watch_parent, args=(os.getppid(),), name="mortal-parent-watch", daemon=True
    ).start()
    connection = Connection(fd)
    host = Host(max_bytes)
    connection.send_bytes(pickle.dumps(("ok", os.getpid())))
    while True:
        try:
            raw = connection.recv_bytes(max_bytes)
        except (EOFError, OSError):  # the parent closed its end (or sent more than it may): done
            return 0
        connection.send_bytes(host.encoded(pickle.loads(raw)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
