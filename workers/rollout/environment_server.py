"""An environment server: environment instances behind HTTP, so that sandbox-heavy environments run on
machines of their own and scale apart from the GPU workers (spec.rollout.environmentService mode http).

    GET    /healthz                 -> {"ok": true}   (no token needed)
    GET    /v1/environments         -> {"environments": {ref: description}}
    POST   /v1/sessions             {"environment": ref, "timeoutSeconds": s} -> result {"session": id}
    POST   /v1/sessions/ID/reset   {"args": [...], "kwargs": {...}, "timeoutSeconds": s}
    POST   /v1/sessions/ID/call    {"method": name, "args": [...], "kwargs": {...}, "timeoutSeconds": s}
    POST   /v1/sessions/ID/get_reward {"timeoutSeconds": s}
    POST   /v1/sessions/ID/attribute  {"name": name, "timeoutSeconds": s}
    DELETE /v1/sessions/ID                       -> {"closed": true}

Each request but /healthz needs `Authorization: Bearer <token>` (401 without: nothing is read or run first).
An environment's answer comes with status 200 and an outcome: ok (`result`: reset's observation or null, a
tool's text, get_reward's value), raised (`kind`, `message`: the environment's code raised), timedOut (past
the request's deadline: its process was killed), lost (its process died again after it was rebuilt) or
buildFailed (the constructor raised). A request the server refuses gets 4xx and {"error": ...}: 400 malformed,
401 token, 404 unknown route or session (`unknownSession`: the worker builds a new one and replays), 411
without Content-Length, 413 over --max-body-bytes, 503 over --max-sessions.
Who runs it: `mortalctl env serve module:Class ...` (mortal.client.cli.env); its client is
mortal.workers.rollout.environment_client. The instances live in a pool of child processes
(mortal.workers.rollout.environment_pool) behind the same proxies a worker's processPool uses, so a hung call
is killed at its deadline and a crashed process is replaced with the session's calls replayed, here on the
server. The server imports only the classes it was started with: a request names one of them, never code.
What it must not do: unpickle or evaluate anything from the network (JSON only), read a body before the token
is checked or past its limit, call a private method or one that is not a tool, or keep idle sessions forever
(each idle past --session-idle-seconds is dropped when a session is created).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mortal.workers import references
from mortal.workers.rollout.environment_pool import ProcessPool
from mortal.workers.rollout.environment_proxy import (
    EnvironmentBuildFailed,
    EnvironmentLost,
    EnvironmentProxy,
    EnvironmentRaised,
    EnvironmentTimedOut,
    ProxySettings,
    proxy_class_of,
)
from mortal.workers.rollout.environment_schema import NOT_TOOLS, describe_class, tool_problems

log = logging.getLogger("mortal.environment_server")

MAX_BODY_BYTES = 8 * 1024 * 1024  # one request or answer: a dataset row for reset, a tool's arguments or text
MAX_SESSIONS = 4096
SESSION_IDLE_SECONDS = 3600.0
MAX_CALL_SECONDS = 3600.0  # the longest deadline a client may ask for
IDLE_SECONDS = 120.0
PREFIX = "/v1/sessions/"


class ServeError(Exception):
    """The server cannot start: a class does not import, or its tools cannot be described."""


class Refused(Exception):
    """A request the server refuses (status and message)."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


class Session:
    def __init__(self, proxy: EnvironmentProxy) -> None:
        self.proxy = proxy
        self.used = time.monotonic()


