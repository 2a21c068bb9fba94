"""The store checks every name it records, whoever the client: a run name, a role, label and annotation keys
become folders, process names and URL segments, so the spec's rules (mortal.specs.metadata) hold in the store
itself, on SQLite, PostgreSQL and over HTTP (the `store` fixture runs each), and the HTTP server answers a
refused name with a 422 that names it, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from mortal.state import InvalidName, InvalidValue, NotFound, Store, StoreError
from mortal.state.http_server import Served, serve

SPEC = {"model": {"name": "tiny"}}
BAD_RUN_NAMES = [
    "../../victim",
    "",
    "a\x00b",
    "x" * 1_000_000,
    "Upper",
    "a/b",
    "..",
    "-lead",
    "a_b",
    "x" * 64,
]
TOKEN = "store-names-t0ken"


@pytest.mark.parametrize("name", BAD_RUN_NAMES, ids=lambda n: repr(n[:12]) + f"-{len(n)}")
def test_a_run_name_that_is_not_a_dns1123_label_is_refused_and_nothing_is_stored(
    store: Store, name: str
) -> None:
    with pytest.raises(InvalidName, match="trainingrun name must be a DNS-1123 label") as refused:
        store.apply_run(name, SPEC)
    assert len(str(refused.value)) < 1000, "a megabyte name is not echoed whole"
    with pytest.raises(InvalidName):
        store.fork_run(name, SPEC, {}, {}, "parent", 1, "/anywhere", 1)
    assert store.list_runs() == []


def test_the_refusal_is_a_value_error_of_the_store(store: Store) -> None:
    with pytest.raises(InvalidName) as refused:
        store.apply_run("../x", SPEC)
    assert isinstance(refused.value, StoreError) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize(
    ("labels", "annotations", "message"),
    [
        ({"../k": "v"}, {}, "label key '../k'"),
        ({"team": "a b"}, {}, "label value 'a b'"),
        ({"team": "x" * 64}, {}, "label value"),
        ({"Bad_Prefix/k": "v"}, {}, "prefix before '/'"),
        ({}, {"a/b/c": "free text"}, "annotation key 'a/b/c'"),
        ({}, {"": "x"}, "annotation key ''"),
    ],
)
def test_label_and_annotation_keys_and_label_values_follow_kubernetes_rules(
    store: Store, labels, annotations, message
) -> None:
    with pytest.raises(InvalidName, match=message):
        store.apply_run("r", SPEC, labels, annotations)
    assert store.list_runs() == []
    row, _ = store.apply_run(
        "r", SPEC, {"team": "rl", "mortal.dev/tier": ""}, {"mortal.dev/source-dir": "/any/thing"}
    )
    assert row.annotations == {"mortal.dev/source-dir": "/any/thing"}, "annotation values are free text"


@pytest.mark.parametrize("role", ["../actor", "", "Actor", "a\x00"])
def test_a_worker_role_is_a_dns1123_label(store: Store, role: str) -> None:
    store.apply_run("r", SPEC)
    with pytest.raises(InvalidName, match="worker role"):
        store.create_worker("r", role, 0, "local", 10)
    assert store.list_workers("r") == []


def test_a_read_of_a_name_no_run_can_have_is_not_found_or_a_refused_value(store: Store) -> None:
    """A NUL cannot be stored (PostgreSQL refuses it in text): a read of it is bad input, not a failure."""
    with pytest.raises((NotFound, InvalidValue)):
        store.get_run("a\x00b")
    with pytest.raises(NotFound):
        store.get_run("../../victim")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with serve(f"sqlite:///{tmp_path / 'state.db'}", TOKEN) as server:
        yield server


@pytest.mark.parametrize("name", BAD_RUN_NAMES, ids=lambda n: repr(n[:12]) + f"-{len(n)}")
def test_over_http_a_refused_name_is_a_422_that_names_the_rule(served: Served, name: str) -> None:
    answer = requests.post(
        f"{served.url}/v1/apply_run",
        json={"args": {"name": name, "spec": SPEC}},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["type"] == "InvalidName"
    assert "must be a DNS-1123 label" in answer.json()["error"]["message"]
    listed = requests.post(
        f"{served.url}/v1/list_runs",
        json={"args": {}},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert listed.json()["result"] == []
