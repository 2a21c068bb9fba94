"""A store as logs and errors print it (its repr): the URL it was opened on, with any password in it masked,
alike for every kind of store (mortal.state.paths.shown_url)."""

from __future__ import annotations

from mortal.state.http_store import HttpStore
from mortal.state.sql_store import SqlStore


def test_a_database_stores_repr_masks_the_password_of_its_url() -> None:
    store = SqlStore("postgresql://trainer:hunter2@127.0.0.1:1/runs")  # connects on first use only
    try:
        assert repr(store) == "SqlStore('postgresql://trainer:***@127.0.0.1:1/runs')"
    finally:
        store.close()


def test_an_http_stores_repr_masks_the_password_of_its_url() -> None:
    assert repr(HttpStore("https://ops:hunter2@store.example:8443/")) == (
        "HttpStore('https://ops:***@store.example:8443')"
    )


def test_a_url_without_password_is_shown_as_given() -> None:
    store = SqlStore("sqlite:///relative/state.db")
    try:
        assert repr(store) == "SqlStore('sqlite:///relative/state.db')"
    finally:
        store.close()
