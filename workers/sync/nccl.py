"""Weight sync `nccl`: a version is a slot of the actor's snapshot ring, sent to each rollout over NCCL when
it asks.

    weights/v<version>-i<incarnation>/nccl.pkl   the slot's layout, and the actor's rendezvous address

The actor opens a TCPStore rendezvous at its first share. A rollout joins it once, as a two-rank group
with the actor (a pair: the actor's sender thread for it), and asks for a version; the sender sends the
slot's flat buffers, or answers "gone" when the ring no longer holds it (FileNotFoundError, as for a
pruned version). Why a pair per rollout and not one broadcast group: rollouts come and go (scale,
preemption), and a group of all must re-form whenever one does, while one dead member stalls it.
The group is NCCL between CUDA tensors and gloo between CPU ones, so the tests run the same protocol
without a GPU.
What it must not do: block the actor's training (its threads wait with the GIL released), send a slot
before its snapshot is complete, or write tensor data to disk.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mortal.workers.atomic import atomic_dir
from mortal.workers.sync.base import Gather
from mortal.workers.sync.ring import (
    RingServer,
    RingTransport,
    SnapshotRing,
    TensorSlot,
    ViewCache,
    empty_buffers,
    intact,
    read_manifest,
    sizes_of,
    slot_version,
)

NCCL_FILE = "nccl.pkl"
HOST_ENV = "MORTAL_SYNC_HOST"  # the address rollouts reach the actor's rendezvous at (default: loopback)
# How long the actor's threads wait in the store before they look again. They are woken at once by
# what they wait for (a join, an ask) and by `close`, so this only bounds how often torch logs a
# wait that timed out (a warning line each) while a pair is idle.
IDLE_WAIT = timedelta(minutes=10)
STOP = "stop"  # what `close` writes where the accept thread waits
REPLY_TIMEOUT = timedelta(seconds=60)  # a sender that has not answered by then is taken for gone
# unless spec.deadlines.collectiveSeconds: a send or receive that hangs
TRANSFER_TIMEOUT = timedelta(minutes=5)
# this long fails (its peer died); the actor writes its value into each manifest, so the rollout uses the same
log = logging.getLogger(__name__)


class SyncPeerGone(FileNotFoundError):
    """The actor that served this version no longer answers (a newer version exists, or will).

    A FileNotFoundError, as a pruned version is, so that rollouts treat both alike: read the store again."""


def _group(store: dist.Store, rank: int, device: torch.device, timeout: timedelta = TRANSFER_TIMEOUT) -> Any:
    """A two-rank process group over `store`'s prefix: NCCL for CUDA tensors, gloo for CPU ones.

    Built directly rather than through init_process_group, which allows one default group per process
    and would tie every rollout to one group (the module docstring says why pairs)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _waited(store: dist.Store, key: str, timeout: timedelta) -> bool:
    """Whether `key` appeared within `timeout` (False on timeout; other store errors propagate)."""
    try:
        store.wait([key], timeout)
    except dist.DistStoreError as exc:
        if "timeout" not in str(exc).lower():
            raise
        return False
    return True


