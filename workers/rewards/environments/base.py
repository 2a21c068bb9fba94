"""What the built-in environments share: per-completion rows, the reward cache, spec round-trips.

Who calls it: the environments of this package subclass `BuiltinEnvironment`; RewardSet calls
them TRL-style through RewardEnvironment.__call__ -> score_batch. A subclass implements
`score_items(items, log)` for the items the cache does not answer, returning an `Outcome` per item
(its score, and whether that score may be cached). Constructor parameters are stored under their
own names (MortalTrainer rebuilds an instance from them) and `SPEC_ARGS` lists the ones a spec
may set under `args:`.
What it must not do: hold per-call state on the instance (one instance scores every task of a worker).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mortal.workers.rewards.environment import RewardEnvironment
from mortal.workers.rewards.environments.cache import RewardCache

# TRL's plumbing, passed to every reward function: not part of what a score depends on.
PLUMBING = ("trainer_state", "log_metric", "log_extra", "completion_ids")
CACHE_MODES = ("off", "memory", "sqlite")


@dataclass(frozen=True)
class Item:
    """One completion to score: its prompt text, its text, and its dataset row's columns."""

    prompt: str
    completion: str
    row: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    score: float | None
    cacheable: bool = True


Log = Callable[[str, float], None]


def _no_log(name: str, value: float) -> None:
    """Where metrics go when the caller passed no TRL log_metric (a direct call)."""


class BuiltinEnvironment(RewardEnvironment):
    """A RewardEnvironment with a cache: `cache` is off | memory | sqlite (a file at `cache_path`)."""

    ENV: ClassVar[str | None] = None  # the spec's `env:` name
    SPEC_ARGS: ClassVar[tuple[str, ...]] = ("cache", "cache_size", "cache_path")
    DEFAULT_CACHE: ClassVar[str] = "memory"

    def __init__(
        self, cache: str | None = None, cache_size: int = 4096, cache_path: str | None = None
    ) -> None:
        self.cache = cache
        self.cache_size = cache_size
        self.cache_path = cache_path
        mode = cache or self.DEFAULT_CACHE
        if mode not in CACHE_MODES:
            raise ValueError(f"cache must be one of {', '.join(CACHE_MODES)} (got {cache!r})")
        if mode == "sqlite" and not cache_path:
            raise ValueError(
                "cache 'sqlite' needs cache_path (in a run it is the run's rewards.cache.sqlite)"
            )
        self._cache = (
            None if mode == "off" else RewardCache(cache_size, cache_path if mode == "sqlite" else None)
        )

    # -- what a subclass provides ------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """Everything that changes a score (the cache key's environment part); subclasses extend it."""
        return {"environment": type(self).__qualname__}

    def score_items(self, items: list[Item], log: Log) -> list[Outcome]:
        raise NotImplementedError

    # -- TRL-facing --------------------------------------------------------------------------------
    def score(self, completion: str, prompt: str, **kwargs: Any) -> float | None:
        return self.score_batch(
            [completion], [prompt], **{k: [v] for k, v in kwargs.items() if k not in PLUMBING}
        )[0]

    def score_batch(self, completions: list[str], prompts: list[str], **kwargs: Any) -> list[float | None]:
        log: Log = kwargs.get("log_metric") or _no_log
        n = len(completions)
        columns = {
            k: v for k, v in kwargs.items() if k not in PLUMBING and isinstance(v, list) and len(v) == n
        }
        items = [
            Item(p, c, {k: v[i] for k, v in columns.items()})
            for i, (c, p) in enumerate(zip(completions, prompts, strict=True))
        ]
        if self._cache is None:
            return [o.score for o in self.score_items(items, log)]
        identity = self.settings()
        keys = [RewardCache.key(identity, it.prompt, it.completion, it.row) for it in items]
        scores: list[float | None] = [None] * n
        todo: list[int] = []
        for i, key in enumerate(keys):
            found, value = self._cache.get(key)
            if found:
                scores[i] = value
            else:
                todo.append(i)
        first = {keys[i]: i for i in reversed(todo)}  # a group often repeats a completion: score it once
        if first:
            unique = sorted(first.values())
            outcomes = dict(zip(unique, self.score_items([items[i] for i in unique], log), strict=True))
            for i in unique:
                if outcomes[i].cacheable:
                    self._cache.put(
                        keys[i], outcomes[i].score, identity, items[i].prompt, items[i].completion
                    )
            for i in todo:
                scores[i] = outcomes[first[keys[i]]].score
        log(f"{self.name}/cache_hits", float(n - len(todo)))
        return scores

    # -- spec round-trip (MortalTrainer) -----------------------------------------------------------
    def spec_args(self) -> dict[str, Any]:
        """The SPEC_ARGS this instance was built with, defaults left out."""
        params = inspect.signature(type(self).__init__).parameters
        return {
            name: getattr(self, name)
            for name in self.SPEC_ARGS
            if name in params and getattr(self, name) != params[name].default
        }

    def spec_entry(self) -> dict[str, Any] | None:
        """This instance as a spec.rewards entry (`env:` + args); None for a subclass (use `function:`)."""
        if "ENV" not in type(self).__dict__ or type(self).ENV is None:
            return None
        entry: dict[str, Any] = {"env": type(self).ENV}
        args = self.spec_args()
        if args:
            entry["args"] = args
        return entry

    @property
    def cache_stats(self) -> dict[str, int]:
        if self._cache is None:
            return {"hits": 0, "misses": 0, "entries": 0}
        return {"hits": self._cache.hits, "misses": self._cache.misses, "entries": len(self._cache)}


def column(item: Item, name: str, env: str) -> Any:
    """The row's column `name`, or a ValueError that names the argument to fix."""
    if name not in item.row:
        have = ", ".join(sorted(item.row)) or "none"
        raise ValueError(
            f"{env}: the dataset row has no column {name!r} (columns: {have}); set the environment's "
            f"column argument to the right one"
        )
    return item.row[name]


def sqlite_cache_path(run_dir: Path) -> str:
    return str(run_dir / "rewards.cache.sqlite")
