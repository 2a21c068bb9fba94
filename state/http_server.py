"""The state store served over HTTP: a WSGI app that answers every Store method from a SqlStore.

Who runs it: the Modal app's store endpoint (`@modal.wsgi_app`, over SQLite on a modal.Volume;
mortal.client.modal_app), `python -m mortal.state.http_server` anywhere else, and tests
(`serve()`: waitress, a threaded production WSGI server; the `server` extra). Workers and controllers
elsewhere reach it with MORTAL_STATE_URL=http(s)://HOST and MORTAL_STATE_TOKEN (mortal.state.http_store).

    POST /v1/<method>  {"args": {...}}  Authorization: Bearer <token>  -> {"result": ...} | {"error": ...}
    GET  /healthz                                                       -> {"ok": true} (no token needed)

Every request is one Store call, so the invariants (fencing, compare-and-swap, task leases) are the
SqlStore's, checked inside its transactions; a request the client sends twice is two calls.
Who may make which call is mortal.state.auth's: the admin token everything, a worker's token its own
run's calls as its own slot (403 otherwise). Leases run on this server's clock: a client's `now` is dropped.
The endpoint is public on Modal, so whatever reaches it gets a JSON answer: no valid token a 401 before
the body is read, bad input a 4xx before the store sees it (a body over MAX_BODY_BYTES, nested deeper
than MAX_JSON_DEPTH, or not JSON), a client that stalls mid-request is dropped after READ_TIMEOUT_SECONDS
(here; on Modal its web proxy times requests). Every request goes to the access log (mortal.state.access_log).
The server does not start with an admin token shorter than MIN_TOKEN_CHARS.
What it must not do: decide anything, keep state between requests, answer without a token, or log one.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mortal.state import auth, paths, wire
from mortal.state.access_log import AccessLog
from mortal.state.auth import Authority, Identity
from mortal.state.errors import Forbidden, StoreError
from mortal.state.paths import default_state_url
from mortal.state.store import Store
from mortal.state.tables import RunRow

TOKEN_ENV = wire.TOKEN_ENV
PREVIOUS_TOKENS_ENV = "MORTAL_STATE_PREVIOUS_TOKENS"  # admin tokens still accepted while one is rotated
ACCESS_LOG = "access.log"  # under the server's $MORTAL_HOME
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_JSON_DEPTH = 64  # a store call's body is a few levels deep; json and pydantic recurse once per level
# Objects and lists in one body (counted as its '{' and '[' bytes, strings' included: an overcount): a call's
# bulk is numbers and text, while each empty object costs Python many times its two bytes, so a body of
# nothing else would make the server hold gigabytes for one call of any token.
MAX_JSON_CONTAINERS = 1_000_000
# Values of any kind (counted as its ',' bytes plus its containers: an overcount, strings' commas included):
# a short string or number costs Python tens of times its few bytes too. A rollout chunk's token ids and
# logprobs are far fewer; the body limit already stops values written wide.
MAX_JSON_VALUES = 4_000_000
READ_TIMEOUT_SECONDS = 30.0  # the server drops a connection silent this long (mid-request, or idle)
MIN_TOKEN_CHARS = 16
"""The shortest admin token the server takes. Why: the endpoint is public on Modal and an admin token can
make every call (and signs every worker token), so it must be out of reach of guessing; a short one is a
password a person typed, not a secret. `openssl rand -hex 32` makes a good one."""
log = logging.getLogger("mortal.state.http")
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    412: "Precondition Failed",
    413: "Content Too Large",
    422: "Unprocessable Content",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class WeakToken(ValueError):
    """No admin token, or one (current or previous) shorter than MIN_TOKEN_CHARS: the server refuses to
    start rather than serve a store anyone could guess their way into."""


def check_tokens(token: str, previous_tokens: Sequence[str] = ()) -> None:
    """Raise WeakToken, naming the variable to fix, unless every admin token is long enough to be secret."""
    if not token:
        raise WeakToken(f"the HTTP store needs a token: set {TOKEN_ENV} (e.g. `openssl rand -hex 32`)")
    named = [(TOKEN_ENV, token), *((PREVIOUS_TOKENS_ENV, t) for t in previous_tokens)]
    for variable, value in named:
        if len(value) < MIN_TOKEN_CHARS:
            raise WeakToken(
                f"{variable} holds a token too short to be secret ({len(value)} characters, at least "
                f"{MIN_TOKEN_CHARS} needed): generate one, e.g. `openssl rand -hex 32`"
            )


class StoreApp:
    """The WSGI application: routes /v1/<method> to `store` for whoever the bearer token says
    (mortal.state.auth).

    `token` is the admin token; `previous_tokens` are admin tokens still accepted during a rotation.
    Every request is written to `access_log` (when given): who, which call, which run, the status."""

    def __init__(
        self,
        store: Store,
        token: str,
        access_log: AccessLog | None = None,
        previous_tokens: Sequence[str] = (),
    ) -> None:
        check_tokens(token, previous_tokens)
        self.store = store
        self.authority = Authority([token, *previous_tokens])
        self.access_log = access_log

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        request = _Request(environ.get("PATH_INFO", ""))
        try:
            status, body = self.handle(environ, request)
        except Exception as exc:  # a bug here still answers in JSON; the trace stays in the server's log
            log.exception("request to %s failed", environ.get("PATH_INFO"))
            status, body = _error(500, "Internal", f"the store server failed: {type(exc).__name__}")
        if self.access_log is not None and request.call != wire.HEALTH_PATH:
            self.access_log.record(request.who, request.call, request.run, status, environ.get("REMOTE_ADDR"))
        payload = json.dumps(body).encode()
        start_response(
            f"{status} {_REASONS.get(status, 'Error')}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))],
        )
        return [payload]

    def handle(self, environ: dict[str, Any], request: _Request | None = None) -> tuple[int, dict[str, Any]]:
        """The answer to one request; `request` collects what the access log says of it."""
        request = request or _Request(environ.get("PATH_INFO", ""))
        path, verb = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if path == wire.HEALTH_PATH:
            return 200, {"ok": True}
        # First: nothing is answered, nor read, before the token is checked.
        identity = self.identify(environ.get("HTTP_AUTHORIZATION", ""))
        if identity is None:
            return _error(
                401, "Unauthorized", f"missing, wrong or expired bearer token (the server's {TOKEN_ENV})"
            )
        request.who = identity.name
        method = wire.methods().get(path.removeprefix(wire.PREFIX)) if path.startswith(wire.PREFIX) else None
        if method is None:
            return _error(404, "UnknownMethod", f"no store method at {path!r}")
        request.call = method.name
        if verb != "POST":
            return _error(405, "BadRequest", f"{path} takes POST, not {verb}")
        try:
            kwargs = wire.decode_args(method, _read_args(environ))
        except _TooLarge as exc:
            return _error(413, "BadRequest", str(exc))
        except _Stalled as exc:
            return _error(408, "BadRequest", str(exc))
        except (ValueError, TypeError, ValidationError) as exc:
            return _error(400, "BadRequest", f"{method.name}: {exc}")
        # The server's clock decides.
        kwargs = {k: v for k, v in kwargs.items() if k not in wire.CLIENT_CLOCK_ARGS}
        request.run = auth.run_of(method.name, kwargs)
        try:
            kwargs = auth.authorize(identity, method.name, kwargs)
        except Forbidden as exc:
            return wire.error_body(exc)
        return self._call(method, kwargs, identity, request.run)

    def identify(self, header: str) -> Identity | None:
        """Who the Authorization header speaks for (None: no valid token)."""
        scheme, _, given = header.partition(" ")
        return self.authority.identify(given) if scheme.lower() == "bearer" else None

    def _call(
        self, method: wire.Method, kwargs: dict[str, Any], identity: Identity, run: str | None
    ) -> tuple[int, dict[str, Any]]:
        """The store's answer, for a worker token of an earlier run of the same name a 403 instead
        (auth.run_uid_to_check). A write is checked before it is made. A read is checked after, which is
        exact and costs the same one lookup: uids are never reused, so the run still has the token's uid
        after the read only if it had it all through the read (get_run's row carries its uid: no lookup).
        A write (add_event) racing a purge and a new apply between its check and itself is not caught."""
        checked = run if auth.run_uid_to_check(identity, kwargs) is not None else None
        try:
            if checked is not None and not method.read_only:
                auth.check_run_uid(identity, self.store.run_uid(checked))
            result = getattr(self.store, method.name)(**kwargs)
            if checked is not None and method.read_only:
                auth.check_run_uid(
                    identity, result.uid if isinstance(result, RunRow) else self.store.run_uid(checked)
                )
        except (StoreError, ValueError) as exc:
            return wire.error_body(exc)
        except Exception as exc:  # the client gets a 500 it can act on; the trace stays in the server's log
            log.exception("store call %s failed", method.name)
            return wire.error_body(exc)
        return 200, {"result": wire.encode(result)}

    def close(self) -> None:
        self.store.close()
        if self.access_log is not None:
            self.access_log.close()


@dataclass
class _Request:
    """What the access log says of a request: `call` is the path until it names a store method."""

    call: str
    who: str = "unknown"
    run: str | None = None


class _TooLarge(Exception):
    """The body is over MAX_BODY_BYTES, or holds more than MAX_JSON_CONTAINERS objects and lists or
    MAX_JSON_VALUES values (413)."""


class _Stalled(Exception):
    """The client stopped sending before its body was complete (408)."""


class _TooDeep(ValueError):
    """The body nests deeper than MAX_JSON_DEPTH (400): refused before anything recurses into it."""


def _read_args(environ: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments from the request body; ValueError (400) for anything but {"args": {...}}."""
    body = _parse(_read_body(environ))
    args = body.get("args", {}) if isinstance(body, dict) else None
    if not isinstance(args, dict):
        raise ValueError('the body must be {"args": {...}}')
    return args


def _read_body(environ: dict[str, Any]) -> bytes:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError as exc:
        raise ValueError("bad Content-Length") from exc
    if length < 0:
        raise ValueError("bad Content-Length")
    if length > MAX_BODY_BYTES:
        raise _TooLarge(f"request body of {length} bytes is over the limit of {MAX_BODY_BYTES}")
    try:
        raw = environ["wsgi.input"].read(length) if length else b""
    except OSError as exc:  # TimeoutError: the server's read timeout; or the connection broke
        raise _Stalled(f"the request body did not arrive ({type(exc).__name__}: {exc})") from exc
    if len(raw) < length:
        raise ValueError(f"the body ended after {len(raw)} of its {length} bytes")
    return raw


def _parse(raw: bytes) -> Any:
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        raise _TooLarge(f"the body holds more than {MAX_JSON_CONTAINERS} objects and lists")
    if containers + raw.count(b",") > MAX_JSON_VALUES:
        raise _TooLarge(f"the body holds more than {MAX_JSON_VALUES} values")
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise _TooDeep(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise _TooDeep(f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value` (counted without recursion; stops past the limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _error(status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"type": kind, "message": message}}


def make_app(
    backing_url: str,
    token: str,
    access_log: str | Path | None = None,
    previous_tokens: Sequence[str] = (),
    threads: int | None = None,
) -> StoreApp:
    """The app over the SQL store at `backing_url` (opened and migrated now), logging access to
    `access_log`. `threads`: the calls the server makes at once; that many database connections are
    opened now and kept (default: opened on demand)."""
    from mortal.state import open_store

    if backing_url.startswith(("http://", "https://")):
        raise ValueError(
            f"the HTTP store must be backed by a SQL database, not another HTTP store ({backing_url})"
        )
    return StoreApp(
        open_store(backing_url, connections=threads),
        token,
        None if access_log is None else AccessLog(access_log),
        previous_tokens,
    )


def previous_tokens_from(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """The admin tokens still accepted during a rotation ($MORTAL_STATE_PREVIOUS_TOKENS, comma separated)."""
    return [t.strip() for t in environ.get(PREVIOUS_TOKENS_ENV, "").split(",") if t.strip()]


def default_access_log() -> Path:
    return paths.mortal_home() / ACCESS_LOG


# -- the production server: waitress (running the store outside Modal, and the tests) ------------------
# Why waitress: it serves this WSGI app as it is, in threads of one process, so every request shares the
# one SqlStore and its SQLAlchemy engine (a pool of connections; SQLite's single writer is one file lock
# that a second process would fight over, and a forked engine must never share its pooled connections).
# Its one I/O thread reads each request in full before a worker thread sees it, so slow or stalled
# clients and idle keep-alive connections hold no worker thread (the stdlib server gave each connection a
# thread: 64 clients got failed requests and a p99 of 1.3 s). Pure Python, no dependencies, no compiler,
# and fine on 2 cores. Process servers (gunicorn) would need one engine per process; ASGI ones (uvicorn,
# hypercorn, granian) would need the app rewritten or wrapped, for no gain: SqlStore's calls block.
# On Modal none of this runs: @modal.wsgi_app serves make_app() behind Modal's own web server.
WORKER_THREADS = 8  # calls in flight at once; each holds one of the pool's connections, opened at start
# Open connections (mostly idle keep-alives of pooled clients); waitress's default is 100.
CONNECTION_LIMIT = 2048


def run_in_thread(server: Any, sockets: dict[int, Any], name: str) -> Callable[[], None]:
    """Loop a waitress server (created with `map=sockets`) on a daemon thread; returns what stops it.

    Why not waitress's own run(): it loops until the process ends, and the store server and the
    dashboard must stop with the block that serves them (tests, `mortalctl dashboard`'s Ctrl-C). Its turns
    are mortal.state.poll_loop's, which asks only the connections that may want something new."""
    from waitress import wasyncore

    from mortal.state.poll_loop import make_loop

    stop = threading.Event()
    loop = make_loop(sockets)

    def run() -> None:
        try:
            while not stop.is_set():
                loop.turn(0.1)
        finally:
            server.task_dispatcher.shutdown()
            wasyncore.close_all(sockets)
            loop.close()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join(timeout=10)

    return halt


class Served:
    """A running server: `url`, and `close()` (stops it and closes its store)."""

    def __init__(self, server: Any, app: StoreApp, halt: Callable[[], None]) -> None:
        self._server, self.app, self._halt = server, app, halt
        self.url = f"http://{server.effective_host}:{server.effective_port}"

    def close(self) -> None:
        self._halt()
        self.app.close()


def _error_task(access_log: AccessLog | None) -> type:
    """waitress's answer to what it refuses itself (a request line or headers it cannot parse, a body over
    the limit, a client that stalls mid-body, a token refused before the body is read), in JSON as the app
    answers, and in the access log."""
    from waitress.task import ErrorTask

    class JsonErrorTask(ErrorTask):
        def execute(self) -> None:
            error = self.request.error
            kind = (
                "Unauthorized"
                if error.code == 401
                else "BadRequest"
                if 400 <= error.code < 500
                else "Internal"
            )
            body = json.dumps({"error": {"type": kind, "message": f"{error.reason}: {error.body}"}}).encode()
            self.status = f"{error.code} {error.reason}"
            self.response_headers.append(("Content-Type", "application/json"))
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)
            if access_log is not None:
                client = self.channel.addr[0] if isinstance(self.channel.addr, tuple) else None
                access_log.record(
                    "unknown", str(getattr(self.request, "path", "") or ""), None, error.code, client
                )

    return JsonErrorTask


def _parser(app: StoreApp) -> type:
    """waitress's request parser, refusing a request without a valid token (401) as soon as its headers are
    in: waitress otherwise reads a whole body (spooled to a temporary file when large) before the app sees it,
    so anyone could fill the server's disk with bodies it would refuse. /healthz needs no token."""
    from waitress.parser import HTTPRequestParser
    from waitress.utilities import Error

    class TokenRefused(Error):
        code, reason = 401, "Unauthorized"

    class TokenFirstParser(HTTPRequestParser):
        _token_checked = False
        error: Any  # waitress's: None, or what it answers instead of the app

        def received(self, data: bytes) -> int:
            consumed = super().received(data)
            if self.headers_finished and not self._token_checked:
                self._token_checked = True
                refused = self.error is None and self.path != wire.HEALTH_PATH
                if refused and app.identify(self.headers.get("AUTHORIZATION", "")) is None:
                    self.error = TokenRefused(
                        f"missing, wrong or expired bearer token (the server's {TOKEN_ENV})"
                    )
                    self.completed = True
            return consumed

    return TokenFirstParser


@contextmanager
def serve(
    backing_url: str,
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
    read_timeout: float = READ_TIMEOUT_SECONDS,
    threads: int = WORKER_THREADS,
    access_log: str | Path | None = None,
    previous_tokens: Sequence[str] = (),
    reuse_port: bool = False,
    freeze_heap: bool = False,
) -> Iterator[Served]:
    """Serve the store with waitress in a background thread for the duration of the block (port 0: any
    free port). A connection silent for `read_timeout` (mid-request, or idle between requests) is closed.
    Requests are logged to `access_log` when given; `previous_tokens` are admin tokens still accepted.
    `reuse_port`: listen with SO_REUSEPORT, so that several server processes share one address.
    `freeze_heap`: for a process that only serves (`main`), see `_freeze_heap`; never in a process whose
    objects come and go after it (a test's), as frozen objects are never collected."""
    try:
        from waitress.channel import HTTPChannel
        from waitress.server import create_server
    except ImportError as exc:
        raise ImportError("serving the store needs waitress: pip install 'mortal[server]'") from exc

    # Not a line per request queued behind busy threads.
    logging.getLogger("waitress.queue").setLevel(logging.ERROR)
    app = make_app(backing_url, token, access_log, previous_tokens, threads=threads)
    if freeze_heap:
        _freeze_heap()
    channel = type(
        "_StoreChannel",
        (HTTPChannel,),
        {"error_task_class": _error_task(app.access_log), "parser_class": _parser(app)},
    )
    sockets: dict[int, Any] = {}  # waitress's asyncore map, ours so that the loop below can close it
    where: dict[str, Any] = (
        {"sockets": [_shared_listener(host, port)]} if reuse_port else {"host": host, "port": port}
    )
    server = create_server(
        app,
        map=sockets,
        **where,
        threads=threads,
        channel_timeout=max(1, round(read_timeout)),
        cleanup_interval=max(1, round(read_timeout)),
        connection_limit=CONNECTION_LIMIT,
        max_request_body_size=MAX_BODY_BYTES,
        asyncore_use_poll=True,
        ident="mortal",
        clear_untrusted_proxy_headers=True,
    )
    server.channel_class = channel
    served = Served(server, app, run_in_thread(server, sockets, "mortal-http-store"))
    try:
        yield served
    finally:
        served.close()


def _freeze_heap() -> None:
    """Leave the objects of the server's start (its imports, the migrations, the engine) out of every
    later garbage collection (gc.freeze). Why: Python's full collection walks every object the process
    holds and stops all its threads meanwhile; the first ones came with the first burst of calls, and
    walking what the start had left took the server's threads a good part of a second, the clients'
    first calls waiting behind them (docs/benchmarks.md). What is frozen lives as long as the process."""
    gc.collect()
    gc.freeze()


def _shared_listener(host: str, port: int) -> socket.socket:
    """A listening socket that other processes may bind too (SO_REUSEPORT: the kernel spreads new
    connections over them)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def _start_siblings(argv: list[str], count: int, backing_url: str) -> list[subprocess.Popen]:
    """`count` more server processes on the same address. Why processes: a store call is mostly Python
    (SQLAlchemy, pydantic, JSON) under one GIL, so one process serves one core's worth of calls; each
    sibling has its own engine and pool (a forked engine must never share pooled connections).
    The database URL goes in their environment, never their command line, which every local user can read
    (it may hold a password)."""
    cmd = [
        sys.executable,
        "-m",
        "mortal.state.http_server",
        *argv,
        "--processes",
        "1",
        "--reuse-port",
        "--parent-pid",
        str(os.getpid()),
    ]
    env = {**os.environ, paths.STATE_URL_ENV: backing_url}
    return [subprocess.Popen(cmd, env=env) for _ in range(count)]


def _wait_while_parent_lives(parent_pid: int | None) -> None:
    """Serve until killed; a sibling also ends when the process that started it is gone (never orphaned)."""
    while parent_pid is None or os.getppid() == parent_pid:
        threading.Event().wait(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mortal.state.http_server",
        description="Serve a mortal state store over HTTP (token: $MORTAL_STATE_TOKEN).",
    )
    parser.add_argument(
        "--backing-url", default=None, help="SQL store to serve (default: $MORTAL_STATE_URL or SQLite)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument(
        "--threads", type=int, default=WORKER_THREADS, help="store calls served at once, per process"
    )
    parser.add_argument(
        "--access-log", default=None, help=f"where requests are logged (default: $MORTAL_HOME/{ACCESS_LOG})"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="server processes sharing the address (SO_REUSEPORT); one per core the server may use",
    )
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(TOKEN_ENV, "")
    try:
        check_tokens(token, previous_tokens_from(os.environ))
    except WeakToken as exc:
        parser.error(str(exc))
    shared = args.reuse_port or args.processes > 1
    access_log = args.access_log or default_access_log()
    siblings: list[subprocess.Popen] = []
    try:
        with serve(
            args.backing_url or default_state_url(),
            token,
            args.host,
            args.port,
            threads=args.threads,
            access_log=access_log,
            previous_tokens=previous_tokens_from(os.environ),
            reuse_port=shared,
            freeze_heap=True,
        ) as served:
            if args.processes > 1:
                port = served.url.rsplit(":", 1)[1]  # the bound port, also when --port 0 asked for any
                sibling_args = [
                    "--host",
                    args.host,
                    "--port",
                    port,
                    "--threads",
                    str(args.threads),
                    "--access-log",
                    str(access_log),
                ]
                siblings = _start_siblings(
                    sibling_args, args.processes - 1, args.backing_url or default_state_url()
                )
            log.info("serving the state store at %s (pid %d)", served.url, os.getpid())
            _wait_while_parent_lives(args.parent_pid)
    finally:
        for sibling in siblings:
            sibling.terminate()
        for sibling in siblings:
            try:
                sibling.wait(10)
            except subprocess.TimeoutExpired:
                sibling.kill()


if __name__ == "__main__":
    main()
