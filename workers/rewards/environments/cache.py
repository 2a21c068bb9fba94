"""The reward cache: the same (environment config, prompt, completion, row) is scored once.

Who calls it: BuiltinEnvironment.score_batch (mortal.workers.rewards.environments.base). GRPO samples
the same prompt many times and small models often repeat themselves, and a judge call costs money
and seconds, so a score is looked up before it is computed. In memory it is an LRU of
`max_entries`; with a path it is also kept in a SQLite file (`rewards.cache.sqlite` in the run's
folder, the seed's name) shared by the run's rollout replicas and kept for analysis: every row
holds the environment, prompt, completion and score.
This file is not the run's state: the store (mortal.state) is the only SQL code for state and the
controller never reads this file; deleting it loses nothing but time. Hence plain sqlite3 here.
What it must not do: cache a score that may change on retry (the environment says which: a timeout
or a failed API call is not cached).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS reward_cache (
    key TEXT PRIMARY KEY,          -- sha256 of (environment config, prompt, completion, row)
    environment TEXT NOT NULL,     -- the environment's config as JSON
    prompt TEXT NOT NULL,
    completion TEXT NOT NULL,
    score REAL,                    -- NULL: the environment answered None (not applicable)
    created_at REAL NOT NULL
)
"""


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


class RewardCache:
    """An LRU of scores, optionally backed by a SQLite file. Thread-safe."""

    def __init__(self, max_entries: int = 4096, path: str | Path | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"cache_size must be >= 1 (got {max_entries})")
        self.max_entries = max_entries
        self.path = Path(path) if path is not None else None
        self.hits = 0
        self.misses = 0
        self._memory: OrderedDict[str, float | None] = OrderedDict()
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @staticmethod
    def key(identity: dict[str, Any], prompt: str, completion: str, row: dict[str, Any]) -> str:
        return hashlib.sha256(_canonical([identity, prompt, completion, row]).encode()).hexdigest()

    def _connection(self) -> sqlite3.Connection | None:
        if self.path is None:
            return None
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            # a cache: losing the last scores on power loss costs only time
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(SCHEMA)
            self._db = db
        return self._db

    def get(self, key: str) -> tuple[bool, float | None]:
        """(found, score): found is False on a miss (a cached None is a hit)."""
        with self._lock:
            if key in self._memory:
                self._memory.move_to_end(key)
                self.hits += 1
                return True, self._memory[key]
            db = self._connection()
            row = (
                db.execute("SELECT score FROM reward_cache WHERE key = ?", (key,)).fetchone() if db else None
            )
            if row is None:
                self.misses += 1
                return False, None
            self.hits += 1
            self._remember(key, row[0])
            return True, row[0]

    def put(
        self, key: str, score: float | None, identity: dict[str, Any], prompt: str, completion: str
    ) -> None:
        with self._lock:
            self._remember(key, score)
            db = self._connection()
            if db is not None:
                db.execute(
                    "INSERT OR REPLACE INTO reward_cache VALUES (?, ?, ?, ?, ?, ?)",
                    (key, _canonical(identity), prompt, completion, score, time.time()),
                )

    def _remember(self, key: str, score: float | None) -> None:
        self._memory[key] = score
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)

    def __len__(self) -> int:
        return len(self._memory)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
