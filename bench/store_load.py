"""Store server load benchmark: N workers' worth of clients against the HTTP store on 127.0.0.1.

    python bench/store_load.py --store sqlite --store postgres --clients 16,64,256 --seconds 15

For each backing store and number of clients N: a fresh database, the store server started by this
script as its own process (`python -m mortal.state.http_server`, waitress, on 127.0.0.1 only), one run
with N rollout workers and an actor's queue of tasks, then N clients for --seconds, each one worker
going through a worker's round of calls, one call at a time:

    heartbeat, lease_task, renew_task and complete_task (when a task was leased), add_metrics,
    get_run, latest_weights

Clients are threads in --procs processes (one process of 256 threads measures its own GIL more than
the server). The processes are started, imported and waiting, their threads started, before the first
call (as real workers are running before theirs: the start of four Python processes on the bench's
cores is not timed), and their start's objects are left out of their garbage collections (see
`client_ready`). Each client's first call still opens its connection, and is timed.
Each client is paced at --rate calls per second (a real worker calls far less often:
a heartbeat every few seconds, a task per generation); a call that comes back late delays the next,
so an overloaded server shows as fewer calls per second, not as a queue inside the client. --rate 0:
as fast as each client can (the server's capacity, at the price of latency).
The clients do not retry (HttpStore(retry_attempts=1)): every refused, reset, timed-out or 5xx call
counts as failed. Reported per case: calls per second, p50/p99/max latency in ms (the p99 also
without each client's first call, which opens its connection), failures (by kind), per-call p99,
and where the cores went while the clients ran: CPU milliseconds per call of the store server's
processes, of PostgreSQL's (all of the machine's) and of the clients, and the machine's busy cores
(all of its processes, other work included). Table on stdout, JSON in --out. Nothing leaves
127.0.0.1; every case is bounded by --seconds (plus start-up), and each client by its own deadline.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import requests
from scratch_database import fresh_database

from mortal.state import WorkerRef
from mortal.state.http_store import HttpStore
from mortal.state.store import NewTask

RUN = "bench"
SPEC = {"model": {"name": "tiny"}}


# -- the server, as its own process --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def store_server(backing_url: str, token: str, threads: int, log: Path, processes: int = 1) -> Any:
    """`python -m mortal.state.http_server` on a free port of 127.0.0.1; its URL once /healthz answers.
    Its log goes to a file (a pipe nobody reads would fill and stall the server)."""
    port = _free_port()
    env = {**os.environ, "MORTAL_STATE_TOKEN": token}
    cmd = [
        sys.executable,
        "-m",
        "mortal.state.http_server",
        "--backing-url",
        backing_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--processes",
        str(processes),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("ab"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/healthz", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the store server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    """User + system CPU seconds each process has used so far, by pid (those gone are left out)."""
    used = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        used[process.pid] = times.user + times.system
    return used


def cpu_since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds used between two `cpu_seconds` (a process started in between counts from 0)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def server_processes(server: subprocess.Popen) -> list[psutil.Process]:
    """The store server's process and its sibling processes (--processes)."""
    parent = psutil.Process(server.pid)
    return [parent, *parent.children(recursive=True)]


def postgres_processes() -> list[psutil.Process]:
    """PostgreSQL's processes on this machine (its backends serve the store server's connections)."""
    names = ("postgres", "postmaster")
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith(names)]


def client_processes(server: subprocess.Popen) -> list[psutil.Process]:
    """This bench's client processes: its children but the store server and its siblings."""
    servers = {p.pid for p in server_processes(server)}
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in servers]


def prepare(url: str, token: str, clients: int, tasks: int) -> list[tuple[str, str, int, int]]:
    """One run, its actor with `tasks` queued tasks, and one rollout worker per client (their refs)."""
    store = HttpStore(url, token=token)
    refs = seed_run(store, clients, tasks)
    store.close()
    return refs