@dataclass
class NcclWeightServer:
    """The actor's side: the snapshot ring, the rendezvous store, and one sender thread per rollout."""

    ring: int
    host: str = field(default_factory=lambda: os.environ.get(HOST_ENV, "127.0.0.1"))
    transfer_timeout: timedelta = TRANSFER_TIMEOUT  # spec.deadlines.collectiveSeconds
    _snapshots: SnapshotRing = field(init=False)
    _store: Any = None
    _producer: str = field(default_factory=lambda: uuid.uuid4().hex)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    # thread -> (store prefix, key) it waits for
    _awaited: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._snapshots = SnapshotRing(self.ring)

    def share(
        self,
        state: dict[str, torch.Tensor],
        dest: Path,
        version: int,
        step: int,
        gather: Gather | None = None,
        device: torch.device | None = None,
        cast: torch.dtype | None = None,
        adapters: dict[str, float] | None = None,
    ) -> Path:
        """Snapshot `state` and write `dest` (a version directory holding NCCL_FILE) atomically; `gather`,
        `device` and `cast`: a sharded actor's, as SnapshotRing.write takes them; `adapters`: `state` holds
        LoRA factors, and these are their modules' scales (mortal.workers.sync.weights.lora_adapters)."""
        buffers = self._snapshots.write(state, version, gather, device, cast)
        if self._store is None:
            self._open(next(iter(buffers.values())).device)
        manifest = {
            "version": version,
            "step": step,
            "adapters": adapters,
            "slots": self._snapshots.slots,
            "ring": self.ring,
            "address": (self.host, self._store.port),
            "producer": self._producer,
            "transfer_seconds": self.transfer_timeout.total_seconds(),
        }
        with atomic_dir(dest, durable=False) as tmp:  # GPU memory: nothing of it outlives a crash
            (tmp / NCCL_FILE).write_bytes(pickle.dumps(manifest))
        return dest

    def _open(self, device: torch.device) -> None:
        self._store = dist.TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=REPLY_TIMEOUT
        )
        self._store.set("producer", self._producer)
        self._start("nccl-accept", self._accept, device)

    def _start(self, name: str, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self, device: torch.device) -> None:
        pair = 0
        while not self._stop.is_set():
            if self._wait(self._store, f"join/{pair}") and self._store.get(f"join/{pair}").decode() != STOP:
                self._start(f"nccl-send-{pair}", self._serve, pair, device)
                pair += 1

    def _wait(self, store: dist.Store, key: str, prefix: str = "") -> bool:
        """_waited for IDLE_WAIT, noting first where this thread waits (`prefix`: its PrefixStore's),
        so that `close` can wake it."""
        self._awaited[threading.current_thread().name] = (prefix, key)
        return _waited(store, key, IDLE_WAIT)

    def _serve(self, pair: int, device: torch.device) -> None:
        """Answer one rollout's asks until it says bye (or the actor stops).

        On a connection of its own: a TCPStore client serves one call at a time, so threads sharing
        one would each wait behind another's blocking wait."""
        client = dist.TCPStore(self.host, self._store.port, is_master=False, timeout=REPLY_TIMEOUT)
        prefix = f"pair/{pair}/"
        store = dist.PrefixStore(prefix, client)
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with (
            torch.cuda.device(device) if stream else contextlib.nullcontext(),
            torch.cuda.stream(stream) if stream else contextlib.nullcontext(),
        ):
            group = _group(store, 0, device, self.transfer_timeout)
            ask = 0
            try:
                while not self._stop.is_set():
                    if not self._wait(store, f"ask/{ask}", prefix):
                        continue
                    wanted = store.get(f"ask/{ask}").decode()
                    if wanted == "bye":
                        return
                    self._send(store, group, ask, int(wanted))
                    ask += 1
            except (dist.DistError, RuntimeError) as exc:  # the rollout went away mid-conversation
                log.info("weight sender for rollout pair %d ends: %s", pair, exc)

    def _send(self, store: dist.Store, group: Any, ask: int, version: int) -> None:
        buffers = self._snapshots.holding(version)
        if buffers is None:
            store.set(f"reply/{ask}", "gone")
            return
        store.set(f"reply/{ask}", "send")
        for buffer in buffers.values():
            group.send([buffer], 1, 0).wait()

    def close(self) -> None:
        """Stop accepting and serving (the actor is exiting), waking each thread where it waits;
        idempotent."""
        self._stop.set()
        if self._store is not None:
            # a thread busy elsewhere ends at its next look
            with contextlib.suppress(dist.DistError, RuntimeError):
                waker = dist.TCPStore(self.host, self._store.port, is_master=False, timeout=REPLY_TIMEOUT)
                for prefix, key in list(self._awaited.values()):
                    # the key as the waiter's store names it
                    store = dist.PrefixStore(prefix, waker) if prefix else waker
                    store.compare_set(key, "", "bye" if prefix else STOP)  # never over a real ask or join
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()


