"""The actor's ring of weight snapshots on its GPU, which the in-memory transports (ipc, nccl) serve from.

Why a snapshot and not the training tensors: with maxStaleness > 0 the actor trains while rollouts load,
so a rollout reading the live parameters could copy half an optimizer step. Why a ring of a few
snapshots: its buffers are allocated once, so a rollout maps (ipc) or a peer registers (nccl) them once.
Why reading a slot is safe: version v goes into slot v % ring, next written for v + ring, which starts
only after v + ring - 1 is recorded; so a read of v that ends while the newest recorded version is below
v + ring - 1 was whole (`intact`), and otherwise the rollout loads again.
What it must not do: modify the training model, or touch the store (the publisher records versions).
"""

from __future__ import annotations

import abc
import functools
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from mortal.workers.sync.base import Gather, WeightsError, WeightTransport
from mortal.workers.sync.weights import apply_adapters, load_state, lora_adapters, plain_state_dict


class TensorSlot(NamedTuple):
    """Where one named tensor lives inside its dtype's flat buffer. A named tuple, not a dataclass:
    every manifest carries a few hundred, which a rollout unpickles at each load, and a tuple is
    rebuilt from its fields without a per-object state dict."""

    name: str
    dtype: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def kept_dtype(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a snapshot keeps `tensor` in: `cast` for a floating tensor when given (a sharded actor
    publishing float32 masters in bfloat16), else its own (integer buffers keep theirs)."""
    return cast if cast is not None and tensor.is_floating_point() else tensor.dtype


def layout(
    state: dict[str, torch.Tensor], cast: torch.dtype | None = None
) -> tuple[dict[str, int], list[TensorSlot]]:
    """Where each tensor goes: the element count of each dtype's flat buffer, and every tensor's slot; with
    `cast`, floating tensors go in that dtype's buffer (a sharded actor publishing float32 masters in
    bfloat16)."""
    sizes: dict[str, int] = {}
    slots = []
    for name, tensor in state.items():
        dtype = str(kept_dtype(tensor, cast)).removeprefix("torch.")
        slots.append(TensorSlot(name, dtype, sizes.get(dtype, 0), tuple(tensor.shape)))
        sizes[dtype] = sizes.get(dtype, 0) + tensor.numel()
    return sizes, slots


def sizes_of(slots: list[TensorSlot]) -> dict[str, int]:
    """Each dtype's flat buffer length, from the slots alone (what a receiver allocates)."""
    sizes: dict[str, int] = {}
    for slot in slots:
        sizes[slot.dtype] = max(sizes.get(slot.dtype, 0), slot.offset + slot.numel)
    return sizes


def empty_buffers(sizes: dict[str, int], device: torch.device | str) -> dict[str, torch.Tensor]:
    return {dtype: torch.empty(n, dtype=getattr(torch, dtype), device=device) for dtype, n in sizes.items()}


