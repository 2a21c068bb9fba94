"""Controller scale benchmark: reconcile latency with 100 / 300 / 1,000 runs in one store, one controller.

    python bench/controller_scale.py --store sqlite --store postgres --runs 100,300,1000 --steady 20

What it measures, per store and number of runs N (every run: an actor and one rollout, so 2N workers):
  cold     seconds from starting the controller until all N new runs are Running (N launches each).
  steady   the controller running for --steady seconds with every run active (each asks to be looked
           at again every second): per-pass reconcile latency p50/p99/max, passes per second, and how
           often each run actually got reconciled (the failure-detection interval it can sustain).
  sweep    the same passes one after another with no other thread running: latency without contention.
  react    for --react runs: `scale rollout=2` (spec CAS + wake) until the run's status shows it: p50/p99.
Workers are not processes here (2,000 of them would measure the machine, not the controller): an
in-memory backend launches and lists them, and one bulk UPDATE a second stands in for every worker's
heartbeat (the one place this script writes SQL itself). Each run carries the history a reconcile
reads (10 steps of metrics, a checkpoint, a weight version). The local backend's process scan, which
this replaces, costs what `--scan` prints (it is shared by all runs' passes, see controller/listing.py).
Results go to stdout as a table and to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from scratch_database import fresh_database
from sqlalchemy import create_engine, update

from mortal.controller import wake
from mortal.controller.backends.base import Backend, BackendWorker, WorkerLaunch
from mortal.controller.leader import LeaderElector
from mortal.controller.manager import Controller
from mortal.controller.reconciler import ControllerConfig, Reconciler
from mortal.state import WorkerRef, open_store
from mortal.state.engine import sqlalchemy_url
from mortal.state.tables import WorkerRow, utcnow
from mortal.workers.simulated import simulated_run


class InMemoryBackend(Backend):
    """Launch/list/stop with no process: every launched worker is alive until stopped."""

    name = "local"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, BackendWorker] = {}

    def launch(self, launch: WorkerLaunch) -> str:
        handle = f"mem:{launch.worker_id}"
        with self._lock:
            self._workers[handle] = BackendWorker(
                launch.worker_id,
                handle,
                launch.run,
                launch.role,
                launch.replica,
                launch.incarnation,
                alive=True,
            )
        return handle

    def list(self, run: str | None = None) -> list[BackendWorker]:
        with self._lock:
            return [w for w in self._workers.values() if run is None or w.run == run]

    def stop(self, handle: str, grace_seconds: float = 5.0) -> None:
        with self._lock:
            self._workers.pop(handle, None)


class HeartbeatPump:
    """Every live worker row beats once a second (one UPDATE), actors report step 10."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(sqlalchemy_url(url))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        live = WorkerRow.state.in_(["Pending", "Running"])
        while not self.stop.wait(1.0):
            with self.engine.begin() as conn:
                conn.execute(
                    update(WorkerRow)
                    .where(live, WorkerRow.handle.is_not(None))
                    .values(heartbeat_at=utcnow(), state="Running")
                )
                conn.execute(update(WorkerRow).where(live, WorkerRow.role == "actor").values(step=10))

    def __enter__(self) -> HeartbeatPump:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.engine.dispose()


