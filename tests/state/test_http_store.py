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

from mortal.state import Conflict, Fenced, NotFound, Store, WorkerRef, open_store, wire
from mortal.state.errors import Unauthorized, Unavailable
from mortal.state.http_server import Served, StoreApp, make_app, serve
from mortal.state.http_store import HttpStore

TOKEN = "t0ken"
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


def test_typed_errors_travel_as_status_codes_and_come_back_as_their_class(served: Served) -> None:
    assert (post(served, "get_run", {"name": "nope"}).status_code, post(served, "get_run", {}).status_code) == (404, 400)
    post(served, "apply_run", {"name": "r", "spec": SPEC})
    stale = post(served, "update_spec", {"name": "r", "spec": SPEC, "resource_version": 9})
    assert (stale.status_code, stale.json()["error"]["type"]) == (409, "Conflict")
    ghost = {"run": "r", "role": "actor", "replica": 0, "incarnation": 5}
    assert post(served, "heartbeat", {"worker": ghost}).status_code == 412
    assert post(served, "no_such_method", {}).status_code == 404
    assert requests.get(f"{served.url}/v1/list_runs", timeout=10).status_code == 405

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


def test_a_server_error_is_unavailable_and_not_retried(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(name: str):
        calls.append(name)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(served.app.store, "get_run", broken)
    with pytest.raises(Unavailable, match="disk on fire"):
        HttpStore(served.url, token=TOKEN, read_retry_seconds=5).get_run("r")
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
    store = HttpStore(f"http://127.0.0.1:{port}", token=TOKEN, read_retry_seconds=20)
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
        store = HttpStore(server.url, token=TOKEN, read_retry_seconds=0.6)
        with pytest.raises(Unavailable):
            store.list_runs()
        reads = len(server.requests)
        assert reads >= 2 and set(server.requests) == {b"POST /v1/list_runs HTTP/1.1"}
        with pytest.raises(Unavailable):
            store.add_event("r", "Normal", "Hello", "once")
        assert server.requests[reads:] == [b"POST /v1/add_event HTTP/1.1"], "a write is never sent twice"
    finally:
        server.close()
