"""The public store endpoint under hostile input: every bad request gets a clear 4xx with a JSON error
(never a 5xx, never a hang), and the store is exactly as it was afterwards.

Fuzzed with hypothesis through raw sockets, so nothing is tidied up by a client library: malformed and
truncated bodies, deeply nested JSON, oversized bodies, wrong verbs and paths, missing and wrong
tokens, arguments of the wrong type for every Store method, and clients that stall mid-request.
"""

from __future__ import annotations

import json
import socket
import string
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mortal.state import wire
from mortal.state.http_server import (
    MAX_BODY_BYTES,
    MAX_JSON_CONTAINERS,
    MAX_JSON_DEPTH,
    MAX_JSON_VALUES,
    Served,
    serve,
)
from mortal.state.http_store import HttpStore

TOKEN = "fuzz-test-admin-t0ken"
READ_TIMEOUT = 0.5  # the server's, for this test: a stalled client is dropped after it
FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
METHODS = sorted(wire.methods())
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A served store holding one run with a status and an event: something for bad requests to spoil."""
    db = tmp_path_factory.mktemp("fuzz") / "state.db"
    with serve(f"sqlite:///{db}", TOKEN, read_timeout=READ_TIMEOUT) as server:
        client = HttpStore(server.url, token=TOKEN)
        client.apply_run("r", {"model": {"name": "tiny"}}, labels={"team": "rl"})
        client.write_status("r", {"phase": "Running", "step": 3})
        client.add_event("r", "Normal", "Started", "fuzz fixture")
        yield server


def snapshot(served: Served) -> str:
    """Everything the bad requests could have touched, read straight from the SQL store."""
    store = served.app.store
    state = {
        "runs": store.list_runs(),
        "workers": store.list_workers(),
        "events": store.list_events(limit=1000),
        "checkpoints": store.list_checkpoints("r", complete_only=False),
        "weights": store.list_weights("r"),
        "metrics": store.list_metrics("r"),
        "lease": store.get_lease("controller"),
    }
    return json.dumps(wire.encode(state), sort_keys=True, default=str)


# -- raw HTTP -----------------------------------------------------------------------------------------------
def request(
    served: Served, head: bytes, body: bytes = b"", timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    """Send `head` and `body` as they are; the status, headers and body of the answer."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
    if not answer.startswith(b"HTTP/"):  # what a request line read as HTTP/0.9 gets: the body alone
        return 0, {"content-type": "application/json"}, answer
    status_line, _, rest = answer.partition(b"\r\n")
    raw_headers, _, payload = rest.partition(b"\r\n\r\n")
    headers = dict(
        line.decode("latin-1").lower().split(": ", 1) for line in raw_headers.split(b"\r\n") if line
    )
    return int(status_line.split()[1]), headers, payload


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def head_of(
    verb: str, path: str, body: bytes = b"", token: str | None = TOKEN, length: int | None = None
) -> bytes:
    lines = [
        f"{verb} {path} HTTP/1.1",
        "Host: store",
        f"Content-Length: {len(body) if length is None else length}",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


def post(served: Served, method: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    status, headers, payload = request(served, head_of("POST", f"/v1/{method}", body, token), body)
    assert headers.get("content-type") == "application/json", (status, payload[:200])
    return status, json.loads(payload)


def assert_refused(status: int, answer: dict[str, Any], *statuses: int) -> None:
    assert 400 <= status < 500 and (not statuses or status in statuses), (status, answer)
    assert set(answer) == {"error"} and answer["error"]["type"] and answer["error"]["message"], answer


def args_body(args: Any) -> bytes:
    return json.dumps({"args": args}).encode()


# -- bodies -------------------------------------------------------------------------------------------------
@FUZZ
@given(
    body=st.binary(max_size=300)
    | JSON.map(lambda v: json.dumps(v).encode())
    | st.builds(
        lambda s, cut: s[:cut], JSON.map(lambda v: args_body({"name": v}).decode()), st.integers(0, 40)
    ).map(str.encode)
)
def test_malformed_bodies_are_refused_and_change_nothing(served: Served, body: bytes) -> None:
    before = snapshot(served)
    status, answer = post(served, "write_status", body)  # needs name and status: no fuzzed body has both
    assert_refused(status, answer, 400)
    assert snapshot(served) == before


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1_000, 100_000])
@pytest.mark.parametrize("shape", ["list", "object", "in-args"])
def test_deeply_nested_json_is_a_400_not_a_recursion_error(served: Served, depth: int, shape: str) -> None:
    before = snapshot(served)
    if shape == "list":
        body = b"[" * depth + b"]" * depth
    elif shape == "object":
        body = b'{"a":' * depth + b"1" + b"}" * depth
    else:  # a real method with a spec nested deep inside its args
        body = (
            b'{"args": {"name": "r", "resource_version": 1, "spec": '
            + b'{"a":' * depth
            + b"1"
            + b"}" * depth
            + b"}}"
        )
    status, answer = post(served, "update_spec", body)
    assert_refused(status, answer, 400)
    assert "nests deeper" in answer["error"]["message"]
    assert snapshot(served) == before


