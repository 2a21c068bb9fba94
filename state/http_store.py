"""HttpStore: the Store contract over HTTP, for workers and controllers that cannot open the database.

Created by `mortal.state.open_store("https://...")` (MORTAL_STATE_URL), with the bearer token from
MORTAL_STATE_TOKEN: the admin token, or a worker's own scoped token (mortal.state.auth says which calls
each may make; a refused one raises Forbidden). Leases and task leases run on the server's clock: a `now`
argument, a SqlStore's test seam, is refused here and ignored by the server. On Modal, workers in their containers reach the store endpoint of the deployed
app this way (mortal.state.http_server serves it). Every method of `Store` is one POST (the wire
format is mortal.state.wire); typed errors come back as the same classes (Conflict, NotFound, Fenced,
ValueError, ...); transport failures and server errors raise `Unavailable`.

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
import os
import threading
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from tenacity import Retrying as TenacityRetrying
from tenacity import retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential, wait_random
from urllib3.exceptions import NewConnectionError

from mortal.state import wire
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


def _never_sent(exc: requests.RequestException) -> bool:
    """The connection could not be opened (refused, unreachable, DNS, connect timeout): nothing was sent."""
    if isinstance(exc, requests.ConnectTimeout):
        return True
    reason = getattr(exc.args[0], "reason", None) if exc.args else None  # urllib3's MaxRetryError
    return isinstance(reason, NewConnectionError)


def _remote(method: wire.Method) -> Any:
    """The client side of one Store method: bind the arguments as the Store signature does, send, decode."""

    @functools.wraps(getattr(Store, method.name))
    def call(self: HttpStore, *args: Any, **kwargs: Any) -> Any:
        bound = method.signature.bind(*args, **kwargs)
        if any(bound.arguments.get(name) is not None for name in wire.CLIENT_CLOCK_ARGS):
            raise ValueError(f"{method.name}: the HTTP store's clock is the server's; `now` is for a SqlStore")
        payload = {name: wire.encode(value) for name, value in bound.arguments.items()}
        return wire.decode(method.hints["return"], self._call(method, payload))

    call.__isabstractmethod__ = False  # wraps() copied the abstract marker of the Store method
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
        self._local = threading.local()  # one requests.Session per thread (Session is not thread-safe)

    def __repr__(self) -> str:
        return f"HttpStore({self.url!r})"

    def close(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            # The environment's proxies and CA bundle are read here, once per session, not on every
            # request as requests does (os.environ scanned twice per call, and ~/.netrc, whose entry
            # for this host would replace the bearer token with its password).
            session.trust_env = False
            session.proxies = requests.utils.get_environ_proxies(self.url)
            session.verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
            # no retries inside urllib3: every retry is decided in _call, where the method is known
            session.mount("http://", HTTPAdapter(max_retries=0))
            session.mount("https://", HTTPAdapter(max_retries=0))
            if self._token:
                session.headers["Authorization"] = f"Bearer {self._token}"
            self._local.session = session
        return session

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
        url = f"{self.url}{wire.PREFIX}{name}"
        try:
            response = self._session().post(url, json={"args": args}, timeout=self.timeout)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise _Transient(f"state store at {self.url} unreachable ({name}): {exc}", sent=not _never_sent(exc)) from exc
        body = _json(response)
        if response.status_code == 200 and isinstance(body, dict) and "result" in body:
            return body["result"]
        error = wire.error_from(response.status_code, body)
        if response.status_code in TRANSIENT_STATUS:
            raise _Transient(str(error), sent=True) from error
        raise error


def _json(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
