"""Weight sync `volume`: each version is a folder of safetensors files in the run's weights folder.

    $MORTAL_HOME/runs/<run>/weights/v<version>-i<actor incarnation>/
        model.safetensors     the base model's tensor names, or, for plain LoRA,
        adapter.safetensors   each adapted module's A and B (and their scales) instead
        config.json           so that `from_pretrained(folder)` works too

A folder appears whole (mortal.workers.atomic) before its row is recorded, so a rollout that reads the
store never sees a partial file. On a network volume (Modal) a version is a file every rollout reads.
`ray` writes the same folder and moves it through Ray's object store (mortal.workers.sync.ray).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mortal.workers.atomic import atomic_dir, volume_refresh
from mortal.workers.sync.base import Gather, WeightTransport
from mortal.workers.sync.weights import (
    apply_adapters,
    drop_tied,
    load_state,
    lora_adapters,
    model_config,
    plain_state_dict,
)

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter.safetensors"


def write_weights(
    model: torch.nn.Module, dest: Path, version: int, step: int, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write `dest` (a version directory) atomically; returns it. `state`: the weights, already full
    tensors (a sharded actor's, gathered by mortal.workers.actor.sharded.full_state_dict), else the
    model's."""
    state = plain_state_dict(model) if state is None else drop_tied(model, state)
    state = {name: tensor.to("cpu").contiguous() for name, tensor in state.items()}
    config = model_config(model)
    with atomic_dir(dest) as tmp:
        save_file(
            state,
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt", "version": str(version), "step": str(step)},
        )
        if config is not None:
            config.save_pretrained(tmp)
    return dest


def write_adapters(
    model: torch.nn.Module,
    adapters: tuple[dict[str, torch.Tensor], dict[str, float]],
    dest: Path,
    version: int,
    step: int,
) -> Path:
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


def read_published(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a published version (a version directory or its model.safetensors)."""
    path = Path(path)
    if not path.exists():
        volume_refresh()  # published from another container since this one mounted the volume
    return load_file(str(path / WEIGHTS_FILE if path.is_dir() else path), device=device)


def load_published(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the version in folder `path` into `model` in place; WeightsError unless every weight is
    covered."""
    device = next(model.parameters()).device
    if is_adapter_version(path):
        apply_adapters(model, path, *read_adapters(path, device=str(device)))
    else:
        load_state(model, path, read_published(path, device=str(device)))


class VolumeTransport(WeightTransport):
    """Versions as files in the run's weights folder, which the actor and every rollout see."""

    method = "volume"

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
        if state is not None:
            write_weights(model, dest, version, step, state=state)
        elif (adapters := lora_adapters(model)) is not None:
            write_adapters(model, adapters, dest, version, step)
        else:
            write_weights(model, dest, version, step)
        return str(dest)

    def load(self, model: torch.nn.Module, path: str | Path) -> None:
        load_published(model, path)