@pytest.mark.parametrize(
    ("item", "limit", "said"),
    [(b"{}", MAX_JSON_CONTAINERS, "objects and lists"), (b'"ab"', MAX_JSON_VALUES, "values")],
    ids=["empty-objects", "short-strings"],
)
def test_a_body_of_more_small_items_than_the_limit_is_a_413_before_it_is_parsed(
    served: Served, item: bytes, limit: int, said: str
) -> None:
    """Empty objects, short strings and numbers cost Python far more than their bytes: a body of little else
    is refused by count, with any token (here the admin's), so that one call cannot make the server hold
    gigabytes."""
    before = snapshot(served)
    body = b'{"args": {"name": "r", "x": [' + (item + b",") * limit + item + b"]}}"
    status, answer = post(served, "get_run", body)
    assert_refused(status, answer, 413)
    assert f"more than {limit} {said}" in answer["error"]["message"]
    assert snapshot(served) == before


def test_oversized_bodies_are_refused_before_they_are_read(served: Served) -> None:
    before = snapshot(served)
    status, headers, payload = request(served, head_of("POST", "/v1/apply_run", length=MAX_BODY_BYTES + 1))
    assert_refused(status, json.loads(payload), 413)
    big = b'{"args": {"name": "r", "spec": "' + b"x" * (2 << 20) + b'"'  # 2 MiB, cut short: not JSON
    assert_refused(*post(served, "apply_run", big), 400)
    status, headers, payload = request(served, head_of("POST", "/v1/list_runs", length=-5))
    assert_refused(status, json.loads(payload), 400)
    assert snapshot(served) == before


# -- verbs, paths, tokens -----------------------------------------------------------------------------------
PATH = st.one_of(
    st.sampled_from([f"/v1/{m}" for m in METHODS] + ["/v1/", "/v1/close", "/v2/get_run", "/healthz/x"]),
    st.text(string.ascii_letters + string.digits + "/._-%?=&~", max_size=30).map(lambda t: "/" + t),
)
VERB = st.sampled_from(
    ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "BREW", "post"]
) | st.just("POST")


@FUZZ
@given(verb=VERB, path=PATH, token=st.none() | st.just(TOKEN) | st.text(max_size=40))
def test_wrong_verbs_paths_and_tokens_get_a_json_4xx(
    served: Served, verb: str, path: str, token: str | None
) -> None:
    before = snapshot(served)
    body = args_body({"name": "zz-new", "spec": {"model": {"name": "m"}}})
    status, headers, payload = request(served, head_of(verb, path, body, token), body)
    method = path.removeprefix("/v1/") if path.startswith("/v1/") else None
    if verb == "POST" and method in wire.methods() and token == TOKEN:
        assert status < 500, (status, payload)  # a well-formed call: answered, whatever it says
    elif path.split("?")[0] != "/healthz":
        assert headers.get("content-type") == "application/json", (status, payload[:200])
        assert_refused(status, json.loads(payload))
        assert snapshot(served) == before, "a refused request changed the store"