def seed_run(store: Any, clients: int, tasks: int) -> list[tuple[str, str, int, int]]:
    """On any Store: the run, its actor's `tasks` queued tasks, and `clients` rollout workers (their refs)."""
    store.apply_run(RUN, SPEC)
    actor = store.create_worker(RUN, "actor", 0, "local", 600)
    actor_ref = WorkerRef(RUN, "actor", 0, actor.incarnation)
    for start in range(0, tasks, 500):
        batch = [
            NewTask(step=i // 8, slot=i % 8, min_weight_version=0, payload={"prompt": f"p{i}"})
            for i in range(start, min(tasks, start + 500))
        ]
        store.enqueue_tasks(actor_ref, batch)
    refs = []
    for replica in range(clients):
        row = store.create_worker(RUN, "rollout", replica, "local", 600)
        refs.append((RUN, "rollout", replica, row.incarnation))
    return refs


def worker_round(store: Any, ref: WorkerRef, step: int, call: Any) -> None:
    """A worker's round of calls, each made through `call(name, fn, *args)` (which times or paces it)."""
    call("heartbeat", store.heartbeat, ref, step)
    task = call("lease_task", store.lease_task, ref, 30.0)
    if task is not None:
        call("renew_task", store.renew_task, ref, task.id, task.lease_token, 30.0)
        call("complete_task", store.complete_task, ref, task.id, task.lease_token, {"reward": 1.0})
    call("add_metrics", store.add_metrics, ref, step, {"reward": 0.5, "loss": 0.1})
    call("get_run", store.get_run, RUN)
    call("latest_weights", store.latest_weights, RUN)


# -- the clients ---------------------------------------------------------------------------------------------
class _Over(Exception):
    """The case's time is up."""


def _client(
    store: HttpStore,
    ref: WorkerRef,
    rate: float,
    start_at: float,
    stop_at: float,
    out: list,
    lock: threading.Lock,
) -> None:
    """One worker's round of calls from `start_at` until `stop_at` (time.monotonic()); (call, seconds,
    error kind or None, whether it was the client's first call: the one that opens its connection)
    into `out`."""
    interval = 1.0 / rate if rate > 0 else 0.0
    next_at = start_at + (interval * (ref.replica % 97) / 97 if interval else 0.0)  # spread the starts
    step, records = 0, []

    def call(name: str, fn: Any, *args: Any) -> Any:
        nonlocal next_at
        now = time.monotonic()
        if next_at > now:
            time.sleep(next_at - now)
        started = time.monotonic()
        if started >= stop_at:
            raise _Over
        next_at = max(next_at + interval, started)  # late: go on from now, never catch up in a burst
        try:
            result = fn(*args)
        except Exception as exc:  # counted by kind: the point is to see every failure
            records.append(
                (name, time.monotonic() - started, f"{type(exc).__name__}: {str(exc)[:160]}", not records)
            )
            return None
        records.append((name, time.monotonic() - started, None, not records))
        return result

    try:
        while True:
            step += 1
            worker_round(store, ref, step, call)
    except _Over:
        pass
    with lock:
        out.extend(records)


def client_ready(ready: Any) -> None:
    """A client process's start (the Pool's initializer), once its imports are done: the objects they
    made are left out of its later garbage collections (a full collection stops its 64 or so client
    threads at once, where each real worker is a process of its own), then it waits at `ready`, a
    barrier with the bench, which fixes the start time only when every client process has got there."""
    gc.collect()
    gc.freeze()
    ready.wait(120)


def client_process(
    url: str, token: str, refs: list[tuple[str, str, int, int]], rate: float, start_at: float, seconds: float
) -> tuple[float, list[tuple[str, float, str | None, bool]]]:
    """Threads, one per worker ref, all starting at `start_at` (time.time()) for `seconds`; returns how
    late the process got to `start_at` (seconds; 0 if early) and the calls. The threads are started
    before `start_at` and wait for it (real workers are running before their first call)."""
    store = HttpStore(url, token=token, timeout=(10.0, 30.0), retry_attempts=1)  # no retries: failures show
    out: list = []
    lock = threading.Lock()
    late = max(0.0, time.time() - start_at)
    begin = time.monotonic() + max(0.0, start_at - time.time())
    stop_at = begin + seconds
    threads = [
        threading.Thread(
            target=_client, args=(store, WorkerRef(*ref), rate, begin, stop_at, out, lock), daemon=True
        )
        for ref in refs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return late, out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_case(kind: str, clients: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    token = secrets.token_hex(16)
    server_log = tmp / "server.log"
    with (
        fresh_database(kind, tmp) as backing,
        store_server(backing, token, args.threads, server_log, args.server_processes) as (url, server),
    ):
        rounds = clients * max(args.rate, 5.0) * args.seconds / 5  # leases a case can take, with room
        refs = prepare(url, token, clients, tasks=int(min(50_000, rounds * 1.5)) + 100)
        procs = max(1, min(args.procs, clients))
        shares = [refs[i::procs] for i in range(procs)]
        load_before = os.getloadavg()[0]
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Barrier(procs + 1)
        with ctx.Pool(procs, initializer=client_ready, initargs=(ready,)) as pool:
            ready.wait(120)  # every client process started and imported: their start is not timed
            who = {
                "server": lambda: server_processes(server),
                "postgres": postgres_processes,
                "clients": lambda: client_processes(server),
            }
            # Listed now: walking the machine's processes takes a core some milliseconds, not at the start.
            listed = {name: find() for name, find in who.items()}
            start_at = time.time() + 1.0
            parts = [
                pool.apply_async(client_process, (url, token, share, args.rate, start_at, args.seconds))
                for share in shares
            ]
            time.sleep(max(0.0, start_at - time.time()))
            cpu_before = {name: cpu_seconds(processes) for name, processes in listed.items()}
            machine_before, started = psutil.cpu_times(), time.monotonic()
            answers = [part.get(args.seconds + 120) for part in parts]
            records = [r for _, part in answers for r in part]
            clients_late = max(late for late, _ in answers)
            cpu = {name: cpu_since(cpu_before[name], cpu_seconds(find())) for name, find in who.items()}
            machine, elapsed = psutil.cpu_times(), time.monotonic() - started
        busy = sum(machine) - machine.idle - (sum(machine_before) - machine_before.idle)
        load_after = os.getloadavg()[0]
    ok = [sec for _, sec, err, _ in records if err is None]
    after_first = [sec for _, sec, err, first in records if err is None and not first]
    failures = Counter(err for _, _, err, _ in records if err is not None)
    by_call: dict[str, list[float]] = defaultdict(list)
    for name, sec, err, _ in records:
        if err is None:
            by_call[name].append(sec)
    return {
        "store": kind,
        "clients": clients,
        "seconds": args.seconds,
        "rate_per_client": args.rate,
        "server_threads": args.threads,
        "server_processes": args.server_processes,
        "client_procs": procs,
        "calls": len(records),
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "calls_per_s": round(len(records) / args.seconds, 1),
        "offered_per_s": round(clients * args.rate, 1) if args.rate > 0 else None,
        "p50_ms": round(pct(ok, 0.50) * 1000, 1),
        "p99_ms": round(pct(ok, 0.99) * 1000, 1),
        "max_ms": round(max(ok, default=float("nan")) * 1000, 1),
        # Without each client's first call, which also opens its connection (all of them in the first second).
        "p99_ms_after_first_calls": round(pct(after_first, 0.99) * 1000, 1),
        "mean_ms": round(statistics.fmean(ok) * 1000, 1) if ok else None,
        "p99_ms_by_call": {name: round(pct(v, 0.99) * 1000, 1) for name, v in sorted(by_call.items())},
        "calls_by_call": {name: len(v) for name, v in sorted(by_call.items())},
        # CPU seconds from the clients' start to their end, per call served: where the cores went.
        "cpu_ms_per_call": {
            name: round(seconds / max(1, len(records)) * 1000, 2) for name, seconds in cpu.items()
        },
        "machine_busy_cores": round(busy / elapsed, 2),
        # How late the last client process got to the start time (its calls began then, and were timed).
        "clients_late_s": round(clients_late, 3),
        "load_avg_before": round(load_before, 2),
        "load_avg_after": round(load_after, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", action="append", choices=["sqlite", "postgres"])
    parser.add_argument("--clients", default="16,64,256", help="comma-separated numbers of clients")
    parser.add_argument("--seconds", type=float, default=15.0, help="per case (at most 120)")
    parser.add_argument("--rate", type=float, default=1.0, help="calls per second per client; 0: unpaced")
    parser.add_argument("--procs", type=int, default=4, help="client processes (clients split among them)")
    parser.add_argument("--threads", type=int, default=8, help="the server's worker threads, per process")
    parser.add_argument(
        "--server-processes", type=int, default=1, help="the server's processes (--processes)"
    )
    parser.add_argument("--out", default="bench/results/store_load.json")
    args = parser.parse_args()
    if not 0 < args.seconds <= 120:
        parser.error("--seconds must be in (0, 120]")
    clients = [int(c) for c in args.clients.split(",")]
    if any(not 0 < c <= 1024 for c in clients):
        parser.error("--clients: each between 1 and 1024")
    results = []
    print(
        "| store | clients | calls/s | offered/s | p50 ms | p99 ms | p99 ms, first calls left out | max ms "
        "| failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="mortal-store-load-") as tmp:
        for kind in args.store or ["sqlite"]:
            for n in clients:
                r = run_case(kind, n, args, Path(tmp))
                results.append(r)
                print(
                    f"| {kind} | {n} | {r['calls_per_s']} | {r['offered_per_s'] or '-'} | {r['p50_ms']} | "
                    f"{r['p99_ms']} | {r['p99_ms_after_first_calls']} | {r['max_ms']} | "
                    f"{r['failed']} {r['failures'] or ''} |",
                    flush=True,
                )
    machine = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.uname().machine,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"command": " ".join(sys.argv), "machine": machine, "results": results}, indent=2) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
