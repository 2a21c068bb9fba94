"""The Ray backend: every worker is a named, detached Ray actor on an existing Ray cluster.

Who calls it: the controller, through the `Backend` contract (`select_backend("ray@<address>")`). The
controller connects as a Ray driver, once per process, so one controller drives one cluster. The
actor's body (ray_worker.WorkerHost) runs `python -m mortal.workers.main`, so the worker code is the
same on every backend. Ray's named actors are the process table: namespace `mortal-<home>-<run>`
(<home> keeps two installations sharing a cluster apart), actor name = the worker id, handle
"ray:<namespace>/<worker id>"; a restarted controller lists its namespaces and adopts what runs.
Rollouts are spread over the nodes; the actor goes back to its last node when it can.
What it must not do: touch the store, decide anything, or import ray before a RayBackend is made.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mortal.controller.backends.base import (
    EXITED_TTL_SECONDS,
    WORKER_MODULE,
    Backend,
    BackendError,
    BackendUnavailable,
    BackendWorker,
    LaunchFailed,
    Unschedulable,
    WorkerLaunch,
)
from mortal.controller.backends.gpus import wants_gpu
from mortal.controller.snapshot import archive
from mortal.state import paths

HANDLE_PREFIX = "ray:"
NAMESPACE_PREFIX = "mortal-"
ADDRESS_FIELD = "spec.ray.address"
CONNECT_TIMEOUT_SECONDS = 5.0  # a cluster's head that does not accept a connection by then is not there
STATUS_TIMEOUT_SECONDS = 0.2  # a status call not answered by then: the actor is starting (or its node slow)
ANSWER_SECONDS = 2.0  # stop: an actor that does not answer a status call by then is not running a worker
STOP_MARGIN_SECONDS = 10.0  # after the grace: SIGKILL, reaping, the reply
GONE_WAIT_SECONDS = 10.0  # after ray.kill: until the name is free
ACCELERATOR_TYPE_UNIT = 0.001  # what Ray reserves of "accelerator_type:<T>" for an actor that names a type
_WORKER_ID = re.compile(
    r"^(?P<run>[^/]+)/(?P<role>[a-z]+)-(?P<replica>\d+)#(?P<incarnation>\d+)"
    r"(@(?P<uid>[0-9a-f-]+))?$"
)
_CONNECTED: dict[str, str] = {}  # the address this process's ray.init connected to ("address" -> value)
_CONNECT_LOCK = threading.Lock()


def load_ray() -> ModuleType:
    """The `ray` package; BackendUnavailable says the fix when it is not installed."""
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailable(
            "backend ray needs the `ray` package in the controller's environment (and on every node of the "
            "cluster, with mortal): pip install 'mortal[ray]'"
        ) from exc
    return ray


def connect(ray: ModuleType, address: str | None) -> str:
    """Connect this process to the cluster at `address` (else $RAY_ADDRESS) once; the address used.

    BackendUnavailable names spec.ray.address when none is given, when no cluster answers there, or
    when this process is already connected to another cluster (Ray allows one per process)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise BackendUnavailable(
            f"backend ray needs the cluster's address: set {ADDRESS_FIELD} (host:port "
            "of the head, 'auto', or ray://host:10001), or RAY_ADDRESS in the "
            "controller's environment"
        )
    with _CONNECT_LOCK:
        if "address" in _CONNECTED and ray.is_initialized():
            if _CONNECTED["address"] != address:
                raise BackendUnavailable(
                    f"{ADDRESS_FIELD}: this controller is connected to the Ray cluster at "
                    f"{_CONNECTED['address']!r} and cannot also drive {address!r} (one Ray cluster per "
                    "controller process)"
                )
            return address
        _answers(address)
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, TimeoutError, ValueError, RuntimeError) as exc:
            raise BackendUnavailable(
                f"{ADDRESS_FIELD}: no Ray cluster answers at {address!r}: {exc}"
            ) from exc
        _CONNECTED["address"] = address
        return address


def _answers(address: str) -> None:
    """A host:port address must accept a TCP connection within CONNECT_TIMEOUT_SECONDS: `ray.init` itself
    retries an absent GCS for minutes, which would hold a reconcile pass that long. ('auto' and ray://
    addresses are left to ray.init, which fails fast on them.)"""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_SECONDS).close()
    except OSError as exc:
        raise BackendUnavailable(f"{ADDRESS_FIELD}: no Ray cluster answers at {address!r}: {exc}") from exc


def home_tag(home: str | Path) -> str:
    """8 hex digits of a MORTAL_HOME's real path: the part of a namespace that says whose workers these
    are."""
    return hashlib.sha256(os.path.realpath(home).encode()).hexdigest()[:8]


