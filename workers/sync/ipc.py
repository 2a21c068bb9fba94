"""Weight sync `ipc`: a version is a slot of the actor's snapshot ring that rollouts copy over CUDA IPC.

    weights/v<version>-i<incarnation>/ipc.pkl   the slot's layout, and a CUDA IPC handle per flat buffer

Only processes that see the actor's GPU can open the handles: rollouts colocated with the actor, and
rollouts on GPUs of their own that the local backend shows the actor's GPU too (MORTAL_GPU_PEERS). The
manifest names that GPU by UUID; a rollout that does not see it (the actor was relaunched onto another)
exits with ActorGpuNotVisible, and the controller relaunches it next to the actor's new GPU.
What it must not do: write tensor data to disk, or modify the training model.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mortal.workers.atomic import atomic_dir
from mortal.workers.sync.base import Gather
from mortal.workers.sync.ring import RingServer, RingTransport, SnapshotRing, ViewCache, read_manifest, views

IPC_FILE = "ipc.pkl"
DEVICE_ARG = 6  # position of `storage_device` in torch.multiprocessing.reductions.rebuild_cuda_tensor's args


# This process's own rings, by producer: a rollout thread in the actor's process (tests, a future
# single-process mode) reads them directly, as CUDA cannot open an IPC handle in the process that made it.
_OWN_RINGS: dict[str, SnapshotRing] = {}


class ActorGpuNotVisible(RuntimeError):
    """This process cannot see the GPU that holds the shared weights (it must be relaunched)."""


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid` (CUDA_VISIBLE_DEVICES renumbers devices)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ActorGpuNotVisible(
        f"the actor's GPU {uuid} is not among this process's {torch.cuda.device_count()} "
        "visible GPUs; a relaunch shows it the actor's current GPU"
    )


@dataclass
class IpcWeightSharer:
    """The actor's side: the snapshot ring, and for each version a manifest of the ring's IPC handles."""

    ring: int
    _snapshots: SnapshotRing = field(init=False)

    def __post_init__(self) -> None:
        self._snapshots = SnapshotRing(self.ring)
        self._handles: dict[int, Any] = {}  # data_ptr -> IPC handle, for the ring's current allocation
        # that allocation (SnapshotRing.buffers)
        self._handles_for: list[dict[str, torch.Tensor]] | None = None

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
        """Snapshot `state` and write `dest` (a version directory holding IPC_FILE) atomically; `gather`,
        `device` and `cast`: a sharded actor's, as SnapshotRing.write takes them; `adapters`: `state` holds
        LoRA factors, and these are their modules' scales (mortal.workers.sync.weights.lora_adapters)."""
        buffers = self._snapshots.write(state, version, gather, device, cast)
        handles = {dtype: self._handle(buffer) for dtype, buffer in buffers.items()}
        device = next(iter(buffers.values())).device.index
        producer = f"{os.getpid()}@{device_uuid(device)}"
        _OWN_RINGS[producer] = self._snapshots
        manifest = {
            "version": version,
            "step": step,
            "adapters": adapters,
            "slots": self._snapshots.slots,
            "handles": handles,
            "stamps": self._handle(self._snapshots.stamps),
            "ring": self.ring,
            "producer": producer,
            "device_uuid": device_uuid(device),
        }
        with atomic_dir(dest, durable=False) as tmp:  # GPU memory: nothing of it outlives a crash
            (tmp / IPC_FILE).write_bytes(pickle.dumps(manifest))
        return dest

    def _handle(self, tensor: torch.Tensor) -> Any:
        """The IPC handle of one of the ring's tensors (a slot's buffer, the stamps), made once: a slot
        is reused every `ring` versions, and each new handle costs a shared-memory reference counter
        and an IPC event in torch, which a rollout that mapped the tensor once never needs again."""
        from torch.multiprocessing.reductions import reduce_tensor

        if self._handles_for is not self._snapshots.buffers:  # the ring was allocated again (a new model)
            self._handles, self._handles_for = {}, self._snapshots.buffers
        if tensor.data_ptr() not in self._handles:
            self._handles[tensor.data_ptr()] = reduce_tensor(tensor)
        return self._handles[tensor.data_ptr()]

    def close(self) -> None:
        """Nothing to stop: rollouts map the ring themselves, and the memory goes with this process."""


