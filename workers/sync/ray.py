"""Weight sync `ray`: the volume's version folders through Ray's object store, for Ray nodes that share no
disk.

    actor:   write the folder as volume does, put its files into the object store and their ref into the
             run's hub; record "mortal-ray-weights://<namespace>/<hub>/<version folder>"
    rollout: get the files from the hub and write them whole into its node's
             weights/received/<run uid>/<version folder>/, then load that folder as volume's

Both sides are processes a Ray actor of the ray backend started, with the cluster's address and the run's
namespace in their environment (ADDRESS_ENV, NAMESPACE_ENV). The hub is a named Ray actor holding the refs
of the newest KEEP versions, on the publisher's node and not detached: Ray ends it with its publisher,
so nothing of a run outlives its actor in the cluster (a relaunched actor publishes again before any
rollout needs a version). A hub lost while its publisher lives is made again by the publisher, which keeps
its own refs (`ensure_held`): only it can, and a rollout waiting for the newest version depends on it.
What it must not do: record rows (the publisher does) or know what the files hold.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from mortal.state import paths
from mortal.state.containment import inside
from mortal.workers.sync.base import Gather
from mortal.workers.sync.volume import VolumeTransport

SCHEME = "mortal-ray-weights://"
ADDRESS_ENV = "MORTAL_RAY_ADDRESS"  # the cluster's GCS address, as the worker's Ray actor sees it
NAMESPACE_ENV = "MORTAL_RAY_NAMESPACE"  # the run's namespace (mortal-<home>-<run>)
NODE_ENV = "MORTAL_RAY_NODE_ID"  # the node the worker's Ray actor runs on: the hub is kept there
RECEIVED = "received"  # the folder of versions a node received, under the run's weights folder
KEEP = 3  # versions the hub holds (WeightPublisher.keep rows are recorded; a rollout needs the newest)
_HUB_OPTIONS = {"num_cpus": 0, "max_concurrency": 16, "max_restarts": 0}
# incarnation -> the hub's handle, held for the process's life (Ray ends an actor no handle refers to)
_HUBS: dict[int, Any] = {}
# incarnation -> {version folder: [ref]}, the newest KEEP this process put
_SHARED: dict[int, dict[str, list[Any]]] = {}
# how often a publisher waiting for rollouts checks that its hub still holds its versions
HUB_CHECK_SECONDS = 5.0
HUB_ANSWER_SECONDS = 30.0  # a hub that does not answer a check in this long is left alone (asked again later)
log = logging.getLogger("mortal.weights")


class RayWeightsError(RuntimeError):
    """A process that should publish or receive through Ray cannot reach it (not started by the ray
    backend)."""


class WeightsHub:
    """The named Ray actor that maps a version folder's name to the ObjectRef of its files."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._refs: dict[str, list[Any]] = {}

    def put(self, name: str, ref: list[Any]) -> None:
        self._refs[name] = ref
        for old in sorted(self._refs, key=_version_of)[: max(0, len(self._refs) - self._keep)]:
            del self._refs[old]

    def get(self, name: str) -> list[Any] | None:
        return self._refs.get(name)

    def names(self) -> list[str]:
        return sorted(self._refs, key=_version_of)


def _version_of(name: str) -> int:
    return int(name.removeprefix("v").split("-", 1)[0])


def hub_name(incarnation: int) -> str:
    return f"weights-i{incarnation}"


def connect() -> Any:
    """`ray`, connected to the cluster this worker's Ray actor runs in, in the run's namespace (once).

    `ray.init` replaces the process's SIGTERM handler (Ray's exits at once; its C++ logging's prints a
    stack): the worker's own (mortal.workers.runtime: stop at the next step boundary, the actor after a
    checkpoint) is put back, or a suspend would lose the steps since the last checkpoint."""
    import ray

    if not ray.is_initialized():
        address, namespace = os.environ.get(ADDRESS_ENV), os.environ.get(NAMESPACE_ENV)
        if not address or not namespace:
            raise RayWeightsError(
                f"sync ray needs {ADDRESS_ENV} and {NAMESPACE_ENV}: the ray backend sets them; "
                "this worker was not started by it (use sync volume elsewhere)"
            )
        main = threading.current_thread() is threading.main_thread()
        own = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
        if main:
            signal.signal(signal.SIGTERM, own if own is not None else signal.SIG_DFL)
    return ray


def share(folder: Path, incarnation: int) -> str:
    """Put a written version folder's files into the object store and the hub; the path to record."""
    ray = connect()
    files = {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }
    ref = [ray.put(files)]
    kept = _SHARED.setdefault(incarnation, {})
    kept[folder.name] = ref
    for old in sorted(kept, key=_version_of)[: max(0, len(kept) - KEEP)]:
        del kept[old]
    try:
        ray.get(_hub(ray, incarnation).put.remote(folder.name, ref))
    # the hub died under a live publisher (killed by hand, say): a new one
    except ray.exceptions.RayActorError:
        _HUBS.pop(incarnation, None)
        ray.get(_hub(ray, incarnation).put.remote(folder.name, ref))
    return f"{SCHEME}{os.environ[NAMESPACE_ENV]}/{hub_name(incarnation)}/{folder.name}"


class HubLost(Exception):
    """The publisher's hub is dead, or no longer holds the newest version this publisher put."""