def ray_accelerator_type(gpu: str, ray: ModuleType) -> str | None:
    """Ray's accelerator_type for the spec's GPU name (its own spelling when it has a constant for it, e.g.
    'A100', 'A10G'; the name upper-cased otherwise); None on the CPU or for 'any'."""
    if not wants_gpu(gpu):
        return None
    name = gpu.strip().upper().split(":")[0]
    if name in ("ANY", "GPU"):
        return None
    known = {
        str(v).upper(): str(v)
        for k, v in vars(ray.util.accelerators).items()
        if k.isupper() and isinstance(v, str)
    }
    return known.get(name, name)


class RayBackend(Backend):
    """Workers as named detached actors of one Ray cluster, scoped to one MORTAL_HOME."""

    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        home: str | Path | None = None,
        command: list[str] | None = None,
        exited_ttl_seconds: float = EXITED_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`address` (spec.ray.address) defaults to $RAY_ADDRESS; `home` to $MORTAL_HOME; `command` is the
        worker's argv on the node (default: `python -m mortal.workers.main` with the node's interpreter)."""
        self._ray = load_ray()
        self.address = connect(self._ray, address)
        self.home = os.path.realpath(home if home is not None else paths.mortal_home())
        self._prefix = f"{NAMESPACE_PREFIX}{home_tag(self.home)}-"
        self._command = command
        self.exited_ttl_seconds, self._clock = exited_ttl_seconds, clock
        self._host = self._ray.remote(_worker_host_class())
        self._lock = threading.RLock()
        self._handles: dict[str, Any] = {}  # handle -> actor handle (cached lookups)
        self._seen: dict[str, BackendWorker] = {}  # handle -> worker, for every actor seen alive
        self._ended: dict[str, tuple[int | None, float]] = {}  # handle -> (exit code, when first seen ended)
        self._nodes: dict[str, str] = {}  # run -> node id its actor last ran on (the actor's placement kept)
        self._asked: dict[str, Any] = {}  # handle -> a status() call not answered yet

    def namespace(self, run: str) -> str:
        return self._prefix + run

    # -- launch ------------------------------------------------------------------------------
    def launch(self, launch: WorkerLaunch) -> str:
        """Create the worker's actor (or return the handle of the live actor of this worker id)."""
        namespace = self.namespace(launch.run)
        handle = f"{HANDLE_PREFIX}{namespace}/{launch.worker_id}"
        if launch.colocate:
            raise LaunchFailed(
                "rollout.colocate shares the actor's GPU on one host: the ray backend does "
                "not build it; give rollouts GPUs of their own (drop colocate)"
            )
        with self._lock:
            if self._lookup(handle) is not None and handle not in self._ended:
                return handle
            options = self._options(launch, namespace)
            self._check_feasible(launch, options)
            argv = self._command or [sys.executable, "-m", WORKER_MODULE]
            try:
                code = archive(launch.run, launch.env, launch.mortal_home) if launch.node_home else None
                actor = self._host.options(**options).remote(
                    dataclasses.asdict(launch), argv, namespace, code
                )
            except (ValueError, TypeError) as exc:  # Ray refused the options (a bad resource name, ...)
                raise LaunchFailed(f"Ray refused to create {launch.worker_id}: {exc}") from exc
            except self._ray.exceptions.RaySystemError as exc:
                raise BackendError(f"Ray: could not create {launch.worker_id}: {exc}") from exc
            self._handles[handle] = actor
            worker = _worker(launch.worker_id, handle)
            if worker is not None:  # a launch's worker id always is one
                self._seen[handle] = worker
            self._ended.pop(handle, None)
            return handle

    def _options(self, launch: WorkerLaunch, namespace: str) -> dict[str, Any]:
        """The actor's options: its name, lifetime, resources and placement."""
        gpus = launch.gpu_count if wants_gpu(launch.gpu) else 0
        options: dict[str, Any] = {
            "name": launch.worker_id,
            "namespace": namespace,
            "lifetime": "detached",
            "max_restarts": 0,
            "max_concurrency": 4,
            "num_cpus": 1.0 if launch.cpus is None else launch.cpus,
            "num_gpus": gpus,
        }
        accelerator = ray_accelerator_type(launch.gpu, self._ray) if gpus else None
        if accelerator:
            options["accelerator_type"] = accelerator
        if launch.memory_bytes:
            options["memory"] = launch.memory_bytes
        if launch.resources:
            options["resources"] = dict(launch.resources)
        strategies = self._ray.util.scheduling_strategies
        if launch.role == "rollout":
            options["scheduling_strategy"] = "SPREAD"
        elif (node := self._nodes.get(launch.run)) is not None:
            options["scheduling_strategy"] = strategies.NodeAffinitySchedulingStrategy(
                node_id=node, soft=True
            )
        return options

    def _check_feasible(self, launch: WorkerLaunch, options: dict[str, Any]) -> None:
        """Unschedulable when no live node's total resources can hold the request (Ray would leave the
        actor pending forever): CPUs, GPUs, the accelerator type, memory and custom resources."""
        wants = {
            "CPU": options["num_cpus"],
            "GPU": options["num_gpus"],
            "memory": options.get("memory", 0),
            **options.get("resources", {}),
        }
        if "accelerator_type" in options:
            wants[f"accelerator_type:{options['accelerator_type']}"] = ACCELERATOR_TYPE_UNIT
        wants = {k: v for k, v in wants.items() if v}
        try:
            nodes = [n.get("Resources", {}) for n in self._ray.nodes() if n.get("Alive")]
        except Exception as exc:  # noqa: BLE001 - failing to ask is not "infeasible"
            raise BackendError(f"Ray: could not list the cluster's nodes: {exc}") from exc
        if any(all(node.get(k, 0) >= v for k, v in wants.items()) for node in nodes):
            return
        asked = ", ".join(f"{k}={v:g}" for k, v in wants.items())
        best: dict[str, float] = max(
            nodes, key=lambda n: sum(n.get(k, 0) >= v for k, v in wants.items()), default={}
        )
        lacking = [k for k, v in wants.items() if best.get(k, 0) < v]
        gpu_only = all(k == "GPU" or k.startswith("accelerator_type:") for k in lacking)
        field = f"spec.{launch.role}.gpu" if gpu_only else f"spec.ray.{launch.role}"
        raise Unschedulable(
            f"no node of the Ray cluster at {self.address} can ever hold {launch.role}-{launch.replica}: it "
            f"asks for {asked}, and no node has {', '.join(lacking)} enough ({len(nodes)} node(s) alive): "
            f"change {field} or add a node that has them"
        )

    # -- list --------------------------------------------------------------------------------
    def list(self, run: str | None = None) -> list[BackendWorker]:
        try:
            named = self._ray.util.list_named_actors(all_namespaces=True)
        except Exception as exc:  # noqa: BLE001 - Ray unreachable: never read as "every worker exited"
            raise BackendError(f"Ray: could not list the named actors: {exc}") from exc
        prefix = self._prefix if run is None else self.namespace(run)
        # Only names that are worker ids: a run's namespace also holds its weights hub (sync ray), which is
        # no WorkerHost (it has no status() to ask) and is not ours to judge (it ends with its actor).
        listed = {
            handle: worker
            for a in named
            if a["namespace"] == prefix or (run is None and a["namespace"].startswith(prefix))
            for handle in [f"{HANDLE_PREFIX}{a['namespace']}/{a['name']}"]
            for worker in [_worker(a["name"], handle)]
            if worker is not None
        }
        with self._lock:
            statuses = self._statuses([h for h in listed if h not in self._ended])
            out: dict[str, BackendWorker] = {}
            now = self._clock()
            for handle, worker in listed.items():
                self._seen.setdefault(handle, worker)
                state = statuses.get(handle, {})
                if (
                    handle in self._ended
                    or "exit_code" in state
                    and state["exit_code"] is not None
                    or state.get("dead")
                ):
                    self._end(handle, state.get("exit_code"), now)
                    out[handle] = dataclasses.replace(worker, alive=False, exit_code=self._ended[handle][0])
                    continue
                if worker.role == "actor" and state.get("node_id"):
                    self._nodes[worker.run] = state["node_id"]
                out[handle] = worker
            for handle, worker in list(self._seen.items()):  # seen alive before, no longer named: it died
                if handle in out or (run is not None and worker.run != run):
                    continue
                self._end(handle, self._ended.get(handle, (None, now))[0], now)
                if now - self._ended[handle][1] > self.exited_ttl_seconds:
                    self._forget(handle)
                    continue
                out[handle] = dataclasses.replace(worker, alive=False, exit_code=self._ended[handle][0])
        return sorted(out.values(), key=lambda w: (w.run, w.role, w.replica, w.incarnation))

    def _statuses(self, handles: builtins.list[str]) -> dict[str, dict[str, Any]]:
        """Each actor's status() ({'dead': True} when Ray says it died); actors that do not answer in time
        (starting, waiting for resources, or on a slow node) are left out: alive, as far as anyone knows.
        An unanswered call is kept and looked at again by the next listing, not sent again."""
        found: dict[str, dict[str, Any]] = {}
        errors = self._ray.exceptions
        for handle in handles:
            if handle in self._asked:
                continue
            actor = self._lookup(handle)
            if actor is None:
                found[handle] = {"dead": True}
                continue
            self._asked[handle] = actor.status.remote()
        refs = {ref: handle for handle, ref in self._asked.items() if handle in handles}
        if not refs:
            return found
        ready, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=STATUS_TIMEOUT_SECONDS)
        for ref in ready:
            handle = refs[ref]
            del self._asked[handle]
            try:
                found[handle] = self._ray.get(ref)
            except errors.ActorUnavailableError:
                continue  # unreachable for now (its node restarts, a network blip): no verdict
            except (errors.ActorDiedError, errors.RayActorError):
                found[handle] = {"dead": True}
        return found

    def _end(self, handle: str, code: int | None, now: float) -> None:
        """Remember an ended worker (first verdict wins) and free its actor's resources."""
        if handle in self._ended:
            return
        self._ended[handle] = (code, now)
        actor = self._handles.get(handle)
        if actor is not None:
            self._kill(actor)

    def _lookup(self, handle: str) -> Any | None:
        """The actor of a handle (cached), None when no live actor has that name."""
        if handle in self._handles:
            return self._handles[handle]
        namespace, _, name = handle.removeprefix(HANDLE_PREFIX).partition("/")
        try:
            actor = self._ray.get_actor(name, namespace=namespace)
        except ValueError:
            return None
        self._handles[handle] = actor
        return actor

    def dump_stacks(self, handle: str) -> bool:
        """SIGUSR1 to the worker's process through its actor (WorkerHost.dump_stacks), which faulthandler
        answers with every thread's stack in the worker's log; False when the actor does not answer within
        ANSWER_SECONDS (its node is gone, or it runs an older body): the store's request for the stacks
        then reaches the worker's heartbeat instead."""
        if not handle.startswith(HANDLE_PREFIX):
            return False
        with self._lock:
            actor = self._lookup(handle)
        if actor is None:
            return False
        try:
            return bool(self._ray.get(actor.dump_stacks.remote(), timeout=ANSWER_SECONDS))
        except (AttributeError, self._ray.exceptions.RayError):  # GetTimeoutError is one
            return False

    # -- stop --------------------------------------------------------------------------------
    def stop(self, handle: str, grace_seconds: float = 5.0) -> None:
        """TERM the worker's process group through its actor (KILL after `grace_seconds`), then kill the actor
        and wait until its name is free. Unknown handles are a no-op; forgets the handle."""
        if not handle.startswith(HANDLE_PREFIX):
            return
        with self._lock:
            self._handles.pop(handle, None)
            actor = self._lookup(handle)
        if actor is not None:
            errors = self._ray.exceptions
            # An actor that does not answer (still waiting for resources, dead, its node gone) has no worker
            # we could ask to stop: killing the actor below is all there is to do (its worker dies with it).
            answered, _ = self._ray.wait([actor.status.remote()], timeout=ANSWER_SECONDS)
            if answered:
                with contextlib.suppress(
                    errors.RayActorError, errors.GetTimeoutError, errors.ActorUnavailableError
                ):
                    self._ray.get(
                        actor.stop.remote(grace_seconds), timeout=grace_seconds + STOP_MARGIN_SECONDS
                    )
            self._kill(actor)
            namespace, _, name = handle.removeprefix(HANDLE_PREFIX).partition("/")
            deadline = time.monotonic() + GONE_WAIT_SECONDS
            while time.monotonic() < deadline and self._named(namespace, name):
                time.sleep(0.05)
        with self._lock:
            self._forget(handle)

    def _named(self, namespace: str, name: str) -> bool:
        try:
            self._ray.get_actor(name, namespace=namespace)
        except ValueError:
            return False
        return True

    def _kill(self, actor: Any) -> None:
        with contextlib.suppress(ValueError, self._ray.exceptions.RayError):  # already gone
            self._ray.kill(actor, no_restart=True)

    def _forget(self, handle: str) -> None:
        self._asked.pop(handle, None)
        self._handles.pop(handle, None)
        self._seen.pop(handle, None)
        self._ended.pop(handle, None)


def _worker(worker_id: str, handle: str) -> BackendWorker | None:
    """The BackendWorker an actor name stands for (None for a name that is no worker id)."""
    found = _WORKER_ID.match(worker_id)
    if found is None:
        return None
    return BackendWorker(
        worker_id=worker_id,
        handle=handle,
        run=found["run"],
        role=found["role"],
        replica=int(found["replica"]),
        incarnation=int(found["incarnation"]),
        alive=True,
        run_uid=found["uid"] or "",
    )


def _worker_host_class() -> type:
    from mortal.controller.backends.ray_worker import WorkerHost

    return WorkerHost
