"""The rollout worker's client of an environment server (spec.rollout.environmentService mode http): the
backend of the proxies of served environments.

Who calls it: mortal.workers.rollout.tools.Toolbox.from_spec builds one `HttpEnvironments` (the server's URL,
the bearer token from the variable tokenEnv names) and asks it for the served classes' descriptions, from
which it builds the proxy classes (mortal.workers.rollout.environment_proxy.proxy_class_described: the
worker need not import the classes); the proxies then `create` a session per instance and send `request`s.
The protocol is mortal.workers.rollout.environment_server's docstring: JSON only, each body at most
`max_bytes` both ways. An unreachable server or an unknown session is `EnvironmentLost` (the proxy builds a
new session, replays its rollout's calls and tries once more); no answer within the deadline plus
`grace_seconds` is `EnvironmentTimedOut` (the server kills what it runs at the deadline itself; the grace
covers the network and its replays), and the session is left for a new one; a refused token is
`EnvironmentServiceError`, which fails the run.
What it must not do: send or accept pickles, follow redirects, retry inside urllib3 (the proxy decides), or
trust what the server answers (checked for shape, bounded in size).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

import urllib3
from urllib3.exceptions import HTTPError, ReadTimeoutError

from mortal.workers.errors import FatalWorkerError
from mortal.workers.rollout.environment_proxy import (
    EnvironmentBuildFailed,
    EnvironmentLost,
    EnvironmentRaised,
    EnvironmentTimedOut,
    EnvironmentUnreachable,
)

MAX_BODY_BYTES = 8 * 1024 * 1024  # as the server's default (mortal.workers.rollout.environment_server)
CONNECT_SECONDS = 10.0
GRACE_SECONDS = 30.0
CONNECTIONS = 16  # as many as rollouts whose tools run at once (mortal.workers.rollout.tools)
CLOSE_SECONDS = 5.0


class EnvironmentServiceError(FatalWorkerError):
    """The environment server refuses this worker (its token) or does not speak the protocol."""

    def __init__(self, message: str) -> None:
        super().__init__("EnvironmentServiceFailed", message)


@dataclass
class Session:
    """One instance on the server; `stale` once the worker gave up on it (a new one is built)."""

    id: str
    reference: str
    stale: bool = False


class HttpEnvironments:
    """The client of one environment server."""

    def __init__(
        self, url: str, token: str, max_bytes: int = MAX_BODY_BYTES, grace_seconds: float = GRACE_SECONDS
    ) -> None:
        self.url = url.rstrip("/")
        self.max_bytes = max_bytes
        self.grace_seconds = grace_seconds
        self._http = urllib3.PoolManager(
            num_pools=2,
            maxsize=CONNECTIONS,
            retries=False,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )

    def __repr__(self) -> str:
        return f"HttpEnvironments({self.url!r})"

    def close(self) -> None:
        self._http.clear()

    # -- the wire -------------------------------------------------------------------------------------
    def _send(self, method: str, path: str, body: dict[str, Any] | None, seconds: float, what: str) -> Any:
        """The answer's JSON document, or the typed error its status says (module docstring)."""
        data = None
        if body is not None:
            try:
                data = json.dumps(body, allow_nan=False).encode()
            except (TypeError, ValueError) as exc:
                raise EnvironmentRaised("TypeError", f"the arguments of {what} are not JSON: {exc}") from None
            if len(data) > self.max_bytes:
                raise EnvironmentRaised(
                    "ValueError",
                    f"the arguments of {what} are {len(data)} bytes, over the {self.max_bytes}-byte limit",
                )
        try:
            response = self._http.request(
                method,
                self.url + path,
                body=data,
                timeout=urllib3.Timeout(connect=CONNECT_SECONDS, read=seconds),
                preload_content=False,
                redirect=False,
            )
        except ReadTimeoutError as exc:
            raise EnvironmentTimedOut(what, seconds) from exc
        except HTTPError as exc:
            raise EnvironmentUnreachable(
                f"the environment server at {self.url} is unreachable ({type(exc).__name__})"
            ) from exc
        try:
            raw = response.read(self.max_bytes + 1)
        except ReadTimeoutError as exc:
            raise EnvironmentTimedOut(what, seconds) from exc
        except HTTPError as exc:
            raise EnvironmentLost(
                f"the environment server's answer to {what} broke off ({type(exc).__name__})"
            ) from exc
        finally:
            response.release_conn()
        if len(raw) > self.max_bytes:
            raise EnvironmentRaised(
                "ValueError", f"the answer to {what} is over the {self.max_bytes}-byte limit"
            )
        try:
            document = json.loads(raw)
        except ValueError:
            document = None
        message = document.get("error") if isinstance(document, dict) else None
        if response.status == 401:
            raise EnvironmentServiceError(
                f"the environment server at {self.url} refused the token (401): {message or raw[:200]!r}"
            )
        if response.status == 404 and isinstance(document, dict) and document.get("unknownSession"):
            raise EnvironmentLost(f"the environment server no longer has the session of {what}")
        if response.status in (400, 411, 413):
            raise EnvironmentRaised("ValueError", f"the environment server refused {what}: {message}")
        if response.status != 200 or not isinstance(document, dict):
            raise EnvironmentLost(
                f"the environment server answered {what} with status {response.status}: "
                f"{message or raw[:200]!r}"
            )
        return document

    def _outcome(self, document: dict[str, Any], what: str, seconds: float) -> Any:
        outcome, message = document.get("outcome"), str(document.get("message"))
        if outcome == "ok":
            return document.get("result")
        if outcome == "raised":
            return_kind = document.get("kind")
            raise EnvironmentRaised(return_kind if isinstance(return_kind, str) else "Exception", message)
        if outcome == "timedOut":
            raise EnvironmentTimedOut(what, seconds)
        if outcome == "buildFailed":
            raise EnvironmentBuildFailed(message)
        if outcome == "lost":  # the server rebuilt and replayed it once already: the environment's answer
            raise EnvironmentRaised("EnvironmentLost", message)
        raise EnvironmentLost(f"the environment server answered {what} with outcome {outcome!r}")

    # -- the proxies' backend -------------------------------------------------------------------------
    def describe(self) -> dict[str, dict[str, Any]]:
        """{reference: description} of every class the server serves; EnvironmentUnreachable while nothing
        answers at its address (an outage: worth waiting for), EnvironmentServiceError when it answers but
        cannot be asked (its token, its protocol)."""
        try:
            document = self._send(
                "GET", "/v1/environments", None, CONNECT_SECONDS + self.grace_seconds, "describe"
            )
        except EnvironmentUnreachable:
            raise
        except (EnvironmentLost, EnvironmentRaised, EnvironmentTimedOut) as exc:
            raise EnvironmentServiceError(
                f"cannot ask the environment server at {self.url} what it serves: {exc}"
            ) from exc
        served = document.get("environments")
        if not isinstance(served, dict) or not all(isinstance(v, dict) for v in served.values()):
            raise EnvironmentServiceError(f"{self.url}/v1/environments did not answer with environments")
        return served

    def create(self, reference: str, seconds: float) -> Session:
        what = f"building {reference}"
        document = self._send(
            "POST",
            "/v1/sessions",
            {"environment": reference, "timeoutSeconds": seconds},
            seconds + self.grace_seconds,
            what,
        )
        result = self._outcome(document, what, seconds)
        if not isinstance(result, dict) or not isinstance(result.get("session"), str):
            raise EnvironmentLost(f"the environment server answered {what} without a session")
        return Session(result["session"], reference)

    def alive(self, handle: Session) -> bool:
        return not handle.stale

    def request(self, handle: Session, op: str, payload: Any, seconds: float, what: str) -> Any:
        body: dict[str, Any] = {"timeoutSeconds": seconds}
        if op == "reset":
            args, kwargs = payload
            body.update(args=list(args), kwargs=kwargs)
        elif op == "call":
            name, args, kwargs = payload
            body.update(method=name, args=list(args), kwargs=kwargs)
        elif op == "attribute":
            body["name"] = payload
        document = self._send(
            "POST", f"/v1/sessions/{handle.id}/{op}", body, seconds + self.grace_seconds, what
        )
        value = self._outcome(document, what, seconds)
        if op == "call" and not isinstance(value, str):
            raise EnvironmentRaised(
                "TypeError", f"the environment server answered {what} with a {type(value).__name__}"
            )
        if op == "reset" and value is not None and not isinstance(value, str):
            raise EnvironmentRaised(
                "TypeError", f"the environment server answered {what} with a {type(value).__name__}"
            )
        return value

    def release(self, handle: Session) -> None:
        handle.stale = True
        with contextlib.suppress(
            EnvironmentLost, EnvironmentRaised, EnvironmentTimedOut, EnvironmentServiceError
        ):
            self._send("DELETE", f"/v1/sessions/{handle.id}", None, CLOSE_SECONDS, "closing a session")
