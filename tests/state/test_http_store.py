"""The HTTP store beyond the contract suite (which runs on it through the `store` fixture's "http" case):
the token, typed errors as status codes, which calls are retried and which are never sent twice."""

from __future__ import annotations

import inspect
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from mortal.state import Conflict, Fenced, NotFound, Store, WorkerRef, http_server, open_store, wire
from mortal.state.errors import Unauthorized, Unavailable
from mortal.state.http_server import MIN_TOKEN_CHARS, Served, StoreApp, WeakToken, make_app, serve
from mortal.state.http_store import HttpStore

TOKEN = "http-store-t0ken"
SPEC = {"model": {"name": "tiny"}}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serve(f"sqlite:///{tmp_path / 'state.db'}", TOKEN) as server:
        yield server


def post(served: Served, method: str, args: dict, token: str | None = TOKEN) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(f"{served.url}/v1/{method}", json={"args": args}, headers=headers, timeout=10)


def test_every_store_method_travels_with_its_signature() -> None:
    assert set(wire.methods()) == Store.__abstractmethods__ - {"close"}
    assert not HttpStore.__abstractmethods__
    for name in wire.methods():
        assert inspect.signature(getattr(HttpStore, name)) == inspect.signature(getattr(Store, name)), name


def test_open_store_gives_the_http_client(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORTAL_STATE_TOKEN", raising=False)
    store = open_store(served.url)
    assert isinstance(store, HttpStore)
    with pytest.raises(Unauthorized, match="MORTAL_STATE_TOKEN"):
        store.list_runs()
    assert HttpStore(served.url, token=TOKEN).apply_run("r", SPEC)[0].name == "r"


def test_the_token_guards_every_method_but_health(served: Served) -> None:
    assert post(served, "list_runs", {}, token=None).status_code == 401
    assert post(served, "list_runs", {}, token="wrong").json()["error"]["type"] == "Unauthorized"
    assert post(served, "list_runs", {}).json() == {"result": []}
    assert requests.get(f"{served.url}/healthz", timeout=10).json() == {"ok": True}
    with pytest.raises(Unauthorized):
        HttpStore(served.url, token="wrong").get_run("r")
    with pytest.raises(ValueError, match="MORTAL_STATE_TOKEN"):
        StoreApp(served.app.store, token="")


def test_the_server_refuses_an_admin_token_too_short_to_be_secret(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The endpoint may be public and the admin token makes every call: a guessable one is refused at start,
    current or still accepted from a rotation, with the variable to fix named; the token itself never is."""
    short, strong = "x" * (MIN_TOKEN_CHARS - 1), "s" * MIN_TOKEN_CHARS
    with pytest.raises(WeakToken, match=f"MORTAL_STATE_TOKEN.*at least {MIN_TOKEN_CHARS}") as weak:
        StoreApp(served.app.store, token=short)
    assert short not in str(weak.value)
    with pytest.raises(WeakToken, match="MORTAL_STATE_PREVIOUS_TOKENS"):
        StoreApp(served.app.store, token=strong, previous_tokens=[strong, "old"])
    assert StoreApp(served.app.store, token=strong).identify(f"Bearer {strong}") is not None
    monkeypatch.setenv("MORTAL_STATE_TOKEN", "x")
    with pytest.raises(SystemExit) as refused:
        http_server.main(["--backing-url", f"sqlite:///{tmp_path / 'other.db'}", "--port", "0"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "MORTAL_STATE_TOKEN holds a token too short" in error
    assert not (tmp_path / "other.db").exists(), "refused before the database is opened"


def test_typed_errors_travel_as_status_codes_and_come_back_as_their_class(served: Served) -> None:
    assert (
        post(served, "get_run", {"name": "nope"}).status_code,
        post(served, "get_run", {}).status_code,
    ) == (404, 400)
    post(served, "apply_run", {"name": "r", "spec": SPEC})
    stale = post(served, "update_spec", {"name": "r", "spec": SPEC, "resource_version": 9})
    assert (stale.status_code, stale.json()["error"]["type"]) == (409, "Conflict")
    ghost = {"run": "r", "role": "actor", "replica": 0, "incarnation": 5}
    assert post(served, "heartbeat", {"worker": ghost}).status_code == 412
    assert post(served, "no_such_method", {}).status_code == 404
    assert (
        requests.get(
            f"{served.url}/v1/list_runs", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        ).status_code
        == 405
    )
    assert requests.get(f"{served.url}/v1/list_runs", timeout=10).status_code == 401, (
        "nothing before the token"
    )

    store = HttpStore(served.url, token=TOKEN)
    with pytest.raises(NotFound, match="nope"):
        store.get_run("nope")
    with pytest.raises(Conflict):
        store.update_spec("r", SPEC, resource_version=9)
    with pytest.raises(Fenced):
        store.heartbeat(WorkerRef("r", "actor", 0, 5))
    row = store.create_worker("r", "actor", 0, "local", 10)
    with pytest.raises(ValueError, match="state must be"):
        store.end_worker(row.id, "Running")
    with pytest.raises(TypeError):
        store.get_run()  # bound locally against the Store signature, never sent


def test_a_server_error_is_unavailable_and_not_retried(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def broken(name: str):
        calls.append(name)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(served.app.store, "get_run", broken)
    with pytest.raises(Unavailable, match="disk on fire"):
        HttpStore(served.url, token=TOKEN, retry_seconds=5).get_run("r")
    assert calls == ["r"], "a 500 is an answer, not a lost request: reads retry only transport failures"


def test_the_server_serves_only_a_sql_store() -> None:
    with pytest.raises(ValueError, match="SQL database"):
        make_app("https://elsewhere.example", TOKEN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_read_waits_for_a_server_that_comes_up(tmp_path: Path) -> None:
    port = _free_port()
    store = HttpStore(f"http://127.0.0.1:{port}", token=TOKEN, retry_seconds=20)
    up, done = threading.Event(), threading.Event()

    def late_server() -> None:
        time.sleep(0.5)
        with serve(f"sqlite:///{tmp_path / 'state.db'}", TOKEN, port=port):
            up.set()
            done.wait(20)

    thread = threading.Thread(target=late_server, daemon=True)
    thread.start()
    try:
        assert store.list_runs() == []
        assert up.is_set()
    finally:
        done.set()
        thread.join(10)


class HangUp:
    """A TCP server that reads each request and closes the connection without answering: the request
    reached the server, and the client cannot know what it did."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
                    data += chunk
                self.requests.append(data.split(b"\r\n", 1)[0])

    def close(self) -> None:
        self.sock.close()


def test_reads_are_sent_again_but_writes_only_once() -> None:
    server = HangUp()
    try:
        store = HttpStore(server.url, token=TOKEN, retry_seconds=0.6)
        with pytest.raises(Unavailable):
            store.list_runs()
        reads = len(server.requests)
        assert reads >= 2 and set(server.requests) == {b"POST /v1/list_runs HTTP/1.1"}
        with pytest.raises(Unavailable):
            store.add_event("r", "Normal", "Hello", "once")
        assert server.requests[reads:] == [b"POST /v1/add_event HTTP/1.1"], "a write is never sent twice"
    finally:
        server.close()


def test_the_environments_proxy_is_used_unless_no_proxy_names_the_host(served: Served, monkeypatch) -> None:
    """The client reads the proxy settings once per session, not per request; it still honours them."""
    proxy = HangUp()
    try:
        for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        with pytest.raises(Unavailable):
            HttpStore(served.url, token=TOKEN, retry_attempts=1).list_runs()
        assert proxy.requests == [f"POST {served.url}/v1/list_runs HTTP/1.1".encode()], "through the proxy"
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert HttpStore(served.url, token=TOKEN, retry_attempts=1).list_runs() == []
    finally:
        proxy.close()


def test_a_netrc_entry_for_the_host_does_not_replace_the_token(served: Served, tmp_path: Path, monkeypatch):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password secret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert HttpStore(served.url, token=TOKEN, retry_attempts=1).list_runs() == []


def test_a_value_json_cannot_hold_is_refused_before_it_is_sent(served: Served) -> None:
    store = HttpStore(served.url, token=TOKEN, retry_attempts=1)
    with pytest.raises(ValueError, match="not JSON"):
        store.add_event("r", "Normal", "Hello", float("nan"))  # type: ignore[arg-type]


def test_every_idempotent_write_is_a_store_write() -> None:
    assert wire.IDEMPOTENT_WRITES.issubset(set(wire.methods()) - wire.READS)


def test_any_call_is_sent_again_while_the_connection_is_refused(tmp_path: Path) -> None:
    """Refused: nothing reached the server, so even a write that is not idempotent is sent again."""
    port = _free_port()
    store = HttpStore(f"http://127.0.0.1:{port}", token=TOKEN, retry_seconds=20)
    up, done = threading.Event(), threading.Event()

    def late_server() -> None:
        time.sleep(0.5)
        with serve(f"sqlite:///{tmp_path / 'state.db'}", TOKEN, port=port) as server:
            server.app.store.apply_run("r", SPEC)
            up.set()
            done.wait(20)

    thread = threading.Thread(target=late_server, daemon=True)
    thread.start()
    try:
        assert store.add_event("r", "Normal", "Hello", "once").reason == "Hello"
        assert [e.reason for e in store.list_events("r")] == ["Hello"], "sent again, applied once"
    finally:
        done.set()
        thread.join(10)


def test_retries_are_bounded_in_attempts_and_time() -> None:
    refused = f"http://127.0.0.1:{_free_port()}"
    started = time.monotonic()
    with pytest.raises(Unavailable, match="unreachable"):
        HttpStore(refused, token=TOKEN, retry_attempts=3, retry_seconds=60).list_runs()
    assert time.monotonic() - started < 5, "three tries, not a minute"
    started = time.monotonic()
    with pytest.raises(Unavailable, match="unreachable"):
        HttpStore(refused, token=TOKEN, retry_attempts=1000, retry_seconds=1).list_runs()
    assert time.monotonic() - started < 5, "a second, not a thousand tries"


def unavailable_at_first(served: Served, monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """The server answers 503 to the first `times` calls (a store starting up), then as usual; the calls
    that reached it, by name."""
    calls: list[str] = []
    real = served.app._call

    def call(method: wire.Method, kwargs: dict, *who: object) -> tuple[int, dict]:
        calls.append(method.name)
        if len(calls) <= times:
            return 503, {"error": {"type": "Unavailable", "message": "starting up"}}
        return real(method, kwargs, *who)

    monkeypatch.setattr(served.app, "_call", call)
    return calls


def test_reads_and_idempotent_writes_are_sent_again_after_a_503(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = HttpStore(served.url, token=TOKEN, retry_seconds=20)
    store.apply_run("r", SPEC)
    worker = store.create_worker("r", "actor", 0, "local", 10)
    ref = WorkerRef("r", "actor", 0, worker.incarnation)

    calls = unavailable_at_first(served, monkeypatch, times=2)
    assert store.get_run("r").name == "r"
    assert calls == ["get_run"] * 3
    calls.clear()
    assert store.heartbeat(ref, step=3).step == 3  # an idempotent write: the same values set again
    assert calls == ["heartbeat"] * 3
    calls.clear()
    store.add_metrics(ref, 3, {"loss": 0.5})  # an upsert: one value per (step, name)
    assert calls == ["add_metrics"] * 3
    assert [(m.step, m.value) for m in store.list_metrics("r")] == [(3, 0.5)]


def test_a_write_that_is_not_idempotent_is_not_sent_again_after_a_503(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = HttpStore(served.url, token=TOKEN, retry_seconds=20)
    store.apply_run("r", SPEC)
    calls = unavailable_at_first(served, monkeypatch, times=2)
    with pytest.raises(Unavailable, match="starting up"):
        store.create_worker("r", "actor", 0, "local", 10)  # a second try would take a second incarnation
    with pytest.raises(Unavailable, match="starting up"):
        store.add_event("r", "Normal", "Hello", "once")  # a 503 from a gateway may follow a call that landed
    assert calls == ["create_worker", "add_event"], "each sent once"
    assert store.list_workers("r") == [] and store.list_events("r") == []
