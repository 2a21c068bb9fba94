"""Fixtures shared by the data-plane tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def sqlite_store(mortal_home: Path, monkeypatch: pytest.MonkeyPatch):
    """SQLite only, wandb off: these tests are about the workers; the store contract runs
    on both databases."""
    from mortal.state import open_store

    monkeypatch.setenv("WANDB_MODE", "disabled")
    opened = open_store(f"sqlite:///{mortal_home / 'state.db'}")
    yield opened
    opened.close()
