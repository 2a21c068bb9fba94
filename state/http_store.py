"""HttpStore: the Store contract over HTTP, for workers and controllers that cannot open the database.

Created by `mortal.state.open_store("https://...")` (MORTAL_STATE_URL), with the bearer token from
MORTAL_STATE_TOKEN. On Modal, workers in their containers reach the store endpoint of the deployed
app this way (mortal.state.http_server serves it). Every method of `Store` is one POST (the wire
format is mortal.state.wire); typed errors come back as the same classes (Conflict, NotFound, Fenced,
ValueError, ...); transport failures and server errors raise `Unavailable`.

Retries. Reads (wire.READS) are sent again on connection errors, timeouts and 502/503/504 (a cold or
restarting endpoint) for up to `read_retry_seconds`: they change nothing. Writes are not: when a
connection breaks after the request left, the client cannot know whether the server applied it, and
sending it again is a second call: `create_worker` would take a second incarnation, `lease_task` a
second task, `add_event` a duplicate line, and a `publish_weights` that landed would come back as a
Conflict. The caller, who knows what the write meant, re-reads and decides (the controller's next
pass; a worker's relaunch). A write is retried only when the connection could not be opened at all
(urllib3's `connect` retries: the request never left this machine).
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
from tenacity import retry_if_exception_type, stop_after_delay, wait_exponential
from urllib3.util.retry import Retry

from mortal.state import wire
from mortal.state.errors import Unavailable
from mortal.state.store import Store

TOKEN_ENV = wire.TOKEN_ENV
CONNECT_RETRIES = 3
TRANSIENT_STATUS = frozenset({502, 503, 504})


class _Transient(Unavailable):
    """A failure a read may be retried after: no connection, a timeout, a gateway or cold-start answer."""


def _remote(method: wire.Method) -> Any:
    """The client side of one Store method: bind the arguments as the Store signature does, send, decode."""

    @functools.wraps(getattr(Store, method.name))
    def call(self: HttpStore, *args: Any, **kwargs: Any) -> Any:
        bound = method.signature.bind(*args, **kwargs)
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
        read_retry_seconds: float = 60.0,
    ) -> None:
        """`timeout` is (connect, read) seconds per request; the read part covers a cold endpoint's start."""
        self.url = url.rstrip("/")
        self._token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.timeout = timeout
        self.read_retry_seconds = read_retry_seconds
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
            retry = Retry(total=None, connect=CONNECT_RETRIES, read=0, redirect=0, status=0, other=0,
                          backoff_factor=0.2)
            session.mount("http://", HTTPAdapter(max_retries=retry))
            session.mount("https://", HTTPAdapter(max_retries=retry))
            if self._token:
                session.headers["Authorization"] = f"Bearer {self._token}"
            self._local.session = session
        return session

    def _call(self, method: wire.Method, args: dict[str, Any]) -> Any:
        if not method.read_only:
            return self._send(method.name, args)
        for attempt in TenacityRetrying(
            retry=retry_if_exception_type(_Transient),
            stop=stop_after_delay(self.read_retry_seconds),
            wait=wait_exponential(multiplier=0.1, max=2.0),
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
            raise _Transient(f"state store at {self.url} unreachable ({name}): {exc}") from exc
        body = _json(response)
        if response.status_code == 200 and isinstance(body, dict) and "result" in body:
            return body["result"]
        error = wire.error_from(response.status_code, body)
        if response.status_code in TRANSIENT_STATUS:
            raise _Transient(str(error)) from error
        raise error


def _json(response: requests.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text
