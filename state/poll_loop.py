"""waitress's socket loop, asking only the connections whose interest may have changed since the last turn.

Why: waitress's own loop (wasyncore.poll2) asks every open connection whether it wants to read or write on
every turn, and registers them all in a new poll set; a request takes a few turns (its bytes read, the
worker's answer waking the loop, its write). A store server keeps one mostly idle connection per worker,
so that was Python work in proportion to the open connections for every call (docs/benchmarks.md).

This loop keeps one epoll set holding each connection's interest, and asks again only the connections
that can have changed it: those that had an event, those still busy (a request in progress, an answer to
send: an interest other than the idle one), waitress's own sockets (its listener runs the periodic clean-up
when asked), new connections, and all of them after that clean-up and at least once a second. An idle
connection's interest changes only through an event on it, so none is left out. Events are handled by
wasyncore.readwrite, as waitress's loop does.

Used by mortal.state.http_server.run_in_thread (the store server and the dashboard). Where there is no
epoll (not Linux), `make_loop` gives waitress's own loop.
"""

from __future__ import annotations

import contextlib
import select
import time
from typing import Any, Protocol

SWEEP_SECONDS = 1.0  # every connection is asked at least this often
_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT


class Loop(Protocol):
    def turn(self, timeout: float) -> None: ...

    def close(self) -> None: ...


def make_loop(sockets: dict[int, Any]) -> Loop:
    """The loop over waitress's socket map `sockets`: `turn(timeout_seconds)` until done, then `close()`."""
    return PollLoop(sockets) if hasattr(select, "epoll") else _PollEveryConnection(sockets)


class _PollEveryConnection:
    """waitress's own loop, one turn at a time."""

    def __init__(self, sockets: dict[int, Any]) -> None:
        self._sockets = sockets

    def turn(self, timeout: float) -> None:
        from waitress import wasyncore

        wasyncore.loop(timeout=timeout, map=self._sockets, use_poll=True, count=1)

    def close(self) -> None:
        pass


def _interest(dispatcher: Any) -> int:
    """What `dispatcher` wants to wait for, as wasyncore.poll2 asks it."""
    flags = _READ if dispatcher.readable() else 0
    if dispatcher.writable() and not dispatcher.accepting:
        flags |= _WRITE
    return flags


def _channel_interest(channel: Any) -> int:
    """What a connection wants to wait for, but not writing while a worker thread serves it.

    A worker sends its own answer as it writes it (waitress flushes in write_soon), holding the buffer's
    lock meanwhile; a loop polling that connection for POLLOUT finds the lock taken, sends nothing, and
    spins on the ready socket, holding the GIL the worker needs to finish (most of a busy server's
    turns). The worker wakes the loop when it is done, and the connection is asked again then. Past the
    buffer's high watermark the worker waits for the loop to send, and the loop polls for it again.
    """
    flags = _interest(channel)
    if (
        flags & _WRITE
        and channel.requests
        and not channel.will_close
        and channel.total_outbufs_len <= channel.adj.outbuf_high_watermark
    ):
        flags &= ~_WRITE
    return flags


class PollLoop:
    """The loop over one socket map (fd -> wasyncore dispatcher); not thread-safe: one thread turns it."""

    def __init__(self, sockets: dict[int, Any]) -> None:
        from waitress import wasyncore
        from waitress.channel import HTTPChannel

        self._sockets = sockets
        self._channel_type = HTTPChannel
        self._readwrite = wasyncore.readwrite
        self._epoll = select.epoll()
        self._registered: dict[int, tuple[Any, int]] = {}  # fd -> (dispatcher, interest in the epoll set)
        self._ask: set[int] = set()
        self._accepted = False
        self._sweep_at = 0.0  # time.monotonic() of the next sweep of every connection

    def turn(self, timeout: float) -> None:
        sockets = self._sockets
        now = time.monotonic()
        asked: Any = self._ask
        if now >= self._sweep_at:
            self._sweep_at = now + SWEEP_SECONDS
            asked = list(sockets)
        if self._accepted or len(self._registered) != len(sockets):
            self._accepted = False
            for fd in self._registered.keys() - sockets.keys():  # closed (a number reused: _register)
                self._forget(fd)
            asked = {*asked, *(sockets.keys() - self._registered.keys())}  # accepted
        busy: set[int] = set()
        for fd in asked:
            dispatcher = sockets.get(fd)
            if dispatcher is None:
                continue
            if isinstance(dispatcher, self._channel_type):
                interest = _channel_interest(dispatcher)
                if interest != _READ:
                    busy.add(fd)
            else:  # the listener, the trigger: asked every turn
                cleanup = getattr(dispatcher, "next_channel_cleanup", None)
                interest = _interest(dispatcher)
                if getattr(dispatcher, "next_channel_cleanup", None) != cleanup:
                    self._sweep_at = 0.0  # the clean-up just marked idle connections to close
                busy.add(fd)
            self._register(fd, dispatcher, interest)
        try:
            events = self._epoll.poll(timeout)
        except InterruptedError:
            events = []
        self._ask = busy
        for fd, flags in events:
            busy.add(fd)
            dispatcher = sockets.get(fd)
            if dispatcher is None:
                continue
            if dispatcher.accepting:
                self._accepted = True  # new connections: asked next turn
            self._readwrite(dispatcher, flags)

    def _register(self, fd: int, dispatcher: Any, interest: int) -> None:
        known = self._registered.get(fd)
        if known is not None and known[0] is dispatcher and known[1] == interest:
            return
        self._registered[fd] = (dispatcher, interest)
        if interest == 0:  # as poll2: a connection that wants nothing is not polled, not even for hang-ups
            self._unregister(fd)
            return
        try:
            try:
                self._epoll.modify(fd, interest)
            except FileNotFoundError:  # not in the set: new, or its number reused after a close
                self._epoll.register(fd, interest)
        except OSError:  # a socket closed under its dispatcher: what poll2 reports as POLLNVAL
            self._registered.pop(fd, None)
            self._readwrite(dispatcher, select.POLLNVAL)

    def _forget(self, fd: int) -> None:
        self._registered.pop(fd, None)
        self._unregister(fd)

    def _unregister(self, fd: int) -> None:
        with contextlib.suppress(OSError):  # not in the set, or closed (which took it out)
            self._epoll.unregister(fd)

    def close(self) -> None:
        self._epoll.close()