class EnvironmentService:
    """The server's state: the served classes, their child processes, the sessions (the handler's logic,
    apart from HTTP so that it can be tested on its own)."""

    def __init__(
        self,
        refs: list[str],
        token: str,
        processes: int,
        max_sessions: int = MAX_SESSIONS,
        session_idle_seconds: float = SESSION_IDLE_SECONDS,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if not token:
            raise ServeError(
                "the environment server needs a bearer token (the variable --token-env names is empty)"
            )
        self.token = token
        self.max_sessions = max_sessions
        self.session_idle_seconds = session_idle_seconds
        self.max_body_bytes = max_body_bytes
        self.descriptions: dict[str, dict[str, Any]] = {}
        classes: dict[str, type] = {}
        for ref in refs:
            try:
                cls = references.resolve(ref)
            except Exception as exc:
                raise ServeError(f"{ref!r} cannot be imported here: {type(exc).__name__}: {exc}") from exc
            if not isinstance(cls, type):
                raise ServeError(f"{ref!r} is not a class (it is a {type(cls).__name__})")
            if problems := tool_problems(cls):  # a worker would refuse to offer them (ToolInvalid)
                named = "; ".join(f"{cls.__name__}.{name}: {problem}" for name, problem in problems)
                raise ServeError(f"TRL cannot describe the tools of {ref!r} to a model: {named}")
            try:
                self.descriptions[ref] = describe_class(cls, ref)
            except Exception as exc:  # an unresolvable type hint: TRL could not build its schema either
                raise ServeError(
                    f"the tools of {ref!r} cannot be described: {type(exc).__name__}: {exc}"
                ) from exc
            classes[ref] = cls
        self.pool = ProcessPool(processes, max_bytes=max_body_bytes)
        self.proxies = {
            ref: proxy_class_of(
                cls, ProxySettings(self.pool, ref, "server", MAX_CALL_SECONDS, MAX_CALL_SECONDS)
            )
            for ref, cls in classes.items()
        }
        self.tools = {
            ref: {m["name"] for m in d["methods"] if m["name"] not in NOT_TOOLS}
            for ref, d in self.descriptions.items()
        }
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def close(self) -> None:
        self.pool.close()

    # -- requests -----------------------------------------------------------------------------------------
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        ref = body.get("environment")
        if ref not in self.proxies:
            raise Refused(
                400, f"environment {ref!r} is not served here; this server serves {sorted(self.proxies)}"
            )
        seconds = _seconds(body)
        self._sweep()
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                raise Refused(
                    503, f"the server holds {self.max_sessions} sessions, its limit (--max-sessions)"
                )
        proxy = self.proxies[ref]()

        def build() -> None:
            proxy._mortal_instance(seconds)  # built now, so a constructor that raises answers this request

        built = _outcome(build)
        if built["outcome"] != "ok":
            return built
        session = secrets.token_hex(16)
        with self._lock:
            self.sessions[session] = Session(proxy)
        return {"outcome": "ok", "result": {"session": session}}

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            idle = [k for k, s in self.sessions.items() if now - s.used > self.session_idle_seconds]
            dropped = [self.sessions.pop(k) for k in idle]
        for session in dropped:
            session.proxy._mortal_release()
        if dropped:
            log.info("dropped %d sessions idle for more than %g s", len(dropped), self.session_idle_seconds)

    def session(self, session_id: str) -> Session:
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            raise Refused(
                404,
                f"no session {session_id!r} here (expired, closed, or the server restarted)",
                unknownSession=True,
            )
        session.used = time.monotonic()
        return session

    def close_session(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            session = self.sessions.pop(session_id, None)
        if session is not None:
            session.proxy._mortal_release()
        return {"closed": session is not None}

    def act(self, session_id: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self.session(session_id)
        proxy = session.proxy
        seconds = _seconds(body)
        if action == "reset":
            payload = (_list(body, "args"), _dict(body, "kwargs"))
            return _outcome(lambda: proxy._mortal_invoke("reset", payload, seconds))
        if action == "call":
            method = body.get("method")
            tools = self.tools[proxy._mortal_settings.reference]
            if method not in tools:
                raise Refused(400, f"{method!r} is not a tool of {proxy._mortal_settings.reference}")
            payload = (method, _list(body, "args"), _dict(body, "kwargs"))
            return _outcome(lambda: proxy._mortal_invoke("call", payload, seconds))
        if action == "get_reward":
            if "get_reward" not in proxy._mortal_functions:
                raise Refused(400, f"{proxy._mortal_settings.reference} has no get_reward()")
            return _outcome(lambda: proxy._mortal_invoke("get_reward", None, seconds))
        if action == "attribute":
            name = body.get("name")
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
                raise Refused(400, f"attribute {name!r}: only public attribute names may be read")
            if name in proxy._mortal_functions:
                raise Refused(400, f"{name!r} is a method of {proxy._mortal_settings.reference}, not a value")
            return _outcome(lambda: proxy._mortal_invoke("attribute", name, seconds))
        raise Refused(404, f"no action {action!r}: reset, call, get_reward or attribute")


def _seconds(body: dict[str, Any]) -> float:
    value = body.get("timeoutSeconds")
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise Refused(400, f"timeoutSeconds must be a positive number of seconds (got {value!r})")
    return min(float(value), MAX_CALL_SECONDS)


def _list(body: dict[str, Any], key: str) -> tuple[Any, ...]:
    value = body.get(key, [])
    if not isinstance(value, list):
        raise Refused(400, f"{key} must be a list")
    return tuple(value)


def _dict(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise Refused(400, f"{key} must be an object")
    return value


def _outcome(request: Any) -> dict[str, Any]:
    """An environment request's answer as JSON (module docstring: the outcomes)."""
    try:
        value = request()
    except EnvironmentRaised as exc:
        return {"outcome": "raised", "kind": exc.kind, "message": str(exc)}
    except EnvironmentTimedOut as exc:
        return {"outcome": "timedOut", "message": str(exc)}
    except EnvironmentLost as exc:
        return {"outcome": "lost", "message": str(exc)}
    except EnvironmentBuildFailed as exc:
        return {"outcome": "buildFailed", "message": str(exc)}
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return {"outcome": "raised", "kind": "TypeError", "message": f"the value is not JSON: {exc}"}
    return {"outcome": "ok", "result": value}


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive; every answer is JSON with a Content-Length."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_SECONDS  # a connection that sends nothing this long is closed (its thread freed)
    # headers and body are two writes: without TCP_NODELAY the body waits for the client's delayed ACK
    disable_nagle_algorithm = True
    server: EnvironmentHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- BaseHTTPRequestHandler's name
        log.debug("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, document: dict[str, Any]) -> None:
        data = json.dumps(document, allow_nan=False).encode()
        if len(data) > self.server.service.max_body_bytes:
            data = json.dumps(
                {
                    "outcome": "raised",
                    "kind": "ValueError",
                    "message": f"the answer is {len(data)} bytes, over the server's "
                    f"{self.server.service.max_body_bytes}-byte limit",
                }
            ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self, status: int, message: str, close: bool = False, **extra: Any) -> None:
        if close:
            self.close_connection = True
        data = json.dumps({"error": message, **extra}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise Refused(411, "a request needs a Content-Length")
        size = int(length)
        if size > self.server.service.max_body_bytes:
            raise Refused(
                413,
                f"the body is {size} bytes, over the server's "
                f"{self.server.service.max_body_bytes}-byte limit",
            )
        try:
            body = json.loads(self.rfile.read(size) or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise Refused(400, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    def _handle(self, method: str) -> None:
        service = self.server.service
        if method == "GET" and self.path == "/healthz":
            self._answer(200, {"ok": True})
            return
        if not service.authorized(self.headers.get("Authorization")):
            # nothing read: the connection is closed rather than left with an unread body
            self._refuse(401, "missing or wrong bearer token", close=True)
            return
        try:
            if method == "GET" and self.path == "/v1/environments":
                self._answer(200, {"environments": service.descriptions})
            elif method == "POST" and self.path == "/v1/sessions":
                self._answer(200, service.create(self._body()))
            elif method == "POST" and self.path.startswith(PREFIX) and self.path.count("/") == 4:
                session_id, action = self.path[len(PREFIX) :].split("/")
                self._answer(200, service.act(session_id, action, self._body()))
            elif method == "DELETE" and self.path.startswith(PREFIX) and self.path.count("/") == 3:
                self._answer(200, service.close_session(self.path[len(PREFIX) :]))
            else:
                raise Refused(404, f"no route {method} {self.path}")
        except Refused as exc:
            self._refuse(exc.status, str(exc), close=exc.status in (411, 413), **exc.extra)

    def do_GET(self) -> None:  # noqa: N802 -- BaseHTTPRequestHandler's names
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")


class EnvironmentHTTPServer(ThreadingHTTPServer):
    """A thread per connection; `server_close` also ends the open (keep-alive) connections, so that a stopped
    server answers nothing more."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], service: EnvironmentService) -> None:
        self.service = service
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        with self._open_lock:
            connections, self._open = list(self._open), set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def serve(
    refs: list[str],
    host: str,
    port: int,
    token: str,
    processes: int,
    max_sessions: int = MAX_SESSIONS,
    session_idle_seconds: float = SESSION_IDLE_SECONDS,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> EnvironmentHTTPServer:
    """A bound server (port 0: any free one; `server_address` says which); the caller runs serve_forever."""
    service = EnvironmentService(refs, token, processes, max_sessions, session_idle_seconds, max_body_bytes)
    try:
        return EnvironmentHTTPServer((host, port), service)
    except OSError:
        service.close()
        raise
