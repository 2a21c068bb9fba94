"""A real three-node Ray cluster on this machine, for the Ray backend's tests: a head and two worker nodes.

    cluster = RayCluster(tmp).start()  # `ray start` x3, loopback only; cluster.address = "127.0.0.1:<port>"
    cluster.kill_node("node_a")        # SIGKILL its raylet and every process under it (a lost machine)
    cluster.stop()                     # SIGKILL this cluster's processes (and only this cluster's)

Each node carries a custom resource named after it (node_head, node_a, node_b: 1 each), so a test can
place a worker on a node, and a MORTAL_HOME of its own (`cluster.home(node)`, set in its `ray start`
environment): a run with ray.sharedFilesystem false keeps its files there, so nothing can travel between
nodes by disk; the two worker nodes also carry rollout_node: 2, which keeps rollouts off the
head. `node_of(proc)` says which node a process runs on (the raylet it descends from). Nodes are small (2
logical CPUs, 80 MB object store, no dashboard) to fit this 2-core machine. The head's GCS declares a node
dead after 5 failed health checks a second apart: a killed raylet refuses the check at once, so its loss is
seen in ~5 s (Ray's default is ~15 s), while a live one starved of CPU gets 5 s per answer before a check
counts as failed (at 0.5 s x 3, the tolerance once used, a loaded CI machine saw live nodes declared dead).

It must run in a private network namespace (`unshare -rn`, then `ip link set lo up`: scripts/test.sh
does it), where loopback is the only interface: Ray then binds 127.0.0.1 and no packet leaves it.
`in_private_network()` says whether this process is in one. Who calls it: tests/conftest.py (the ray_cluster
fixture) and the Ray tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

NODES = ("node_head", "node_a", "node_b")
ROLLOUT_SLOTS = 2  # the worker nodes' "rollout_node" resource: a rollout asking 1 runs on node_a or node_b
# The GCS's health checks of raylets (Ray system config, read from the environment at `ray start --head`).
NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "5000",
    "RAY_health_check_failure_threshold": "5",
    "RAY_health_check_initial_delay_ms": "0",
}


def in_private_network() -> bool:
    """Loopback is this process's only network interface (a private network namespace)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def ray_cli() -> str:
    found = Path(sys.executable).parent / "ray"
    return str(found) if found.exists() else (shutil.which("ray") or "ray")


class RayCluster:
    def __init__(self, root: Path, port: int = 6390, cpus_per_node: int = 2) -> None:
        self.root, self.port, self.cpus = root, port, cpus_per_node
        self.address = f"127.0.0.1:{port}"
        self.raylets: dict[str, int] = {}  # node name -> its raylet's pid

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MORTAL_", "RAY_ADDRESS"))}
        return {**env, **NODE_DEATH, "RAY_USAGE_STATS_ENABLED": "0"}

    def home(self, node: str) -> Path:
        """The node's own MORTAL_HOME (what workers of a run with ray.sharedFilesystem false use there)."""
        return self.root / f"home-{node}"

    def _start(self, node: str, *head_or_join: str) -> None:
        before = set(_raylets(self.root))
        log = self.root / f"{node}.log"
        resources = {node: 1} if node == "node_head" else {node: 1, "rollout_node": ROLLOUT_SLOTS}
        cmd = [
            ray_cli(),
            "start",
            *head_or_join,
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            str(self.cpus),
            "--resources",
            json.dumps(resources),
            "--object-store-memory",
            str(80 * 1024 * 1024),
            "--disable-usage-stats",
        ]
        with open(log, "ab") as out:
            subprocess.run(
                cmd,
                env={**self._env(), "MORTAL_HOME": str(self.home(node))},
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=120,
            )
        [raylet] = set(_raylets(self.root)) - before
        self.raylets[node] = raylet

    def start(self) -> RayCluster:
        self._start(
            "node_head",
            "--head",
            "--port",
            str(self.port),
            "--include-dashboard=false",
            "--temp-dir",
            str(self.root / "ray"),
        )
        for node in NODES[1:]:
            self.add_node(node)
        return self

    def add_node(self, node: str) -> None:
        self._start(node, "--address", self.address)

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL the node's raylet and every process below it (its Ray workers and their mortal workers);
        the pids killed."""
        raylet = psutil.Process(self.raylets.pop(node))
        procs = [raylet, *raylet.children(recursive=True)]
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(procs, timeout=10)
        return [p.pid for p in procs]

    def node_of(self, proc: psutil.Process) -> str | None:
        """Which node a process runs under (its ancestor raylet), None if no raylet of ours is one."""
        try:
            pids = {p.pid for p in proc.parents()}
        except psutil.Error:
            return None
        return next((node for node, raylet in self.raylets.items() if raylet in pids), None)

    def node_of_worker(self, home: Path | None, worker_id: str) -> str | None:
        """The node a mortal worker (by its id, `run/role-replica#incarnation`, as its MORTAL_WORKER_ID
        begins; under MORTAL_HOME `home`; None: under the home of whichever of this cluster's nodes it runs
        on) runs on."""
        homes = {str(home)} if home is not None else {str(self.home(node)) for node in NODES}
        for proc in psutil.process_iter(["environ"]):
            env = proc.info.get("environ") or {}
            marker = env.get("MORTAL_WORKER_ID") or ""  # the worker's id, then "@" and its run's uid
            if marker.split("@", 1)[0] == worker_id and env.get("MORTAL_HOME") in homes:
                return self.node_of(proc)
        return None

    def stop(self) -> None:
        """SIGKILL every process of this cluster and what runs under them. Not `ray stop --force`: that
        kills every Ray process of the machine, another session's cluster included (namespaces made with
        `unshare -rn` share the process table)."""
        ours = _processes(self.root)
        procs = {p.pid: p for p in ours}
        for proc in ours:
            with contextlib.suppress(psutil.Error):
                procs.update({c.pid: c for c in proc.children(recursive=True)})
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(list(procs.values()), timeout=10)
        self.raylets.clear()


def _processes(root: Path) -> list[psutil.Process]:
    """This cluster's own processes (Ray workers below them are their children): each names the head's temp
    dir (under `root`) on its command line, so another cluster of the machine (another test session, in its
    own namespace) is never counted."""
    temp_dir = str(root / "ray")
    return [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if temp_dir in " ".join(p.info.get("cmdline") or [])
    ]


def _raylets(root: Path) -> list[int]:
    return [p.pid for p in _processes(root) if p.info.get("name") == "raylet"]