def test_garbage_on_the_wire_gets_a_json_400(served: Served) -> None:
    for head in (
        b"\x00\x01\x02 garbage\r\n\r\n",
        b"POST /v1/list_runs HTTP/9.9\r\n\r\n",
        b"GET\r\n\r\n",
        b"POST /v1/list_runs HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",
    ):
        status, headers, payload = request(served, head)
        assert status == 0 or 400 <= status < 500, (head[:40], status, payload)  # 0: an HTTP/0.9 answer
        assert headers.get("content-type") == "application/json" and json.loads(payload)["error"]["message"]


# -- argument types -----------------------------------------------------------------------------------------
def wrong_value(annotation: Any) -> st.SearchStrategy[Any]:
    """JSON no annotation of that kind accepts: a list where an object goes, else an
    object or list of objects."""
    text = str(annotation)
    if text.startswith("dict"):
        return st.lists(st.integers(), min_size=1, max_size=3) | st.text(min_size=1, max_size=5)
    if text.startswith("list"):
        return st.dictionaries(st.sampled_from("xyz"), st.integers(), min_size=1, max_size=2) | st.integers()
    return st.dictionaries(st.sampled_from(["zz", "qq"]), st.integers(), min_size=1, max_size=2) | st.lists(
        st.dictionaries(st.sampled_from(["zz"]), st.integers(), min_size=1), min_size=1, max_size=2
    )


def good_value(annotation: Any) -> Any:
    """A value of the right type, so each call fails on the one argument being fuzzed."""
    text = str(annotation)
    for prefix, value in (
        ("dict", {}),
        ("list", []),
        ("str", "r"),
        ("int", 1),
        ("float", 1.0),
        ("bool", True),
    ):
        if text.startswith(prefix):
            return value
    return None


@st.composite
def wrong_call(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    method = wire.methods()[
        draw(st.sampled_from([m for m in METHODS if wire.methods()[m].signature.parameters]))
    ]
    params = method.signature.parameters
    args = {name: good_value(method.hints[name]) for name, p in params.items() if p.default is p.empty}
    wrong = draw(st.sampled_from(sorted(params)))
    args[wrong] = draw(wrong_value(method.hints[wrong]))
    return method.name, args


@FUZZ
@given(call=wrong_call())
def test_arguments_of_the_wrong_type_are_refused_for_every_method(
    served: Served, call: tuple[str, dict]
) -> None:
    before = snapshot(served)
    method, args = call
    status, answer = post(served, method, args_body(args))
    assert_refused(status, answer, 400, 422)
    assert snapshot(served) == before


@FUZZ
@given(
    method=st.sampled_from(sorted(wire.READS)), args=st.dictionaries(st.text(max_size=12), JSON, max_size=4)
)
def test_reads_with_any_arguments_never_fail_the_server(served: Served, method: str, args: dict) -> None:
    before = snapshot(served)
    status, answer = post(served, method, args_body(args))
    assert status < 500, (method, args, answer)
    assert snapshot(served) == before


# -- slow clients -------------------------------------------------------------------------------------------
def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing the connection; fails if it is still open after `seconds`."""
    sock.settimeout(seconds)
    try:
        return _read_all(sock)
    except TimeoutError:
        pytest.fail(f"the server kept a stalled connection open for over {seconds} s")


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connects, says nothing
        b"POST /v1/list_runs HTTP/1.1\r\nHost: store\r\n",  # headers, never finished
        head_of("POST", "/v1/list_runs", length=100) + b'{"args": ',  # a body that stops short
    ],
)
def test_a_stalled_client_is_dropped_and_others_are_served_meanwhile(served: Served, sent: bytes) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as stalled:
        stalled.sendall(sent)
        assert post(served, "get_run", args_body({"name": "r"}))[0] == 200, "one stalled client blocks no one"
        answer = _closed_within(stalled, READ_TIMEOUT + 5)
    assert time.monotonic() - started < READ_TIMEOUT + 5
    # waitress reads a request in full before the app sees it, so a body that stops short never reaches
    # the store: the connection is closed unanswered (a server that answers must answer a JSON 408).
    if answer:
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.split()[1] == b"408" and json.loads(rest.partition(b"\r\n\r\n")[2])["error"]


def test_the_store_still_answers_after_the_fuzzing(served: Served) -> None:
    status, answer = post(served, "get_run", args_body({"name": "r"}))
    assert status == 200 and answer["result"]["name"] == "r"