@torch.no_grad()
def fill_views(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """destinations[i] <- sources[i] in one fused copy, not waited for: how a ring slot is written,
    into views of the slot made once (bench/sync_parts.py times it)."""
    torch._foreach_copy_(destinations, sources)


def snapshot(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[TensorSlot]]:
    """A copy of `state` in new flat buffers (one per dtype); returns buffers and slots."""
    sizes, slots = layout(state)
    buffers = empty_buffers(sizes, next(iter(state.values())).device)
    fill_views(list(views(buffers, slots).values()), [state[slot.name] for slot in slots])
    return buffers, slots


def views(
    buffers: dict[str, torch.Tensor], slots: list[TensorSlot], device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Each named tensor as a view of its flat buffer, moved first (one transfer per dtype) when
    `device` is another GPU than the buffers'."""
    if device is not None and device.type == "cuda":
        buffers = {dtype: buffer.to(device) for dtype, buffer in buffers.items()}  # no-op on the same GPU
    return {
        slot.name: buffers[slot.dtype][slot.offset : slot.offset + slot.numel].view(slot.shape)
        for slot in slots
    }


class ViewCache:
    """Views of flat buffers made once per (buffers, layout) and reused on every later load: making a
    model's few hundred views costs more Python time than the copy itself. Owned by what owns
    the buffers (ipc's mappings of one actor, nccl's pair), so the views never outlive them."""

    SIZE = 9  # the largest ring's slots (spec.sync.keepVersions, at most 8) and one more

    def __init__(self) -> None:
        self._entries: list[tuple[tuple, list[TensorSlot], dict[str, torch.Tensor]]] = []

    def get(self, buffers: dict[str, torch.Tensor], slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
        key = tuple(
            (dtype, buffer.data_ptr(), buffer.numel(), buffer.device) for dtype, buffer in buffers.items()
        )
        for entry_key, entry_slots, made in self._entries:
            if entry_key == key and entry_slots == slots:  # list equality: cheaper than hashing the slots
                return made
        made = views(buffers, slots)
        self._entries = [*self._entries[1 - self.SIZE :], (key, slots, made)]
        return made


def read_manifest(file: Path) -> dict[str, Any]:
    """A version's manifest (ipc, nccl), parsed once per file: a load reads it, and the ring check
    after the load reads it again. A manifest never changes once its directory appears (a version
    directory is written once, by one incarnation); the key has the inode and mtime all the same, so
    a directory replaced by a writer's retry is read afresh. Callers must not modify what it returns."""
    stat = os.stat(file)
    return _parsed_manifest(str(file), stat.st_ino, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed_manifest(file: str, inode: int, mtime_ns: int) -> dict[str, Any]:
    return pickle.loads(Path(file).read_bytes())


def adapter_scales(manifest: dict[str, Any]) -> dict[str, float] | None:
    """The LoRA scales a version's manifest records; None for a version of whole weights."""
    return manifest.get("adapters")


def slot_version(manifest: dict[str, Any]) -> tuple[int, int]:
    """(version, ring size) a version's manifest records."""
    return manifest["version"], manifest["ring"]


def intact(version: int, ring: int, newest_recorded: int) -> bool:
    """Whether a read of `version`'s slot, finished now, cannot have been overwritten, given the
    newest version the store records now (the ring rule in the module docstring)."""
    return newest_recorded < version + ring - 1


@dataclass
class SnapshotRing:
    """`ring` snapshots of one model's weights on its device; version v is written into slot v % ring."""

    ring: int
    slots: list[TensorSlot] | None = None
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    held: list[int | None] = field(default_factory=list)  # the version each slot holds
    # The same, on the ring's device, for readers in other processes (ipc's `slot_holds`): -1 while a
    # slot is written. Written in stream order around the slot's copy, so a reader that finds its
    # version here after its own copy finished read a slot no write overlapped (a seqlock).
    stamps: torch.Tensor | None = None
    # each slot's tensors, in slot order
    _views: list[list[torch.Tensor]] = field(default_factory=list, repr=False)
    # last layout
    _laid_out: tuple[Any, dict[str, int], list[TensorSlot]] = field(default=(None, {}, []), repr=False)

    def write(
        self,
        state: dict[str, torch.Tensor],
        version: int,
        gather: Gather | None = None,
        device: torch.device | None = None,
        cast: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """Snapshot `state` as `version` and wait until the copy is complete (so that no reader can
        see it half written once the caller records it); returns the slot's buffers.

        `gather` (a sharded actor's: `state` holds its FSDP2 shards) makes the tensors whole in `state`'s
        order, a bucket at a time, each copied into the slot as it comes, so the ring's device never holds
        a second whole model beside the slot; `device`: where the ring lives when it is not where
        `state`'s tensors are (shards offloaded to host memory); `cast`: the dtype floating weights are kept
        in when not theirs (the gather yields them so: mortal.workers.actor.sharded.publish_dtype)."""
        if state is not self._laid_out[0]:  # the publisher passes the same dict while the model is the same
            self._laid_out = (state, *layout(state, cast))
        _, sizes, slots = self._laid_out
        if slots != self.slots:  # first version (or a new model): allocate the ring
            device = device or next(iter(state.values())).device
            self.slots = slots
            self.buffers = [empty_buffers(sizes, device) for _ in range(self.ring)]
            self._views = [list(views(buffers, slots).values()) for buffers in self.buffers]
            self.held = [None] * self.ring
            self.stamps = torch.full((self.ring,), -1, dtype=torch.int64, device=device)
        index = version % self.ring
        self.held[index] = None  # being written: no longer the version it held
        self.stamps[index].fill_(-1)
        if gather is None:
            fill_views(self._views[index], [state[slot.name] for slot in slots])
        else:
            for view, tensor in zip(
                self._views[index], gather([state[slot.name] for slot in slots]), strict=True
            ):
                view.copy_(tensor)
        self.stamps[index].fill_(version)
        if self.stamps.is_cuda:
            torch.cuda.synchronize()
        self.held[index] = version
        return self.buffers[index]

    def holding(self, version: int) -> dict[str, torch.Tensor] | None:
        """The buffers of `version` if its slot still holds it (not yet reused for a newer one)."""
        index = version % self.ring
        return self.buffers[index] if self.held and self.held[index] == version else None


class RingServer(Protocol):
    """What serves a ring's versions to rollouts: ipc's sharer, nccl's server."""

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
    ) -> Path: ...

    def close(self) -> None: ...


# Parameter registrations in this process (any module's); RingTransport._plain's kept state is
# from before the last one or not. A global hook rather than a walk of the model at each publish.
_registrations = [0]


def _count_registration(module: torch.nn.Module, name: str, parameter: Any) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


@dataclass
class _KeptState:
    model: torch.nn.Module
    registrations: int
    storages: list[tuple[torch.Tensor, int]]  # each parameter and its data_ptr when the state was built
    state: dict[str, torch.Tensor]


class RingTransport(WeightTransport):
    """ipc and nccl: a version is a slot of the actor's snapshot ring, which a server hands to rollouts.
    A LoRA actor's ring holds the adapters' factors alone, which rollouts merge into their base weights."""

    in_ring = True
    manifest_file: ClassVar[str]  # the file in a version's folder that names its slot

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._server: RingServer | None = None  # made at the first publish
        self._plain_state: _KeptState | None = None

    @abc.abstractmethod
    def _make_server(self) -> RingServer:
        """The actor's server of the ring, for `self.keep` slots."""

    @abc.abstractmethod
    def _tensors(self, path: str | Path, device: torch.device) -> dict[str, torch.Tensor]:
        """The rollout's side: the version's tensors on `device`."""

    def manifest(self, path: str | Path) -> dict[str, Any]:
        """The manifest of the version at `path` (read_manifest: parsed once; callers must not modify it)."""
        return read_manifest(Path(path) / self.manifest_file)

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
        if self._server is None:
            self._server = self._make_server()
        if state is not None:
            if gather is None:
                raise WeightsError("a sharded actor's shards reach the ring only through a gather")
            self._server.share(state, dest, version, step, gather=gather, device=device, cast=cast)
        elif (adapters := lora_adapters(model)) is not None:  # the ring holds the factors alone
            self._server.share(adapters[0], dest, version, step, adapters=adapters[1])
        else:
            # no config.json: it delays the record
            self._server.share(self._plain(model), dest, version, step)
        return str(dest)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def load(self, model: torch.nn.Module, path: str | Path) -> None:
        state = self._tensors(path, next(model.parameters()).device)
        if (scales := adapter_scales(self.manifest(path))) is not None:  # LoRA factors
            apply_adapters(model, path, state, scales)
        else:
            load_state(model, path, state)

    def _plain(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """plain_state_dict, kept between publishes of a model without adapters: its tensors are the
        parameters themselves (the optimizer updates them in place), and building the dict costs more
        than a publish may spend. Built again for another model, after any parameter was registered in
        this process (a module's parameter replaced), or when a kept parameter's storage moved
        (`.data` replaced, as `model.to` does): what is checked is far cheaper than a walk of the model."""
        if hasattr(model, "get_base_model"):  # LoRA: merged weights are new tensors each time
            return plain_state_dict(model)
        kept = self._plain_state
        if (
            kept is None
            or kept.model is not model
            or kept.registrations != _registrations[0]
            or any(p.data_ptr() != ptr for p, ptr in kept.storages)
        ):
            kept = self._plain_state = _KeptState(
                model,
                _registrations[0],
                [(p, p.data_ptr()) for p in model.parameters()],
                plain_state_dict(model),
            )
        return kept.state