class _Mappings:
    """This process's open mappings of one producer's buffers, kept so each is opened only once, with
    the views of them, and the buffers they are copied into when the rollout's GPU is another."""

    producer: str | None = None
    buffers: dict[tuple, torch.Tensor] = {}
    staging: dict[str, torch.Tensor] = {}
    views = ViewCache()

    @classmethod
    def get(cls, producer: str, handle: tuple, open_buffer: Any) -> torch.Tensor:
        """`handle`: the allocation's IPC handle, size and offset (one allocation may hold several)."""
        if producer != cls.producer:  # a relaunched actor: its predecessor's memory is gone
            cls.producer, cls.buffers, cls.staging, cls.views = producer, {}, {}, ViewCache()
        if handle not in cls.buffers:
            cls.buffers[handle] = open_buffer()
        return cls.buffers[handle]

    @classmethod
    def on_device(
        cls, buffers: dict[str, torch.Tensor], device: torch.device | None
    ) -> dict[str, torch.Tensor]:
        """The buffers, copied (one transfer per dtype, into buffers kept for the next load) when
        `device` is another GPU than theirs."""
        if device is None or device.type != "cuda" or all(b.device == device for b in buffers.values()):
            return buffers
        for dtype, buffer in buffers.items():
            staged = cls.staging.get(dtype)
            if staged is None or staged.numel() != buffer.numel() or staged.device != device:
                cls.staging[dtype] = staged = torch.empty_like(buffer, device=device)
            staged.copy_(buffer)
        return {dtype: cls.staging[dtype] for dtype in buffers}


def open_shared(path: str | Path, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a shared version: mapped from the actor's GPU (no copy), or, when `device` is
    another GPU, one copy of each flat buffer there (one large transfer rather than one per tensor).
    FileNotFoundError when the actor that shared them is gone (a newer version exists, or will)."""
    manifest = read_manifest(Path(path) / IPC_FILE)
    source = local_index(manifest["device_uuid"])
    own = _OWN_RINGS.get(manifest["producer"])
    if own is not None:
        return views(own.buffers[manifest["version"] % manifest["ring"]], manifest["slots"], device)
    buffers = {
        dtype: _mapped(path, manifest, handle, source) for dtype, handle in manifest["handles"].items()
    }
    return _Mappings.views.get(_Mappings.on_device(buffers, device), manifest["slots"])


def slot_holds(path: str | Path) -> bool:
    """Whether the ring slot of the version at `path` holds that version now; asked after a load's
    copy finished, True means no write of a newer version overlapped it (SnapshotRing.stamps). One
    8-byte read from the actor's GPU, where the store's ring check (ring.intact) is a query."""
    manifest = read_manifest(Path(path) / IPC_FILE)
    index = manifest["version"] % manifest["ring"]
    own = _OWN_RINGS.get(manifest["producer"])
    stamps = (
        own.stamps
        if own is not None
        else _mapped(path, manifest, manifest["stamps"], local_index(manifest["device_uuid"]))
    )
    return int(stamps[index]) == manifest["version"]


def _mapped(path: str | Path, manifest: dict[str, Any], handle: tuple, source: int) -> torch.Tensor:
    """The actor's tensor behind an IPC handle, opened once in this process (on the actor's GPU)."""
    rebuild, args = handle
    try:
        return _Mappings.get(
            manifest["producer"],
            args[DEVICE_ARG + 1 : DEVICE_ARG + 4],
            lambda: rebuild(*_on_device(args, source)),
        )
    except RuntimeError as exc:  # cudaIpcOpenMemHandle failed: the sharing process has exited
        raise FileNotFoundError(f"{path}: the shared weights can no longer be opened ({exc})") from exc


def _on_device(args: tuple, device: int) -> tuple:
    """The rebuild arguments with the actor's device index replaced by this process's index of it."""
    return (*args[:DEVICE_ARG], device, *args[DEVICE_ARG + 1 :])


class IpcTransport(RingTransport):
    """Rollouts on GPUs that see the actor's copy each version from its ring over CUDA IPC."""

    method = "ipc"
    manifest_file = IPC_FILE

    def _make_server(self) -> RingServer:
        return IpcWeightSharer(ring=self.keep)

    def _tensors(self, path: str | Path, device: torch.device) -> dict[str, torch.Tensor]:
        return open_shared(path, device)

    def loaded_whole(self, path: str | Path, newest_recorded: Callable[[], int | None]) -> bool:
        return slot_holds(path)  # the slot's own stamp says, with no store query
