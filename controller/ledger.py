"""A run's ledger: what became of the prompts it drew, for `mortalctl describe`'s Ledger section.

Derived from the store on every call, never kept: the task queue's counts (`Store.task_tally`, which also
counts the actor's StaleRolloutsDropped events) and the spec's prompts per step. Counts what the queue
holds now: a resumed actor queues the steps after its checkpoint again, and those count once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mortal.specs import TrainingSpec
from mortal.state.store import Store
from mortal.state.tables import RunRow


@dataclass(frozen=True)
class Ledger:
    """Prompts drawn (steps queued x prompts per step), tasks done of those queued, tasks leased again after
    their worker died or their lease ran out (redone), and steps whose rollouts were dropped as stale."""

    steps: int
    prompts_drawn: int
    tasks: int
    tasks_done: int
    redone: int
    stale_drops: int

    def lines(self) -> list[tuple[str, str]]:
        return [
            ("Prompts drawn", f"{self.prompts_drawn} ({self.steps} steps queued)"),
            ("Tasks done", f"{self.tasks_done} of {self.tasks}"),
            ("Redone", f"{self.redone} (tasks leased again after their worker died or their lease ran out)"),
            (
                "Dropped as stale",
                f"{self.stale_drops} (steps whose rollouts came from weights older than asked)",
            ),
        ]


def run_ledger(store: Store, run: RunRow) -> Ledger:
    """The ledger of `run` as the store holds it now."""
    tally = store.task_tally(run.name)
    per_step = TrainingSpec.model_validate(run.spec).algorithm.prompts_per_step
    return Ledger(
        steps=tally.steps,
        prompts_drawn=tally.steps * per_step,
        tasks=tally.tasks,
        tasks_done=tally.done,
        redone=tally.releases,
        stale_drops=tally.stale_drops,
    )
