"""The sampled completions in SQL: the completions half of SqlStore (a mixin; it needs `_tx`).

Written by the actor once per optimizer step (a bounded sample, spec.logging.completionsPerStep),
read by `mortalctl get completions`. A step written again (a resumed actor trains it again) replaces
the step's rows in the same transaction, so a reader sees the old samples or the new, never a mix.
Ordering by reward puts unscored samples (NULL) last on both engines (`reward IS NULL` sorts false
first), rather than relying on each engine's NULL order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import delete
from sqlmodel import Session, col, select

from mortal.state.fencing import check_worker
from mortal.state.store import CompletionOrder, NewCompletion, WorkerRef
from mortal.state.tables import CompletionRow


def _order(order: CompletionOrder) -> tuple[Any, ...]:
    """ORDER BY terms of `order`; ties keep the order they were sampled in."""
    sampled = (CompletionRow.step, CompletionRow.sample)
    if order == CompletionOrder.sample:
        return sampled
    by_reward = (
        col(CompletionRow.reward).asc()
        if order == CompletionOrder.worst
        else col(CompletionRow.reward).desc()
    )
    return (col(CompletionRow.reward).is_(None), by_reward, *sampled)


class CompletionLog:
    """Completion methods of SqlStore."""

    _tx: Callable[..., AbstractContextManager[Session]]  # SqlStore's, of which this is a part

    def add_completions(self, worker: WorkerRef, step: int, completions: list[NewCompletion]) -> None:
        with self._tx() as s:
            check_worker(s, worker)
            s.execute(
                delete(CompletionRow).where(
                    col(CompletionRow.run) == worker.run, col(CompletionRow.step) == step
                )
            )
            s.add_all(CompletionRow(run=worker.run, step=step, **vars(c)) for c in completions)

    def list_completions(
        self,
        run: str,
        step: int | None = None,
        order: CompletionOrder = CompletionOrder.sample,
        limit: int | None = None,
    ) -> list[CompletionRow]:
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        query = (
            select(CompletionRow).where(CompletionRow.run == run).order_by(*_order(CompletionOrder(order)))
        )
        if step is not None:
            query = query.where(CompletionRow.step == step)
        if limit is not None:
            query = query.limit(limit)
        with self._tx(write=False) as s:
            return list(s.exec(query).all())

    def completion_steps(self, run: str) -> list[int]:
        query = (
            select(CompletionRow.step)
            .where(CompletionRow.run == run)
            .distinct()
            .order_by(col(CompletionRow.step))
        )
        with self._tx(write=False) as s:
            return list(s.exec(query).all())
