"""Weight sync `ipc`: a version is a snapshot on the actor's GPU that rollouts on the same GPU copy from.

Called by the actor (`IpcWeightSharer.share`, through WeightPublisher when spec.sync resolves to
ipc) and by rollout workers (`load_shared`, through weights.load_published, when a version
directory holds IPC_FILE).

Why a snapshot and not the training tensors themselves: with maxStaleness > 0 the actor trains while
rollouts load, so a rollout reading the live parameters could copy half an optimizer step. The
snapshot is one device-to-device copy per version (about 1 ms for 0.8 GB on an H100) into a ring of
as many snapshots as the store keeps versions (IpcWeightSharer says why a ring and why it is safe).

    $MORTAL_HOME/runs/<run>/weights/v<version>/ipc.pkl   names, shapes, dtypes and offsets, and one
                                                          CUDA IPC handle per dtype's flat buffer

The directory appears atomically, as with `volume`, so a rollout never reads half a manifest. Only
processes that see the actor's GPU can open the handles: on the local backend, rollouts colocated
with the actor, and rollouts on GPUs of their own, which it shows the actor's GPU as well (after
their own: MORTAL_GPU_PEERS). The manifest names the actor's GPU by UUID; a rollout maps it to its
own device index and copies GPU to GPU (NVLink or PCIe). A rollout that does not see the actor's
GPU (the actor was relaunched onto another) exits with ActorGpuNotVisible, and the controller
relaunches it next to the actor's new GPU.
What it must not do: write tensor data to disk, or modify the training model.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mortal.workers.atomic import atomic_dir

IPC_FILE = "ipc.pkl"
DEVICE_ARG = 6  # position of `storage_device` in torch.multiprocessing.reductions.rebuild_cuda_tensor's args


# This process's own rings, by producer: a rollout thread in the actor's process (tests, a future
# single-process mode) reads them directly, as CUDA cannot open an IPC handle in the process that made it.
_OWN_RINGS: dict[str, list[dict[str, torch.Tensor]]] = {}


class ActorGpuNotVisible(RuntimeError):
    """This process cannot see the GPU that holds the shared weights (it must be relaunched)."""


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid` (CUDA_VISIBLE_DEVICES renumbers devices)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ActorGpuNotVisible(f"the actor's GPU {uuid} is not among this process's {torch.cuda.device_count()} "
                             "visible GPUs; a relaunch shows it the actor's current GPU")


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives inside its dtype's flat buffer."""

    name: str
    dtype: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def layout(state: dict[str, torch.Tensor]) -> tuple[dict[str, int], list[TensorSlot]]:
    """Where each tensor goes: the element count of each dtype's flat buffer, and every tensor's slot."""
    sizes: dict[str, int] = {}
    slots = []
    for name, tensor in state.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        slots.append(TensorSlot(name, dtype, sizes.get(dtype, 0), tuple(tensor.shape)))
        sizes[dtype] = sizes.get(dtype, 0) + tensor.numel()
    return sizes, slots


def fill(buffers: dict[str, torch.Tensor], state: dict[str, torch.Tensor], slots: list[TensorSlot]) -> None:
    """Copy `state` into the flat buffers, one concatenation per dtype."""
    for dtype, buffer in buffers.items():
        torch.cat([state[slot.name].detach().reshape(-1) for slot in slots if slot.dtype == dtype], out=buffer)


def snapshot(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[TensorSlot]]:
    """A copy of `state` in new flat buffers (one per dtype); returns buffers and slots."""
    sizes, slots = layout(state)
    device = next(iter(state.values())).device
    buffers = {dtype: torch.empty(n, dtype=getattr(torch, dtype), device=device) for dtype, n in sizes.items()}
    fill(buffers, state, slots)
    return buffers, slots


