"""What an environment service costs per tool call, against an instance in the rollout worker: the same
trivial tool (ArithEnvironment.add, the shipped arithmetic environment) called through the Toolbox in each
mode of rollout.environmentService, and what rebuilding a killed process with its rollout's calls replayed
costs.

    python bench/environment_service.py [--calls 300] [--replayed 20] [--json out.json]

Modes: inProcess (a thread per call, the deadline's), processPool (one child process; a pickle each way),
http (an environment server on 127.0.0.1 in this process, its instances in one child: JSON over HTTP, then
the server's own pickles). Each mode answers the same calls, in one rollout (one call after another), and
the outcomes must be equal. The recovery: after `--replayed` calls, the instance's process is killed and the
next call's seconds are taken (a new process, reset and the calls replayed, then the call).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from mortal.specs.training import RolloutSpec
from mortal.workers.rollout.tools import Toolbox

ARITH = "mortal.workers.rollout.builtin_tools:ArithEnvironment"
TOKEN_ENV = "BENCH_ENV_TOKEN"


def _call(a: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": 1}}}


def _box(mode: str, url: str | None) -> Toolbox:
    service: dict[str, Any] = {"mode": mode}
    if mode == "processPool":
        service["processes"] = 1
    if mode == "http":
        service.update(url=url, tokenEnv=TOKEN_ENV)
    return Toolbox.from_spec(
        RolloutSpec.model_validate({"environment": ARITH, "environmentService": service})
    )


def _host_pid(box: Toolbox, mode: str, server: Any) -> int:
    """The process that holds the first instance (the worker's pool, or the server's)."""
    if mode == "processPool":
        [environment] = box._pool[None]
        return int(box.service.pid(environment._mortal_handle))
    [session] = server.service.sessions.values()
    return int(server.service.pool.pid(session.proxy._mortal_handle))


def measure(mode: str, calls: int, replayed: int, url: str | None, server: Any) -> dict[str, Any]:
    box = _box(mode, url)
    try:
        [environment] = box.environments_for([None])
        environment.reset(answer="1")
        tools = box.tools_for(environment)
        seconds, contents = [], []
        for i in range(calls):
            started = time.perf_counter()
            outcome = box.call(tools, _call(i))
            seconds.append(time.perf_counter() - started)
            contents.append(outcome.content)
        result: dict[str, Any] = {
            "median_call_ms": round(1000 * statistics.median(seconds), 3),
            "p90_call_ms": round(1000 * statistics.quantiles(seconds, n=10)[-1], 3),
            "contents": contents,
        }
        if mode != "inProcess":
            environment.reset(answer="1")
            for i in range(replayed):
                box.call(tools, _call(i))
            os.kill(_host_pid(box, mode, server), signal.SIGKILL)
            time.sleep(0.2)  # the kill lands before the next call
            started = time.perf_counter()
            outcome = box.call(tools, _call(replayed))
            result["recovery_seconds"] = round(time.perf_counter() - started, 3)
            if outcome.failed or outcome.content != str(replayed + 1):
                raise SystemExit(f"{mode}: the call after the kill answered {outcome}")
        return result
    finally:
        box.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--replayed", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from mortal.workers.rollout.environment_server import serve

    token = os.urandom(16).hex()
    os.environ[TOKEN_ENV] = token
    server = serve([ARITH], "127.0.0.1", 0, token, processes=1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        modes = {
            mode: measure(mode, args.calls, args.replayed, url, server)
            for mode in ("inProcess", "processPool", "http")
        }
    finally:
        server.shutdown()
        server.server_close()
        server.service.close()
    expected = modes["inProcess"].pop("contents")
    for mode in ("processPool", "http"):
        if modes[mode].pop("contents") != expected:
            raise SystemExit(f"{mode} answered differently from inProcess")
    result = {
        "bench": "environment_service",
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "calls": args.calls,
        "replayed_calls": args.replayed,
        **modes,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
