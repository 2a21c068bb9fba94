"""`mortalctl dashboard`: a read-only web page of the runs in the store, updated live.

    mortalctl dashboard                      # http://127.0.0.1:8265/  (--host, --port)
    mortalctl --state-url http://HOST:8470 dashboard   # a store served over HTTP, as for the other verbs

Pages `/` (the runs) and `/runs/NAME?step=N&k=K` (one run), the same data as JSON under `/api/`; the
page's script swaps in re-rendered sections every `--refresh` seconds. Texts are cut to a page's worth,
and an item's own endpoint returns it whole. Served by waitress, as the store server is; a connection
idle for IDLE_SECONDS is closed, so sockets that send nothing cannot hold every connection slot.
What it must not do: write to the store (it holds a ReadOnlyStore), talk to workers, or load anything
from the network (its script and stylesheet are package files).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote

import typer

from mortal.client.cli import dashboard_data as data
from mortal.client.cli import dashboard_html as pages
from mortal.client.cli.context import CliError, state

log = logging.getLogger("mortal.dashboard")
DEFAULT_PORT = 8265
DEFAULT_REFRESH_SECONDS = 3.0
IDLE_SECONDS = 10  # a connection that sends nothing for this long is closed (a page asks every few seconds)
CONNECTION_LIMIT = 500  # open connections before new ones wait for idle ones to be shed
MAX_SHOWN = 50
STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
SECURITY_HEADERS = [
    # the page runs only the dashboard's own script file: a completion that escaped escaping could not run
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
]
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
}

HELP = """Serve a read-only web page of the runs in the store, updated live.

\b
Examples:
  # The runs of the default store at http://127.0.0.1:8265/
  mortalctl dashboard
\b
  # Another port; a store served over HTTP (or set MORTAL_STATE_URL)
  mortalctl dashboard --port 9000
  mortalctl --state-url http://store-host:8470 dashboard