@dataclass
class IpcWeightSharer:
    """The actor's side: a ring of `ring` snapshots, version v written into slot v % ring.

    Why a ring, not a new snapshot per version: a rollout maps each buffer once (opening a CUDA IPC
    handle costs milliseconds) and reuses the mapping for every later version. Why it is safe: the
    slot of version v is next written for v + ring, which starts only after v + ring - 1 is recorded
    (one actor publishes in order), so a rollout that finished copying v while the newest recorded
    version was below v + ring - 1 read v whole (`intact`); otherwise it loads again."""

    ring: int
    _slots: list[TensorSlot] | None = None
    _buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def share(self, state: dict[str, torch.Tensor], dest: Path, version: int, step: int, config: Any = None) -> Path:
        """Write `dest` (a version directory holding IPC_FILE, and config.json) atomically."""
        from torch.multiprocessing.reductions import reduce_tensor

        sizes, slots = layout(state)
        if slots != self._slots:  # first version (or a new model): allocate the ring
            device = next(iter(state.values())).device
            self._slots = slots
            self._buffers = [{d: torch.empty(n, dtype=getattr(torch, d), device=device) for d, n in sizes.items()}
                             for _ in range(self.ring)]
        buffers = self._buffers[version % self.ring]
        fill(buffers, state, slots)
        torch.cuda.synchronize()  # the snapshot is complete before any rollout can read it
        handles = {dtype: reduce_tensor(buffer) for dtype, buffer in buffers.items()}
        device = next(iter(buffers.values())).device.index
        producer = f"{os.getpid()}@{device_uuid(device)}"
        _OWN_RINGS[producer] = self._buffers
        manifest = {"version": version, "step": step, "slots": slots, "handles": handles, "ring": self.ring,
                    "producer": producer, "device_uuid": device_uuid(device)}
        with atomic_dir(dest) as tmp:
            (tmp / IPC_FILE).write_bytes(pickle.dumps(manifest))
            if config is not None:
                config.save_pretrained(tmp)
        return dest


def is_shared(path: str | Path) -> bool:
    return (Path(path) / IPC_FILE).is_file()


def _manifest(path: str | Path) -> dict[str, Any]:
    return pickle.loads((Path(path) / IPC_FILE).read_bytes())


def intact(path: str | Path, newest_recorded: int) -> bool:
    """Whether a copy of the version at `path`, finished now, cannot have been overwritten (the
    IpcWeightSharer's ring rule) given the newest version the store records now."""
    manifest = _manifest(path)
    return newest_recorded < manifest["version"] + manifest["ring"] - 1


class _Mappings:
    """This process's open mappings of one producer's buffers, kept so each is opened only once."""

    producer: str | None = None
    buffers: dict[tuple, torch.Tensor] = {}

    @classmethod
    def get(cls, producer: str, handle: tuple, open_buffer: Any) -> torch.Tensor:
        """`handle`: the allocation's IPC handle, size and offset (one allocation may hold several)."""
        if producer != cls.producer:  # a relaunched actor: its predecessor's memory is gone
            cls.producer, cls.buffers = producer, {}
        if handle not in cls.buffers:
            cls.buffers[handle] = open_buffer()
        return cls.buffers[handle]


def open_shared(path: str | Path, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a shared version: mapped from the actor's GPU (no copy), or, when `device` is
    another GPU, one copy of each flat buffer there (one large transfer rather than one per tensor).
    FileNotFoundError when the actor that shared them is gone (a newer version exists, or will)."""
    manifest = _manifest(path)
    source = local_index(manifest["device_uuid"])
    own = _OWN_RINGS.get(manifest["producer"])
    if own is not None:
        return _views(own[manifest["version"] % manifest["ring"]], manifest["slots"], device)
    try:
        buffers = {dtype: _Mappings.get(manifest["producer"], args[DEVICE_ARG + 1: DEVICE_ARG + 4],
                                        lambda rebuild=rebuild, args=args: rebuild(*_on_device(args, source)))
                   for dtype, (rebuild, args) in manifest["handles"].items()}
    except RuntimeError as exc:  # cudaIpcOpenMemHandle failed: the sharing process has exited
        raise FileNotFoundError(f"{path}: the shared weights can no longer be opened ({exc})") from exc
    return _views(buffers, manifest["slots"], device)


def _views(buffers: dict[str, torch.Tensor], slots: list[TensorSlot], device: torch.device | None
           ) -> dict[str, torch.Tensor]:
    """Each named tensor as a view of its flat buffer, moved first (one transfer per dtype) when
    `device` is another GPU than the buffers'."""
    if device is not None and device.type == "cuda":
        buffers = {dtype: buffer.to(device) for dtype, buffer in buffers.items()}  # no-op on the same GPU
    return {slot.name: buffers[slot.dtype][slot.offset: slot.offset + slot.numel].view(slot.shape) for slot in slots}


def _on_device(args: tuple, device: int) -> tuple:
    """The rebuild arguments with the actor's device index replaced by this process's index of it."""
    return (*args[:DEVICE_ARG], device, *args[DEVICE_ARG + 1:])


@torch.no_grad()
def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
              current: dict[str, torch.Tensor] | None = None) -> None:
    """Copy mapped tensors into the model's own parameters in place (captured graphs keep working);
    `current`: the model's state_dict when the caller has it already (it is rebuilt otherwise)."""
    current = model.state_dict() if current is None else current
    pairs = [(current[name], tensor) for name, tensor in tensors.items()]
    torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
    if any(dst.is_cuda for dst, _ in pairs):
        torch.cuda.synchronize()  # done before the mapping is let go, and before the next task reads them
