"""What the server's run-uid check costs a worker's call that names its run only (mortal.state.auth).

    python bench/store_uid_check.py [--store sqlite --store postgres] [--rounds 2000]

A worker token with a run uid has each call that names its run by name (latest_weights, step_states,
get_run, ...) checked against the run's current uid: one indexed read of runs.uid (Store.run_uid), none for
get_run, whose row carries it. This serves latest_weights and get_run in process through the server's WSGI
app (StoreApp.handle: the token, the arguments, the store, the answer; no socket), with a token that carries
the run's uid and with one that does not (minted before tokens carried one: no check), interleaved, and
prints the medians in ms and their difference. A fresh SQLite file or PostgreSQL database; nothing leaves
127.0.0.1.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import tempfile
import time
from typing import Any

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def environ(method: str, token: str, args: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps({"args": args}).encode()
    return {
        "PATH_INFO": f"/v1/{method}",
        "REQUEST_METHOD": "POST",
        "HTTP_AUTHORIZATION": f"Bearer {token}",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
    }


def measure(url: str, rounds: int) -> dict[str, dict[str, float]]:
    from mortal.state import WorkerRef, open_store
    from mortal.state.auth import mint_worker_token
    from mortal.state.http_server import StoreApp

    admin = "bench-admin"
    store = open_store(url)
    app = StoreApp(store, admin)
    run = f"uid-{random.randrange(10**9)}"
    row, _ = store.apply_run(run, {"model": {"name": "tiny"}, "rollout": {"replicas": 1}})
    ref = WorkerRef(run, "actor", 0, store.create_worker(run, "actor", 0, "local", 60).incarnation)
    store.publish_weights(ref, 1, 1, "/w/1")
    tokens = {"with uid": mint_worker_token(admin, ref, row.uid), "without": mint_worker_token(admin, ref)}
    calls = {"latest_weights": {"run": run}, "get_run": {"name": run}}
    times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in tokens} for c in calls}
    for _ in range(rounds):
        for call, args in calls.items():
            for kind, token in tokens.items():
                env = environ(call, token, args)
                started = time.perf_counter()
                status, _ = app.handle(env)
                times[call][kind].append(time.perf_counter() - started)
                assert status == 200, status
    app.close()
    return {c: {k: statistics.median(v) * 1e3 for k, v in by.items()} for c, by in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", action="append", choices=["sqlite", "postgres"])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    for store in args.store or ["sqlite"]:
        url = PG_URL if store == "postgres" else f"sqlite:///{tempfile.mkdtemp()}/state.db"
        for call, medians in measure(url, args.rounds).items():
            extra = medians["with uid"] - medians["without"]
            print(
                f"{store:8s} {call:14s}: token with a run uid {medians['with uid']:.3f} ms, "
                f"without {medians['without']:.3f} ms (check: {extra:+.3f} ms); medians of {args.rounds}"
            )


if __name__ == "__main__":
    main()
