"""Publishing weight versions: `volume` (safetensors on the shared volume) and, from a ring of
snapshots on the actor's GPU (mortal.workers.weight_ring), `ipc` (rollouts map it: ipc_weights) and
`nccl` (the actor sends it to each rollout: nccl_weights).

Called by the actor (`WeightPublisher.publish` after optimizer steps) and by rollout workers
(`load_published` / `read_published` when a new version is recorded in the store). The method is
`spec.sync_method()` (auto picks ipc for GPU rollouts on the actor's host, else volume); a rollout
needs no setting: a version directory says what it holds.

    $MORTAL_HOME/runs/<run>/weights/v<version>-i<actor incarnation>/
                                        model.safetensors   plain base-model tensor names
                                        adapter.safetensors LoRA runs: A and B of each adapted
                                                            module instead (a few MB, not GBs)
                                        config.json         so `from_pretrained(dir)` works too

With `ray` (Ray nodes sharing no disk) the directory is written the same way on the actor's node, then
its files go into Ray's object store (mortal.workers.ray_weights) and the row records where; a rollout
writes them into its own node's folder before loading them.

A version directory appears atomically (mortal.workers.atomic), then its row is written
(`store.publish_weights`), so a rollout that reads the store never sees a partial file. With plain
LoRA (the seeds' LoRA hot-swap mode) only the adapters travel, as files or as the ring's snapshot of
them (the manifest carries their scales): the rollout keeps the base weights of the adapted modules and
writes base + B @ A * scale into its model in place (`apply_adapters`); on a network volume (Modal) a
version is a file every rollout reads, and a ring of merged models would hold three whole copies. Any
other adapter (DoRA, biases, embeddings, modules_to_save) is merged out of place instead (base + B @
A * scale computed into new tensors; the training model is never modified, so publishing cannot
perturb training) and written under the base model's own names. Tied tensors (embeddings / lm_head)
are written once.
It must not decide when to publish (the actor does) nor touch the task queue.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mortal.specs.deadlines import DEFAULT_COLLECTIVE_SECONDS
from mortal.state import paths
from mortal.state.containment import PathOutside, inside, report_refused
from mortal.state.store import Store, WorkerRef
from mortal.workers.atomic import atomic_dir, remove_stale_tmp, sweep, volume_refresh
from mortal.workers.sync import (
    ipc as ipc_weights,
)
from mortal.workers.sync import (
    nccl as nccl_weights,
)
from mortal.workers.sync import (
    ray as ray_weights,
)
from mortal.workers.sync import (
    ring as weight_ring,
)
from mortal.workers.sync.ring import Gather

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter.safetensors"
KEEP_VERSIONS = 3
RING_METHODS = ("ipc", "nccl")  # a version is a slot of the actor's snapshot ring (mortal.workers.weight_ring)
log = logging.getLogger("mortal.weights")
_PEFT_MARKERS = ("lora_", "modules_to_save", "original_module")


class WeightsError(RuntimeError):
    """Published weights do not fit the model that loads them (or a model cannot be published)."""


def version_dir(run: str, version: int, incarnation: int) -> Path:
    """A version's directory, named for the actor incarnation that writes it: a fenced actor still
    writing cannot replace its successor's files (it can only leave a directory no row points to,
    which `prune` sweeps), so a publish needs no fence check of its own before it writes."""
    return paths.weights_dir(run) / f"v{version}-i{incarnation}"


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the base model's names, LoRA merged out of place, ties written once."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state = {_clean_name(k): v.detach() for k, v in base.state_dict().items() if not _is_adapter_key(k)}
    for name, module in base.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "get_delta_weight"):
            state[f"{name}.weight"] = _merged_weight(module)
    leftovers = [k for k in state if any(m in k for m in _PEFT_MARKERS)]
    if leftovers:
        raise WeightsError(f"cannot publish adapter tensors as plain weights: {leftovers[:3]}")
    return _drop_shared(state)


def _is_adapter_key(key: str) -> bool:
    return ".lora_" in key  # lora_A / lora_B / lora_embedding_* / lora_magnitude_vector


def _clean_name(key: str) -> str:
    return key.replace(".base_layer.", ".")


def _merged_weight(module: Any) -> torch.Tensor:
    """base weight + each active, unmerged adapter's delta, as a new tensor (vanilla LoRA only)."""
    weight = module.get_base_layer().weight.detach()
    merged = weight.clone()
    for adapter in module.active_adapters:
        if adapter not in module.lora_A or adapter in getattr(module, "merged_adapters", []):
            continue
        if adapter in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(adapter):
            raise WeightsError(f"adapter {adapter!r} is not plain LoRA; only plain LoRA can be published merged")
        merged += module.get_delta_weight(adapter).detach().to(weight.dtype)
    return merged