def stats(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in seconds)
    if not ms:
        return {"n": 0}
    pick = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {
        "n": len(ms),
        "p50_ms": round(pick(0.50), 2),
        "p99_ms": round(pick(0.99), 2),
        "max_ms": round(ms[-1], 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


def wait_until(check, timeout: float, what: str, interval: float = 0.25) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what} after {timeout:.0f}s")
        time.sleep(interval)
    return time.monotonic() - started


def seed_history(store, names: list[str]) -> None:
    """What a run has after 10 steps: metrics, a checkpoint, a weight version (written as its actor)."""
    for name in names:
        actor = next(w for w in store.list_workers(name, live_only=True) if w.role == "actor")
        ref = WorkerRef(name, "actor", 0, actor.incarnation)
        for step in range(1, 11):
            store.add_metrics(ref, step, {"reward": step / 20, "reward_std": 0.1, "loss": 0.5, "kl": 0.01})
        store.publish_weights(ref, 10, 10, f"/bench/{name}/weights/v10")
        store.record_checkpoint(ref, 10, f"/bench/{name}/checkpoints/step-10", 10)


def bench_one(kind: str, n: int, steady: float, react: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, fresh_database(kind, Path(tmp)) as url:
        os.environ["MORTAL_HOME"] = tmp
        store = open_store(url)
        names = [f"run-{i:05d}" for i in range(n)]
        for name in names:
            run = simulated_run(name, max_steps=1_000_000, rollout_replicas=1)
            store.apply_run(
                name, run.spec_dict(), labels=run.metadata.labels, annotations=run.metadata.annotations
            )
        backend = InMemoryBackend()
        config = ControllerConfig(threads=threads)
        result: dict[str, Any] = {"store": kind, "runs": n, "threads": threads}
        with HeartbeatPump(url):
            controller = Controller(store, url, config, backends=lambda _: backend).start()
            running = lambda: all(r.phase == "Running" for r in store.list_runs())  # noqa: E731
            result["cold_s"] = round(wait_until(running, 600, "all runs Running"), 2)
            seed_history(store, names)
            time.sleep(2)
            durations = controller.reconciler.durations
            durations.clear()
            time.sleep(steady)
            window = list(durations)
            result["steady"] = stats(window)
            result["steady"]["passes_per_s"] = round(len(window) / steady, 1)
            result["steady"]["seconds_between_passes_per_run"] = round(n * steady / max(1, len(window)), 2)
            result["react"] = stats(react_latencies(store, random.Random(0).sample(names, min(react, n))))
            controller.stop()
            result["sweep"] = stats(sweep(store, url, names, config, backend))
        store.close()
        return result


def react_latencies(store, names: list[str]) -> list[float]:
    """`mortalctl scale NAME rollout=2` as the CLI does it, until the status says desired 2."""
    out = []
    for name in names:
        row = store.get_run(name)
        spec = {**row.spec, "rollout": {**row.spec["rollout"], "replicas": 2}}
        started = time.perf_counter()
        store.update_spec(name, spec, row.resource_version)
        wake.notify(name)
        wait_until(
            lambda n=name: store.get_run(n).status["replicas"]["rollout"]["desired"] == 2,
            60,
            "scale",
            interval=0.005,
        )
        out.append(time.perf_counter() - started)
    return out


def sweep(store, url: str, names: list[str], config: ControllerConfig, backend: Backend) -> list[float]:
    """Every run reconciled once, one after another, by a lone reconciler (no thread contention)."""
    elector = LeaderElector(store, duration_seconds=60)
    wait_until(elector.try_acquire, 30, "the lease")
    reconciler = Reconciler(store, url, elector, config, backends=lambda _: backend)
    for name in names:
        reconciler.reconcile(name)
    return list(reconciler.durations)


def scan_cost() -> dict[str, float]:
    """What one local-backend listing (a process-table scan) costs on this machine."""
    import psutil

    from mortal.controller.backends.local import LocalBackend

    backend = LocalBackend()
    backend.list()
    started = time.perf_counter()
    for _ in range(20):
        backend.list()
    return {"processes": len(psutil.pids()), "scan_ms": round((time.perf_counter() - started) / 20 * 1000, 2)}


def machine() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
        "host": platform.node(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", action="append", choices=["sqlite", "postgres"])
    parser.add_argument("--runs", default="100,300,1000")
    parser.add_argument("--steady", type=float, default=20.0, help="seconds of steady state per case")
    parser.add_argument("--react", type=int, default=20, help="scale operations timed per case")
    parser.add_argument("--threads", type=int, default=ControllerConfig().threads)
    parser.add_argument("--out", type=Path, default=Path("bench/results/controller_scale.json"))
    args = parser.parse_args()
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "scan": scan_cost(),
        "cases": [],
    }
    print(f"machine: {report['machine']}\nlocal scan: {report['scan']}", flush=True)
    print(
        "| store | runs | cold s | steady p50 ms | p99 ms | max ms | passes/s | s between passes/run "
        "| sweep p50 ms | p99 ms | react p50 ms | p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for kind in args.store or ["sqlite"]:
        for n in (int(x) for x in args.runs.split(",")):
            r = bench_one(kind, n, args.steady, args.react, args.threads)
            report["cases"].append(r)
            s, w, q = r["steady"], r["sweep"], r["react"]
            print(
                f"| {kind} | {n} | {r['cold_s']} | {s['p50_ms']} | {s['p99_ms']} | {s['max_ms']} | "
                f"{s['passes_per_s']} | {s['seconds_between_passes_per_run']} | "
                f"{w['p50_ms']} | {w['p99_ms']} | "
                f"{q['p50_ms']} | {q['p99_ms']} |",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
