"""The servers' socket loop (mortal.state.poll_loop): a request costs the loop work for the connections that
are busy, not for every open one, and whatever a connection is owed still reaches it (idle connections
closed, large answers sent whole). The HTTP store's tests run on it too (they serve through it)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import requests
from waitress.channel import HTTPChannel
from waitress.server import create_server

from mortal.state import poll_loop
from mortal.state.http_server import run_in_thread

IDLE_CONNECTIONS = 100
BIG, CHUNK = 8 * 1024 * 1024, 64 * 1024


def _app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """`/big`: BIG bytes in chunks, written one after another by the worker thread; else a small answer."""
    chunks = [b"x" * CHUNK] * (BIG // CHUNK) if environ["PATH_INFO"] == "/big" else [b'{"ok": true}']
    length = sum(map(len, chunks))
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(length))])
    return chunks


@contextmanager
def _served(**adjustments: Any) -> Iterator[str]:
    sockets: dict[int, Any] = {}
    server = create_server(
        _app, map=sockets, host="127.0.0.1", port=0, threads=2, connection_limit=1000, **adjustments
    )
    halt = run_in_thread(server, sockets, "test-loop")
    try:
        yield f"http://127.0.0.1:{server.effective_port}"
    finally:
        halt()


def test_a_request_asks_the_busy_connections_not_every_open_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poll_loop, "SWEEP_SECONDS", 3600.0)  # only the sweeps an accept or a clean-up makes
    asked = {"n": 0}
    readable = HTTPChannel.readable

    def counted(channel: HTTPChannel) -> bool:
        asked["n"] += 1
        return readable(channel)

    monkeypatch.setattr(HTTPChannel, "readable", counted)
    with _served() as url, ExitStack() as idle, requests.Session() as session:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(IDLE_CONNECTIONS):
            idle.enter_context(socket.create_connection(("127.0.0.1", port)))
        assert session.get(f"{url}/", timeout=10).ok  # the last connection accepted: every one asked once
        asked["n"] = 0
        for _ in range(20):
            assert session.get(f"{url}/", timeout=10).ok
        assert asked["n"] < 20 * 10, f"{asked['n']} questions for 20 requests with {IDLE_CONNECTIONS} idle"


def test_an_answer_larger_than_the_output_buffer_is_sent_whole() -> None:
    """Past the buffer's high watermark a worker waits for the loop to send: the loop polls for it then."""
    with _served(outbuf_high_watermark=CHUNK) as url:
        answer = requests.get(f"{url}/big", timeout=30)
        assert answer.ok and len(answer.content) == BIG


def test_an_idle_connection_is_closed_after_the_channel_timeout() -> None:
    with _served(channel_timeout=1, cleanup_interval=1) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            assert idle.recv(1) == b"", "closed by the server"