def _drop_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that share storage (tied weights); safetensors refuses aliases."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def tied_once(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as it holds it (keep_vars: its Parameters, a sharded model's DTensor shards), a
    tensor the model ties (one Parameter under two names) under its first name only."""
    seen: set[int] = set()
    first = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            first[name] = tensor
    return first


def _drop_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of each tensor the model ties: a gathered state has a copy per name, so
    storage cannot tell them apart as it does in _drop_shared."""
    first = tied_once(model)
    return {name: tensor for name, tensor in state.items() if name in first}


def write_weights(model: torch.nn.Module, dest: Path, version: int, step: int,
                  state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `dest` (a version directory) atomically; returns it. `state`: the weights, already full
    tensors (a sharded actor's, gathered by mortal.workers.sharded.full_state_dict), else the model's."""
    state = plain_state_dict(model) if state is None else _drop_tied(model, state)
    state = {name: tensor.to("cpu").contiguous() for name, tensor in state.items()}
    config = model_config(model)
    with atomic_dir(dest) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "version": str(version), "step": str(step)})
        if config is not None:
            config.save_pretrained(tmp)
    return dest


def lora_adapters(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, float]] | None:
    """Plain LoRA's factors under the base model's module names (`<module>.lora_A` / `.lora_B`) and
    each module's scale; None when there is no adapter, or one a rollout could not apply as
    base + B @ A * scale (then the version is published merged)."""
    if not hasattr(model, "get_base_model"):
        return None
    base = model.get_base_model()
    if any("modules_to_save" in key or "original_module" in key for key in base.state_dict()):
        return None
    tensors, scales = {}, {}
    for name, module in base.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        factors = _plain_lora(module)
        if factors is None:
            return None
        tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], scales[name] = factors
    return (tensors, scales) if tensors else None


def _plain_lora(module: Any) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scale) of a Linear layer's one active, unmerged, plain LoRA adapter; else None."""
    active = [a for a in module.active_adapters if a in module.lora_A]
    plain = (len(active) == 1 and not getattr(module, "merged_adapters", []) and not getattr(module, "lora_variant", {})
             and not any(getattr(module, "lora_bias", {}).values()) and not getattr(module, "fan_in_fan_out", False)
             and not getattr(module, "lora_embedding_A", {}) and isinstance(module.get_base_layer(), torch.nn.Linear))
    if not plain:
        return None
    adapter = active[0]
    return module.lora_A[adapter].weight.detach(), module.lora_B[adapter].weight.detach(), float(module.scaling[adapter])


def write_adapters(model: torch.nn.Module, adapters: tuple[dict[str, torch.Tensor], dict[str, float]], dest: Path,
                   version: int, step: int) -> Path:
    """Write `dest` (a version directory of LoRA factors) atomically; returns it."""
    tensors, scales = adapters
    state = {name: tensor.to("cpu").contiguous() for name, tensor in tensors.items()}
    config = model_config(model)
    metadata = {"format": "pt", "version": str(version), "step": str(step), "scales": json.dumps(scales)}
    with atomic_dir(dest) as tmp:
        save_file(state, str(tmp / ADAPTER_FILE), metadata=metadata)
        if config is not None:
            config.save_pretrained(tmp)
    return dest


def is_adapter_version(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_FILE).is_file()


def read_adapters(path: str | Path, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The factors and scales of an adapter version."""
    from safetensors import safe_open

    file = str(Path(path) / ADAPTER_FILE)
    with safe_open(file, framework="pt", device=device) as handle:
        scales = json.loads(handle.metadata()["scales"])
        return {name: handle.get_tensor(name) for name in handle.keys()}, scales  # noqa: SIM118 (not a dict)


def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """base + B @ A * scale, as peft's merge computes it (in float32 where the weights are half precision)."""
    delta = (lora_b.float() @ lora_a.float()) * scale if base.dtype != torch.float32 else (lora_b @ lora_a) * scale
    return base + delta.to(base.dtype)


@torch.no_grad()
def apply_adapters(model: torch.nn.Module, path: str | Path, tensors: dict[str, torch.Tensor],
                   scales: dict[str, float]) -> None:
    """Write base + B @ A * scale into each adapted weight of a plain (rollout) model, in place, from the
    factors of version `path` (read from its file, or views of the actor's ring).

    The base weights are those the model held when it first applied an adapter version (a rollout
    starts from spec.model, which is the base); they are kept for the adapted modules only.
    WeightsError when the adapters do not fit the model."""
    params = dict(model.named_parameters())
    base = model.__dict__.setdefault("_mortal_lora_base", {})
    for module, scale in scales.items():
        name = f"{module}.weight"
        lora_a, lora_b = tensors[f"{module}.lora_A"], tensors[f"{module}.lora_B"]
        if name not in params or tuple(params[name].shape) != (lora_b.shape[0], lora_a.shape[1]):
            raise WeightsError(f"{path}: the adapter of {module!r} does not fit the model "
                               f"({tuple(params[name].shape) if name in params else 'no such weight'})")
        if name not in base:
            if model.__dict__.get("_mortal_full_loaded"):
                raise WeightsError(f"{path}: an adapter version after full weights; the base of {module!r} is "
                                   "gone from memory (a relaunched rollout starts from the base model)")
            base[name] = params[name].detach().clone()
        params[name].copy_(merged_weight(base[name], lora_a, lora_b, scale))


def model_config(model: torch.nn.Module) -> Any:
    return getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "config", None)


def read_published(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a published version (a version directory or its model.safetensors)."""
    path = Path(path)
    if not path.exists():
        volume_refresh()  # published from another container since this one mounted the volume
    return load_file(str(path / WEIGHTS_FILE if path.is_dir() else path), device=device)


def load_published(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a published version (on the volume, or shared over CUDA IPC) into `model` in place;
    WeightsError unless every weight is covered. Tensors a version leaves out must be tied to one it
    has (lm_head to the embeddings)."""
    device = next(model.parameters()).device
    if is_adapter_version(path):
        apply_adapters(model, path, *read_adapters(path, device=str(device)))
        return
    if ipc_weights.is_shared(path):
        state, scales = ipc_weights.open_shared(path, device), ipc_weights.adapter_scales(path)
    elif nccl_weights.is_served(path):
        state, scales = nccl_weights.receive(path, device), nccl_weights.adapter_scales(path)
    else:
        state, scales = read_published(path, device=str(device)), None
    if scales is not None:  # LoRA factors from the actor's ring
        apply_adapters(model, path, state, scales)
        return
    model.__dict__["_mortal_full_loaded"] = True
    weight_ring.copy_pairs(_destinations(model, state, path), list(state.values()))


def _destinations(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> list[torch.Tensor]:
    """The model's own tensors that `state`'s go into, in its order; WeightsError unless they fit.
    Checked once per set of names and kept on the model: a rollout's model and a run's published
    names do not change, and the check and state_dict cost milliseconds a load need not spend."""
    names = list(state)
    planned = model.__dict__.get("_mortal_load_plan")
    if planned is not None and planned[0] == names and all(
            tuple(t.shape) == tuple(d.shape) for t, d in zip(state.values(), planned[1], strict=True)):
        return planned[1]
    current = model.state_dict()
    unexpected = sorted(set(state) - set(current))
    if unexpected:
        raise WeightsError(f"{path}: tensors the model does not have: {unexpected[:5]}")
    wrong = [n for n, t in state.items() if tuple(t.shape) != tuple(current[n].shape)]
    if wrong:
        raise WeightsError(f"{path}: shapes differ from the model's for {wrong[:5]}")
    loaded = {_ptr(t) for name, t in current.items() if name in state}
    untied = [name for name in current if name not in state and _ptr(current[name]) not in loaded]
    if untied:
        raise WeightsError(f"{path}: weights missing from the file: {sorted(untied)[:5]}")
    destinations = [current[name] for name in names]
    model.__dict__["_mortal_load_plan"] = (names, destinations)
    return destinations


def loaded_whole(path: str | Path, newest_recorded: Callable[[], int | None]) -> bool:
    """Whether the version just loaded from `path` was read whole (weight_ring says why it may not
    be). A version on the volume always is: nothing overwrites it. From the ring over ipc the slot's
    stamp says (no store query); over nccl the newest version the store records does
    (`newest_recorded`, asked only then)."""
    if ipc_weights.is_shared(path):
        return ipc_weights.slot_holds(path)
    if nccl_weights.is_served(path):
        newest = newest_recorded()
        return newest is None or weight_ring.intact(*nccl_weights.manifest_version(path), newest)
    return True


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


# Parameter registrations in this process (any module's); WeightPublisher._plain's kept state is
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


@dataclass
class WeightPublisher:
    """The actor's side of weight sync: write or share a version, record it, keep the newest few."""

    store: Store
    worker: WorkerRef
    keep: int = KEEP_VERSIONS
    method: str = "volume"  # or "ray", "ipc", "nccl" (spec.sync_method())
    steps: dict[int, int] = field(default_factory=dict)  # version -> the step its weights are from
    provenance: Callable[[int], dict[str, Any]] | None = None  # what made the weights of a step (workers.provenance)
    collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS  # spec.deadlines.collectiveSeconds (nccl transfers)

    def __post_init__(self) -> None:
        self._sharer: Any = None  # the ring's server (ipc or nccl), made at the first publish
        self._last_version: int | None = None  # the last version this publisher recorded
        self._plain_state: _KeptState | None = None
        self._hub_checked = 0.0  # time.monotonic() of the last ensure_held look at the hub (sync ray)

    def _ring_server(self) -> Any:
        if self._sharer is None:
            server = ipc_weights.IpcWeightSharer if self.method == "ipc" else nccl_weights.NcclWeightServer
            self._sharer = server(ring=self.keep) if self.method == "ipc" else server(
                ring=self.keep, transfer_timeout=timedelta(seconds=self.collective_seconds))
        return self._sharer

    def close(self) -> None:
        """Stop serving versions (nccl's threads); the actor calls it as it exits."""
        if isinstance(self._sharer, nccl_weights.NcclWeightServer):
            self._sharer.close()

    @property
    def run(self) -> str:
        return self.worker.run

    def next_version(self) -> int:
        """One more than any version ever recorded for the run (versions never go backwards). Asked of
        the store once: after that only this publisher records versions (another incarnation would
        have fenced it, and its record would fail)."""
        if self._last_version is not None:
            return self._last_version + 1
        latest = self.store.latest_weights(self.run)
        return 0 if latest is None else latest.version + 1

    def clear_partial(self) -> None:
        """Remove temporary directories left by an actor that died mid-write (call at start)."""
        remove_stale_tmp(paths.weights_dir(self.run))

    def publish(self, model: torch.nn.Module, step: int, version: int | None = None, prune: bool = True,
                state: dict[str, torch.Tensor] | None = None, gather: Gather | None = None,
                device: torch.device | None = None, cast: torch.dtype | None = None) -> int:
        """Write (or share), record and (unless `prune` is False: the actor prunes while it waits for
        rollouts, off the path a new version takes to them) prune; returns the version published.
        `state`: a sharded actor's weights, gathered to full CPU tensors for the files of volume and ray, or
        its shards for the ring of ipc and nccl, with the `gather` that makes each whole, the ring's
        `device` and the dtype `cast` the gather yields floating weights in (mortal.workers.sharded.publish_state
        says which)."""
        version = self.next_version() if version is None else version
        dest = version_dir(self.run, version, self.worker.incarnation)
        adapters = lora_adapters(model) if state is None else None
        if state is not None and self.method in RING_METHODS:
            if gather is None:
                raise WeightsError("a sharded actor's shards reach the ring only through a gather")
            self._ring_server().share(state, dest, version, step, gather=gather, device=device, cast=cast)
        elif state is not None:
            write_weights(model, dest, version, step, state=state)
        elif self.method in RING_METHODS and adapters is not None:  # the ring holds the factors alone
            self._ring_server().share(adapters[0], dest, version, step, adapters=adapters[1])
        elif self.method in RING_METHODS:
            self._ring_server().share(self._plain(model), dest, version, step)  # no config.json: it delays the record
        elif adapters is not None:
            write_adapters(model, adapters, dest, version, step)
        else:
            write_weights(model, dest, version, step)
        where = str(dest)
        if self.method == "ray":  # the object store holds it now: this node's folder is not read again
            where = ray_weights.share(dest, self.worker.incarnation)
            shutil.rmtree(dest, ignore_errors=True)
        made_by = self.provenance(step) if self.provenance is not None else None
        self.store.publish_weights(self.worker, version, step, where, method=self.method, provenance=made_by)
        self._last_version = version
        self.steps[version] = step
        if prune:
            self.prune()
        return version

    def ensure_held(self) -> None:
        """sync ray, while the actor waits for rollouts: if the hub lost the versions this publisher recorded
        (its actor died while this one lives), put them back (mortal.workers.ray_weights.ensure_held); at
        most every ray_weights.HUB_CHECK_SECONDS. Without it a rollout waiting for the newest version
        would ask for it forever, and the actor would wait forever for that rollout."""
        if self.method != "ray" or time.monotonic() - self._hub_checked < ray_weights.HUB_CHECK_SECONDS:
            return
        self._hub_checked = time.monotonic()
        put_back = ray_weights.ensure_held(self.worker.incarnation)
        if put_back:
            log.warning("the weights hub had lost the versions %s (its Ray actor ended); made it again and put "
                        "them back", ", ".join(put_back))

    def _plain(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """plain_state_dict, kept between publishes of a model without adapters: its tensors are the
        parameters themselves (the optimizer updates them in place), and building the dict costs
        2-4 ms per publish. Built again for another model, after any parameter was registered in
        this process (a module's parameter replaced), or when a kept parameter's storage moved
        (`.data` replaced, as `model.to` does): what is checked costs microseconds, where walking
        the model's modules again costs about a millisecond on a slow host."""
        if hasattr(model, "get_base_model"):  # LoRA: merged weights are new tensors each time
            return plain_state_dict(model)
        kept = self._plain_state
        if (kept is None or kept.model is not model or kept.registrations != _registrations[0]
                or any(p.data_ptr() != ptr for p, ptr in kept.storages)):
            kept = self._plain_state = _KeptState(model, _registrations[0],
                                                  [(p, p.data_ptr()) for p in model.parameters()],
                                                  plain_state_dict(model))
        return kept.state

    def step_of(self, version: int) -> int:
        """The optimizer step whose result `version` is (asked of the store for older versions)."""
        if version not in self.steps:
            for row in self.store.list_weights(self.run):
                self.steps.setdefault(row.version, row.step)
        return self.steps[version]

    def prune(self) -> None:
        """Delete all but the newest `keep` versions: row first (rollouts stop choosing it), then files.

        A queued task needs a version >= its min_weight_version, which the newest always satisfies,
        so no task needs an older one; `keep` > 1 leaves time for a rollout loading one just replaced.
        """
        rows = sorted(self.store.list_weights(self.run), key=lambda row: row.version)
        retired = rows[: max(0, len(rows) - self.keep)]
        for row in retired:
            self.store.delete_weights(self.worker, row.version)
            if ray_weights.is_hub_path(row.path):  # the hub drops its own (ray_weights.KEEP)
                continue
            try:
                shutil.rmtree(inside(paths.weights_dir(self.run), row.path), ignore_errors=True)
            except PathOutside as exc:  # a row pointing outside the run's weights: never followed
                log.warning("not removing weight version %d: %s", row.version, exc)
                report_refused(self.store, self.run, f"pruning weight version {row.version}", exc)
        if self.method != "ray":  # (with ray, the folder holds what rollouts of this node received)
            sweep(paths.weights_dir(self.run), {row.path for row in rows[len(retired):]})