def ensure_held(incarnation: int) -> list[str]:
    """Check that this publisher's hub holds the newest version it put; if the hub is gone (or lost it),
    make the hub again and put back every version this process keeps. Returns the names put back
    ([] when the hub was fine, or this process has published nothing through Ray)."""
    kept = _SHARED.get(incarnation)
    if not kept:
        return []
    ray = connect()
    newest = max(kept, key=_version_of)
    try:
        held = ray.get(_hub(ray, incarnation).names.remote(), timeout=HUB_ANSWER_SECONDS)
        if newest not in held:
            raise HubLost(f"the hub holds {held}, not {newest}")
    except ray.exceptions.GetTimeoutError:  # busy, or its node is slow: not known to be lost
        return []
    except (ray.exceptions.RayActorError, HubLost):
        _HUBS.pop(incarnation, None)  # a dead actor's handle: the next _hub makes (or finds) a live one
        names = sorted(kept, key=_version_of)
        try:
            hub = _hub(ray, incarnation)
            ray.get([hub.put.remote(name, kept[name]) for name in names], timeout=HUB_ANSWER_SECONDS)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            _HUBS.pop(incarnation, None)  # the new hub died too, or is not up yet: the next look tries again
            return []
        return names
    return []


def _hub(ray: Any, incarnation: int) -> Any:
    """This publisher's hub (made, on this worker's node, at the first publish)."""
    if incarnation not in _HUBS:
        node = os.environ.get(NODE_ENV)
        # Hard affinity: the hub lives and dies with the publisher's node (its CPU need is 0, so the node
        # always takes it). A soft one let Ray place a rebuilt hub on another node, which the test cluster
        # then lost under the live publisher.
        placement = (
            {}
            if not node
            else {
                "scheduling_strategy": ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node, soft=False
                )
            }
        )
        _HUBS[incarnation] = (
            ray.remote(WeightsHub)
            .options(name=hub_name(incarnation), get_if_exists=True, **_HUB_OPTIONS, **placement)
            .remote(KEEP)
        )
    return _HUBS[incarnation]


def receive(path: str, run: str, uid: str) -> Path:
    """The folder on this node holding the version at `path` (fetched from the hub unless already here);
    FileNotFoundError when the hub no longer has it (pruned, or its actor ended): read the store again."""
    namespace, hub, name = path.removeprefix(SCHEME).split("/")
    folder = inside(paths.weights_dir(run) / RECEIVED / (uid or "-"), name)  # PathOutside for a stored ".."
    if folder.is_dir():
        return folder
    ray = connect()
    try:
        ref = ray.get(ray.get_actor(hub, namespace=namespace).get.remote(name))
        files = ray.get(ref[0]) if ref else None
    except ValueError:  # no actor of that name: the actor that published it has ended
        files = None
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
        raise FileNotFoundError(f"{path}: its publisher is gone ({type(exc).__name__})") from exc
    if files is None:
        raise FileNotFoundError(f"{path}: no longer held by the run's weights hub")
    _write_whole(folder, files)
    _keep_newest(folder.parent)
    return folder


def _write_whole(folder: Path, files: dict[str, bytes]) -> None:
    """Write the files into a temporary sibling, then rename it into place; another process of this node that
    wrote the same version first wins (its folder is the same bytes)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{uuid.uuid4().hex[:8]}"
    try:
        for name, data in files.items():
            target = inside(tmp, name)  # names as the hub sent them: each stays in the version's folder
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        os.rename(tmp, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _keep_newest(received: Path) -> None:
    """Delete received versions older than the newest KEEP on this node (a rollout loading one of them
    gets FileNotFoundError and reads the store again, as on a volume)."""
    folders = sorted(
        (p for p in received.iterdir() if not p.name.startswith(".")), key=lambda p: _version_of(p.name)
    )
    for old in folders[: max(0, len(folders) - KEEP)]:
        shutil.rmtree(old, ignore_errors=True)


class RayTransport(VolumeTransport):
    """Ray nodes that share no disk: each version's folder, written as volume writes it, goes through Ray's
    object store; a rollout writes it into its own node's folder before loading it."""

    method = "ray"
    version_folders = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hub_checked = 0.0  # time.monotonic() of the last look at the hub

    def publish(
        self,
        model: torch.nn.Module,
        dest: Path,
        version: int,
        step: int,
        incarnation: int,
        state: dict[str, torch.Tensor] | None = None,
        gather: Gather | None = None,
        device: torch.device | None = None,
        cast: torch.dtype | None = None,
    ) -> str:
        super().publish(model, dest, version, step, incarnation, state=state)
        where = share(dest, incarnation)
        # the object store holds it now: this node's folder is not read again
        shutil.rmtree(dest, ignore_errors=True)
        return where

    def keep_alive(self, incarnation: int) -> None:
        """If the hub lost the versions this publisher recorded (its Ray actor died while this one lives), put
        them back (`ensure_held`), at most every HUB_CHECK_SECONDS. Without it a rollout waiting for the
        newest version would ask for it forever, and the actor would wait forever for that rollout."""
        if time.monotonic() - self._hub_checked < HUB_CHECK_SECONDS:
            return
        self._hub_checked = time.monotonic()
        put_back = ensure_held(incarnation)
        if put_back:
            log.warning(
                "the weights hub had lost the versions %s (its Ray actor ended); made it again and put "
                "them back",
                ", ".join(put_back),
            )

    def locate(self, path: str, run: str, uid: str) -> Path:
        return receive(path, run, uid)
