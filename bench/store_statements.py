"""Statements per store call: what each call of a worker's round sends to the database, on each store.

    python bench/store_statements.py [--store sqlite --store postgres] [--rounds 200] [--done 2000]

A fresh database per store (bench/scratch_database.py), one run, an actor's queue of tasks of which
--done are already done (a run some steps old: a lease must not get slower as they pile up), and one
rollout worker going through the round bench/store_load.py's clients make (`worker_round`: heartbeat,
lease_task, renew_task, complete_task, add_metrics, get_run, latest_weights). Counted with SQLAlchemy's
before_cursor_execute event: the statements the store itself sends (SQLite's BEGIN IMMEDIATE is one);
and on PostgreSQL the round trips to the database server: those statements, psycopg's BEGIN, the COMMIT
and a pool pre-ping where the store has one. Single-threaded, in process, no HTTP: per call the median
milliseconds too, which are for comparing calls, not for claims (the load bench measures latency under
load), and the mean CPU time this process spent in it (time.process_time:
the store's Python, SQLAlchemy and the driver; not the database server's), which says how many calls a
second one Python process can serve at most.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scratch_database import fresh_database  # noqa: E402
from store_load import RUN, seed_run, worker_round  # noqa: E402

from mortal.state import WorkerRef, open_store  # noqa: E402


def measure(kind: str, rounds: int, done: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp, fresh_database(kind, Path(tmp)) as url:
        store = open_store(url)
        engine = store._engine
        sent, trips = {"n": 0}, {"n": 0}

        def count(counter: dict[str, int]) -> Any:
            return lambda *args, **kwargs: counter.__setitem__("n", counter["n"] + 1)

        event.listen(engine, "before_cursor_execute", count(sent))
        if engine.dialect.name == "postgresql":
            for name in ("before_cursor_execute", "begin", "commit", "rollback"):
                event.listen(engine, name, count(trips))
            ping = engine.dialect.do_ping
            engine.dialect.do_ping = lambda connection: (count(trips)(), ping(connection))[1]
        [(_, role, replica, incarnation)] = seed_run(store, clients=1, tasks=done + rounds + 8)
        ref = WorkerRef(RUN, role, replica, incarnation)
        for _ in range(done):
            task = store.lease_task(ref, 30.0)
            store.complete_task(ref, task.id, task.lease_token, {"reward": 1.0})
        calls: dict[str, list[tuple[float, float, int, int]]] = {}

        def timed(name: str, fn: Any, *args: Any) -> Any:
            before, trips_before = sent["n"], trips["n"]
            started, cpu = time.perf_counter(), time.process_time()
            out = fn(*args)
            calls.setdefault(name, []).append(
                (
                    time.perf_counter() - started,
                    time.process_time() - cpu,
                    sent["n"] - before,
                    trips["n"] - trips_before,
                )
            )
            return out

        for step in range(rounds):
            worker_round(store, ref, step, timed)
        store.close()
    return {
        name: {
            "statements": max(n for _, _, n, _ in values),
            "round_trips": max(t for _, _, _, t in values),
            "median_ms": round(statistics.median(s for s, _, _, _ in values) * 1000, 2),
            "cpu_ms": round(sum(c for _, c, _, _ in values) / len(values) * 1000, 2),
        }
        for name, values in calls.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", action="append", choices=["sqlite", "postgres"])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--done", type=int, default=2000, help="tasks already done before the rounds")
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for kind in args.store or ["sqlite", "postgres"]:
        rows = measure(kind, args.rounds, args.done)
        for name, row in rows.items():
            trips = f"round trips {row['round_trips']}  " if kind == "postgres" else ""
            print(
                f"{kind:9s} {name:15s} statements {row['statements']}  {trips}"
                f"median {row['median_ms']:6.2f} ms  this process's CPU {row['cpu_ms']:5.2f} ms"
            )
        cpu = sum(r["cpu_ms"] for r in rows.values())
        print(f"{kind:9s} {'a round':15s} this process's CPU {cpu:5.2f} ms, {cpu / len(rows):4.2f} ms a call")
        results[kind] = rows
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        figures = {"command": " ".join(sys.argv), "results": results}
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
