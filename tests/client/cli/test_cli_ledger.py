"""`mortalctl describe run` shows the ledger of the run's prompts, derived from the store: prompts drawn
(steps queued x prompts per step), tasks done, tasks redone (leased again after their worker died) and
steps whose rollouts the actor dropped as stale (mortal.controller.ledger)."""

from __future__ import annotations

from clihelpers import QUICKSTART, actor

from mortal.state import NewTask, WorkerRef, open_store
from mortal.state.store import STALE_ROLLOUTS


def ledger_section(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("Ledger:")
    return [line.strip() for line in lines[start + 1 : start + 5]]


def test_describe_shows_the_ledger_of_drawn_redone_and_stale_prompts(cli, store_url):
    assert cli("apply", "-f", str(QUICKSTART), "--no-controller").exit_code == 0
    store = open_store(store_url)
    try:
        trainer = actor(store, "quickstart")
        store.enqueue_tasks(
            trainer, [NewTask(step=s, slot=k, min_weight_version=0) for s in (1, 2) for k in (0, 1)]
        )
        dead_row = store.create_worker("quickstart", "rollout", 0, backend="local", lease_seconds=10)
        dead = WorkerRef("quickstart", "rollout", 0, dead_row.incarnation)
        store.lease_task(dead, 600)
        store.end_worker(dead_row.id, "Lost")  # its task goes back to the queue and is leased again
        live_row = store.create_worker("quickstart", "rollout", 1, backend="local", lease_seconds=10)
        live = WorkerRef("quickstart", "rollout", 1, live_row.incarnation)
        for _ in range(3):
            task = store.lease_task(live, 600)
            assert store.complete_task(live, task.id, task.lease_token, {})
        store.add_event(
            "quickstart", "Warning", STALE_ROLLOUTS, "step 2: 1 task(s) answered with older weights"
        )
    finally:
        store.close()
    out = cli("describe", "run", "quickstart")
    assert out.exit_code == 0, out.output
    assert ledger_section(out.stdout) == [
        "Prompts drawn:    8 (2 steps queued)",  # quickstart draws 4 prompts per step
        "Tasks done:       3 of 4",
        "Redone:           1 (tasks leased again after their worker died or their lease ran out)",
        "Dropped as stale: 1 (steps whose rollouts came from weights older than asked)",
    ]
