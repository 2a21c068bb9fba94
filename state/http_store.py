"""HttpStore: the Store contract over HTTP, for workers and controllers that cannot open the database.

Created by `mortal.state.open_store("https://...")` (MORTAL_STATE_URL), with the bearer token from
MORTAL_STATE_TOKEN: the admin token, or a worker's own scoped token (mortal.state.auth says which calls
each may make; a refused one raises Forbidden). Leases and task leases run on the server's clock: a `now`
argument, a SqlStore's test seam, is refused here and ignored by the server. On Modal, workers in their
containers reach the store endpoint of the deployed app this way (mortal.state.http_server serves it).
Every method of `Store` is one POST (the wire format is mortal.state.wire); typed errors come back as the
same classes (Conflict, NotFound, Fenced, ValueError, ...); transport failures and server errors raise
`Unavailable`.

Retries (tenacity; bounded by `retry_attempts` and `retry_seconds`, with jittered exponential waits so
that many workers do not retry in step). What is sent again depends on whether the first request may
have been applied:
- The connection could not be opened (refused, no route, a connect timeout): nothing left this machine,
  so every call is sent again, writes included (a store restarting, a node's network coming back).
- The request may have reached the server (a connection reset or closed mid-request, a read timeout,
  a 502/503/504 from the server or a gateway in front of it): only calls that are safe to apply twice
  are sent again: the reads (wire.READS) and the writes the protocol makes idempotent
  (wire.IDEMPOTENT_WRITES: heartbeats, renewals guarded by a lease token, metric and completion
  upserts, ...; wire.py says why for each). The others (`create_worker` would take a second
  incarnation, `lease_task` a second task, `add_event` a duplicate line, `complete_task` would answer
  False for the task it completed) raise `Unavailable`: the caller, who knows what the write meant,
  re-reads and decides (the controller's next pass; a worker's relaunch).
Any other answer (4xx, 500) is final: it says what the store did.
What it must not do: decide anything, or cache what it read.
"""

from __future__ import annotations

import abc
import functools
import json
import os
import threading
from typing import Any

import urllib3
from requests import certs
from requests.utils import get_environ_proxies, select_proxy
from tenacity import Retrying as TenacityRetrying
from tenacity import retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential, wait_random
from urllib3.exceptions import ConnectTimeoutError, HTTPError

from mortal.state import paths, wire
from mortal.state.errors import Unavailable
from mortal.state.store import Store

TOKEN_ENV = wire.TOKEN_ENV
TRANSIENT_STATUS = frozenset({502, 503, 504})
RETRY_ATTEMPTS = 30  # with waits of 0.1 s doubling to 2 s (jittered): about a minute, as retry_seconds


class _Transient(Unavailable):
    """A failure worth another try: no connection, a broken one, a timeout, a gateway or cold-start answer.
    `sent`: whether the request may have reached the server (False only when no connection was opened)."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


def _remote(method: wire.Method) -> Any:
    """The client side of one Store method: bind the arguments as the Store signature does, send, decode."""

    @functools.wraps(getattr(Store, method.name))
    def call(self: HttpStore, *args: Any, **kwargs: Any) -> Any:
        bound = method.signature.bind(*args, **kwargs)
        if any(bound.arguments.get(name) is not None for name in wire.CLIENT_CLOCK_ARGS):
            raise ValueError(
                f"{method.name}: the HTTP store's clock is the server's; `now` is for a SqlStore"
            )
        payload = {name: wire.encode(value) for name, value in bound.arguments.items()}
        return wire.decode(method.hints["return"], self._call(method, payload))

    call.__isabstractmethod__ = False  # type: ignore[attr-defined]  # wraps() copied the Store method's
    return call


def _with_remote_methods(cls: type[HttpStore]) -> type[HttpStore]:
    for method in wire.methods().values():
        setattr(cls, method.name, _remote(method))
    abc.update_abstractmethods(cls)
    return cls


@_with_remote_methods
class HttpStore(Store):
    """The store behind `url` (http:// or https://). Connects on first use."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: tuple[float, float] = (10.0, 90.0),
        retry_seconds: float = 60.0,
        retry_attempts: int = RETRY_ATTEMPTS,
    ) -> None:
        """`timeout` is (connect, read) seconds per request; the read part covers a cold endpoint's start.
        A call that can be sent again (see the module's docstring) is, until `retry_attempts` tries or
        `retry_seconds` have passed, whichever comes first; then its last failure is raised."""
        self.url = url.rstrip("/")
        self._token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.retry_attempts = retry_attempts
        self._local = threading.local()  # one connection pool per thread, of one connection

    def __repr__(self) -> str:
        return f"HttpStore({paths.shown_url(self.url)!r})"

    def close(self) -> None:
        connections = getattr(self._local, "connections", None)
        if connections is not None:
            connections.clear()
            self._local.connections = None

    def _connections(self) -> urllib3.PoolManager:
        """This thread's connection to the store (kept open between calls).

        urllib3 without requests on top: a requests Session merges its settings, cookies and hooks on every
        request and reads the environment's proxies, os.environ and ~/.netrc again each time (whose entry
        for this host would replace the bearer token), a good part of a worker's CPU per call. Here the
        environment's proxy and CA bundle are read once, as requests would read them.
        """
        connections = getattr(self._local, "connections", None)
        if connections is None:
            headers = {"Content-Type": "application/json"}
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            # No retries inside urllib3: every retry is decided in _call, where the method is known.
            options: dict[str, Any] = {
                "headers": headers,
                "retries": False,
                "maxsize": 1,
                "timeout": urllib3.Timeout(connect=self.timeout[0], read=self.timeout[1]),
                "ca_certs": os.environ.get("REQUESTS_CA_BUNDLE")
                or os.environ.get("CURL_CA_BUNDLE")
                or certs.where(),
            }
            proxy = select_proxy(self.url, get_environ_proxies(self.url))
            connections = urllib3.ProxyManager(proxy, **options) if proxy else urllib3.PoolManager(**options)
            self._local.connections = connections
        return connections

    def _call(self, method: wire.Method, args: dict[str, Any]) -> Any:
        def again(exc: BaseException) -> bool:
            return isinstance(exc, _Transient) and (method.idempotent or not exc.sent)

        for attempt in TenacityRetrying(
            retry=retry_if_exception(again),
            stop=stop_after_attempt(self.retry_attempts) | stop_after_delay(self.retry_seconds),
            wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.1),
            reraise=True,
        ):
            with attempt:
                return self._send(method.name, args)
        raise AssertionError("unreachable: tenacity reraises the last failure")

    def _send(self, name: str, args: dict[str, Any]) -> Any:
        try:  # as requests' json= did: NaN and Infinity are not JSON, refused here rather than sent
            body = json.dumps({"args": args}, allow_nan=False).encode()
        except ValueError as exc:
            raise ValueError(f"{name}: an argument is not JSON: {exc}") from exc
        try:
            response = self._connections().request("POST", f"{self.url}{wire.PREFIX}{name}", body=body)
        except HTTPError as exc:
            # Refused, unreachable, no connection made: nothing was sent.
            sent = not isinstance(exc, ConnectTimeoutError)
            where = paths.shown_url(self.url)
            raise _Transient(f"state store at {where} unreachable ({name}): {exc}", sent=sent) from exc
        answer = _json(response.data)
        if response.status == 200 and isinstance(answer, dict) and "result" in answer:
            return answer["result"]
        error = wire.error_from(response.status, answer)
        if response.status in TRANSIENT_STATUS:
            raise _Transient(str(error), sent=True) from error
        raise error


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")