@dataclass
class _Pair:
    """A rollout's end of its pair with one actor: the store client, the group, its receive buffers."""

    producer: str
    store: Any
    group: Any
    device: torch.device
    asks: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    views: ViewCache = field(default_factory=ViewCache)

    @classmethod
    def join(cls, manifest: dict[str, Any], device: torch.device) -> _Pair:
        host, port = manifest["address"]
        _check_listening(host, port)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=REPLY_TIMEOUT)
            if store.get("producer").decode() != manifest["producer"]:
                raise SyncPeerGone(
                    f"the actor at {host}:{port} is not the one that served version {manifest['version']}"
                )
            pair = store.add("joins", 1) - 1
            store.set(f"join/{pair}", str(os.getpid()))
        except dist.DistError as exc:
            raise SyncPeerGone(f"the actor's rendezvous at {host}:{port} does not answer ({exc})") from exc
        prefixed = dist.PrefixStore(f"pair/{pair}/", store)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            timeout = timedelta(seconds=manifest.get("transfer_seconds", TRANSFER_TIMEOUT.total_seconds()))
            group = _group(prefixed, 1, device, timeout)
        return cls(manifest["producer"], prefixed, group, device)

    def fetch(self, version: int, slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
        """Ask for `version` and receive its flat buffers (valid until the next fetch)."""
        sizes = sizes_of(slots)
        if {d: b.numel() for d, b in self.buffers.items()} != sizes:
            self.buffers = empty_buffers(sizes, self.device)
        ask, self.asks = self.asks, self.asks + 1
        try:
            self.store.set(f"ask/{ask}", str(version))
            if not _waited(self.store, f"reply/{ask}", REPLY_TIMEOUT):
                raise SyncPeerGone(
                    f"the actor did not answer the ask for version {version} in {REPLY_TIMEOUT}"
                )
            if self.store.get(f"reply/{ask}").decode() == "gone":
                raise FileNotFoundError(f"version {version} has left the actor's ring (a newer one exists)")
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                for buffer in self.buffers.values():
                    self.group.recv([buffer], 0, 0).wait()
        except dist.DistError as exc:
            raise SyncPeerGone(f"the actor went away while version {version} was asked for ({exc})") from exc
        return self.buffers

    def leave(self) -> None:
        with contextlib.suppress(dist.DistError, RuntimeError):
            self.store.set(f"ask/{self.asks}", "bye")


def _check_listening(host: str, port: int) -> None:
    """Fail at once when nothing listens at the address (TCPStore's client would retry for its timeout)."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        raise SyncPeerGone(f"the actor's rendezvous at {host}:{port} is gone ({exc})") from exc


class _Peer:
    """This process's one pair (a rollout loads from one actor at a time; a new actor means a new pair)."""

    current: _Pair | None = None

    @classmethod
    def for_manifest(cls, manifest: dict[str, Any], device: torch.device) -> _Pair:
        if cls.current is not None and (cls.current.producer, cls.current.device) == (
            manifest["producer"],
            device,
        ):
            return cls.current
        cls.drop()
        cls.current = _Pair.join(manifest, device)
        return cls.current

    @classmethod
    def drop(cls) -> None:
        if cls.current is not None:
            cls.current.leave()
            cls.current = None


atexit.register(_Peer.drop)


def receive(path: str | Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a served version, received from the actor onto `device` (views of this
    process's receive buffers, valid until the next receive). FileNotFoundError (SyncPeerGone when
    the actor is gone) when it cannot be had: a newer version exists, or will."""
    manifest = read_manifest(Path(path) / NCCL_FILE)
    pair = _Peer.for_manifest(manifest, device)
    try:
        buffers = pair.fetch(manifest["version"], manifest["slots"])
    except SyncPeerGone:
        _Peer.drop()
        raise
    return pair.views.get(buffers, manifest["slots"])


class NcclTransport(RingTransport):
    """Rollouts on GPUs of their own receive each version from the actor's ring over NCCL, when they ask."""

    method = "nccl"
    manifest_file = NCCL_FILE

    def _make_server(self) -> RingServer:
        return NcclWeightServer(ring=self.keep, transfer_timeout=timedelta(seconds=self.collective_seconds))

    def _tensors(self, path: str | Path, device: torch.device) -> dict[str, torch.Tensor]:
        return receive(path, device)

    def loaded_whole(self, path: str | Path, newest_recorded: Callable[[], int | None]) -> bool:
        newest = newest_recorded()  # the store's newest version says whether the slot may have been reused
        return newest is None or intact(*slot_version(self.manifest(path)), newest)