"""


class _BadRequest(Exception):
    pass


def _json_body(doc: Any) -> bytes:
    # <, > and & as \\u escapes: model text in the JSON can never close a tag wherever it lands
    text = json.dumps(doc, ensure_ascii=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def _static(name: str) -> bytes:
    return resources.files("mortal.client.cli").joinpath("dashboard_static", name).read_bytes()


class DashboardApp:
    """The WSGI application: pages, JSON endpoints and two static files, all answered from a ReadOnlyStore."""

    def __init__(
        self,
        store: data.ReadOnlyStore,
        refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
        loopback_only: bool = True,
    ) -> None:
        """`loopback_only`: answer only requests whose Host names this machine's loopback (the server listens
        there): a web page's script, whose DNS name was made to point at 127.0.0.1 ("DNS rebinding"), sends
        its own name and is refused, so it cannot read the runs through the user's browser."""
        self.store, self.refresh_seconds, self.loopback_only = store, refresh_seconds, loopback_only

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            status, content_type, body = self.handle(environ)
        except Exception as exc:  # the page says the store failed; the trace goes to the server's log
            log.exception("dashboard request %s failed", environ.get("PATH_INFO"))
            status, content_type = 500, "text/html; charset=utf-8"
            body = pages.error_page("store error", f"{type(exc).__name__}: {exc}").encode()
        start_response(
            f"{status} {_REASONS.get(status, 'Error')}",
            [("Content-Type", content_type), ("Content-Length", str(len(body))), *SECURITY_HEADERS],
        )
        return [body]

    def handle(self, environ: dict[str, Any]) -> tuple[int, str, bytes]:
        from mortal.state import NotFound

        path = environ.get("PATH_INFO", "/")
        if self.loopback_only and _host_name(environ.get("HTTP_HOST", "")) not in LOOPBACK_NAMES:
            return (
                403,
                "text/plain; charset=utf-8",
                b"this dashboard answers to localhost and 127.0.0.1 only\n",
            )
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            return 405, "text/plain; charset=utf-8", b"the dashboard only reads: GET\n"
        query = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        is_json = path.startswith("/api/")
        try:
            return self._route(path.removeprefix("/api") if is_json else path, query, is_json)
        except (NotFound, CliError, _BadRequest) as exc:
            status = 404 if isinstance(exc, NotFound) else 400
            if is_json:
                return status, "application/json", _json_body({"error": str(exc)})
            return status, "text/html; charset=utf-8", pages.error_page(_REASONS[status], str(exc)).encode()

    def _route(self, path: str, query: dict[str, str], is_json: bool) -> tuple[int, str, bytes]:
        if path.startswith("/static/") and not is_json and path.removeprefix("/static/") in STATIC:
            name = path.removeprefix("/static/")
            return 200, STATIC[name], _static(name)
        sections = query.get("sections") == "1"
        if path in ("/", "/runs"):
            view = data.runs_view(self.store)
            if is_json:
                return self._json(view, pages.runs_sections(view) if sections else None)
            return 200, "text/html; charset=utf-8", pages.runs_page(view, self.refresh_seconds).encode()
        if is_json and path.startswith("/runs/") and path.count("/") > 2:
            name, kind, *key = (unquote(part) for part in path.removeprefix("/runs/").split("/"))
            return self._json(data.full_item(self.store, name, kind, key), None)
        if path.startswith("/runs/") and path.count("/") == 2:
            name = unquote(path.removeprefix("/runs/"))
            step, shown = _int(query, "step", None), _int(query, "k", data.DEFAULT_SHOWN)
            if shown is None or not 1 <= shown <= MAX_SHOWN:
                raise _BadRequest(f"k must be 1 to {MAX_SHOWN}")
            view = data.run_view(self.store, name, step, shown)
            if is_json:
                return self._json(
                    view, pages.run_sections(view, step is not None, shown) if sections else None
                )
            api = "/api" + pages.run_url(name, step=step, k=shown)
            return (
                200,
                "text/html; charset=utf-8",
                pages.run_page(view, api, step is not None, shown, self.refresh_seconds).encode(),
            )
        from mortal.state import NotFound

        raise NotFound(f"nothing at {path!r}")

    def _json(self, view: dict[str, Any], sections: dict[str, str] | None) -> tuple[int, str, bytes]:
        return (
            200,
            "application/json",
            _json_body(view if sections is None else {**view, "sections": sections}),
        )


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def _host_name(header: str) -> str:
    """The Host header's name without its port ("[::1]:8765" -> "[::1]")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header.partition("]")[0] + "]"
    return header.partition(":")[0]


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _int(query: dict[str, str], key: str, default: int | None) -> int | None:
    value = query.get(key, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise _BadRequest(f"{key}={value!r} is not a whole number") from None


def open_read_only(url: str | None):
    """The store at `url` (default: as the other verbs) for reading only: a SQL store is not migrated (a
    store behind this mortal's schema is refused, nothing is created), an HTTP store is asked only reads."""
    from mortal.state import default_state_url, open_store, sqlite_path

    url = url or default_state_url()
    if url.startswith(("http://", "https://")):
        return data.ReadOnlyStore(open_store(url))
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise CliError(f"no state store at {path}: nothing has been applied there yet")
    from mortal.state import migrate
    from mortal.state.engine import connection
    from mortal.state.sql_store import SqlStore

    store = SqlStore(url)
    with connection(store._engine, write=False) as conn:
        current = migrate.current_revision(conn)
    if current != migrate.head_revision():
        store.close()
        raise CliError(
            f"the state store at {url} is at schema {current or 'none'}, this mortal reads "
            f"{migrate.head_revision()}: run a mortalctl command that writes (or the controller) "
            "with this version first; the dashboard never migrates"
        )
    return data.ReadOnlyStore(store)


@contextmanager
def serve(
    store: data.ReadOnlyStore,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    threads: int = 4,
    idle_seconds: int = IDLE_SECONDS,
    connection_limit: int = CONNECTION_LIMIT,
) -> Iterator[str]:
    """Serve the dashboard with waitress from a background thread for the duration of the block; yields
    its URL (port 0: any free port). Connections idle for `idle_seconds` are closed."""
    try:
        from waitress.server import create_server

        from mortal.state.http_server import run_in_thread
    except ImportError as exc:
        raise CliError("the dashboard is served by waitress: pip install 'mortal[server]'") from exc

    sockets: dict[int, Any] = {}
    try:
        server = create_server(
            DashboardApp(store, refresh_seconds, loopback_only=_is_loopback(host)),
            map=sockets,
            host=host,
            port=port,
            threads=threads,
            ident="mortal-dashboard",
            asyncore_use_poll=True,
            channel_timeout=idle_seconds,
            cleanup_interval=1,
            connection_limit=connection_limit,
        )
    except OSError as exc:  # in use, a privileged port, an address this machine does not have
        raise CliError(
            f"--port {port} / --host {host}: cannot listen there ({exc.strerror or exc}); "
            "pick another --port (0: any free one)"
        ) from exc
    halt = run_in_thread(server, sockets, "mortal-dashboard")
    try:
        yield f"http://{server.effective_host}:{server.effective_port}"
    finally:
        halt()


def dashboard(
    ctx: typer.Context,
    port: int = typer.Option(DEFAULT_PORT, "--port", min=0, max=65535, help="TCP port (0: any free one)."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on; 0.0.0.0 shows the store to the network."
    ),
    refresh: float = typer.Option(
        DEFAULT_REFRESH_SECONDS,
        "--refresh",
        min=0.5,
        metavar="SECONDS",
        help="How often an open page reads the store again.",
    ),
) -> None:
    """Serve a read-only web page of the runs (reward and loss curves, workers, checkpoints, events,
    completions)."""
    store = open_read_only(state(ctx).state_url)
    logging.basicConfig(level=logging.WARNING)
    try:
        with serve(store, host, port, refresh) as url:
            typer.echo(f"mortal dashboard at {url}/ (read-only; Ctrl-C to stop)", err=True)
            if not _is_loopback(host):
                typer.echo(
                    f"warning: --host {host}: anyone who reaches this address reads every run's specs, "
                    "events and completions (the dashboard asks no token); put it behind a proxy that "
                    "authenticates, or keep the default 127.0.0.1",
                    err=True,
                )
            wait_for_ctrl_c()
    except KeyboardInterrupt:
        pass
    finally:
        store.close()


def wait_for_ctrl_c() -> None:
    """Block until KeyboardInterrupt: the dashboard serves from its thread meanwhile."""
    threading.Event().wait()


def register(app: typer.Typer) -> None:
    app.command("dashboard", help=HELP, short_help="Serve a live read-only web page of the runs")(dashboard)
