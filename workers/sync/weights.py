"""A model's weights as a version carries them, and a version copied into a rollout's model.

Used by every transport (mortal.workers.sync.base). A version holds the base model's own tensor names, a
tied tensor once. With plain LoRA only the adapters travel (`lora_adapters`, with each module's scale) and
a rollout writes base + B @ A * scale into its model in place (`apply_adapters`): a version of factors is
megabytes where a merged model is gigabytes. Any other adapter (DoRA, biases, embeddings, modules_to_save)
is merged out of place (`plain_state_dict`): the training model is never modified, so publishing cannot
perturb training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mortal.workers.sync.base import WeightsError

_PEFT_MARKERS = ("lora_", "modules_to_save", "original_module")


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
            raise WeightsError(
                f"adapter {adapter!r} is not plain LoRA; only plain LoRA can be published merged"
            )
        merged += module.get_delta_weight(adapter).detach().to(weight.dtype)
    return merged


def _drop_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that share storage (tied weights); safetensors refuses aliases."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size(),
            tuple(tensor.shape),
        )
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


def drop_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of each tensor the model ties: a gathered state has a copy per name, so
    storage cannot tell them apart as it does in _drop_shared."""
    first = tied_once(model)
    return {name: tensor for name, tensor in state.items() if name in first}


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
    plain = (
        len(active) == 1
        and not getattr(module, "merged_adapters", [])
        and not getattr(module, "lora_variant", {})
        and not any(getattr(module, "lora_bias", {}).values())
        and not getattr(module, "fan_in_fan_out", False)
        and not getattr(module, "lora_embedding_A", {})
        and isinstance(module.get_base_layer(), torch.nn.Linear)
    )
    if not plain:
        return None
    adapter = active[0]
    return (
        module.lora_A[adapter].weight.detach(),
        module.lora_B[adapter].weight.detach(),
        float(module.scaling[adapter]),
    )


def merged_weight(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """base + B @ A * scale, as peft's merge computes it (in float32 where the weights are half precision)."""
    delta = (
        (lora_b.float() @ lora_a.float()) * scale
        if base.dtype != torch.float32
        else (lora_b @ lora_a) * scale
    )
    return base + delta.to(base.dtype)


@torch.no_grad()
def apply_adapters(
    model: torch.nn.Module, path: str | Path, tensors: dict[str, torch.Tensor], scales: dict[str, float]
) -> None:
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
            raise WeightsError(
                f"{path}: the adapter of {module!r} does not fit the model "
                f"({tuple(params[name].shape) if name in params else 'no such weight'})"
            )
        if name not in base:
            if model.__dict__.get("_mortal_full_loaded"):
                raise WeightsError(
                    f"{path}: an adapter version after full weights; the base of {module!r} is "
                    "gone from memory (a relaunched rollout starts from the base model)"
                )
            base[name] = params[name].detach().clone()
        params[name].copy_(merged_weight(base[name], lora_a, lora_b, scale))


def model_config(model: torch.nn.Module) -> Any:
    return getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "config", None)


def load_state(model: torch.nn.Module, path: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Copy whole weights into `model` in place; WeightsError unless every weight is covered. Tensors a
    version leaves out must be tied to one it has (lm_head to the embeddings)."""
    model.__dict__["_mortal_full_loaded"] = True
    copy_pairs(_destinations(model, state, path), list(state.values()))


def _destinations(
    model: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path
) -> list[torch.Tensor]:
    """The model's own tensors that `state`'s go into, in its order; WeightsError unless they fit.
    Checked once per set of names and kept on the model: a rollout's model and a run's published
    names do not change, and the check and state_dict cost milliseconds a load need not spend."""
    names = list(state)
    planned = model.__dict__.get("_mortal_load_plan")
    if (
        planned is not None
        and planned[0] == names
        and all(tuple(t.shape) == tuple(d.shape) for t, d in zip(state.values(), planned[1], strict=True))
    ):
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


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@torch.no_grad()
def copy_into(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], current: dict[str, torch.Tensor] | None = None
) -> None:
    """Copy tensors into the model's own parameters in place (captured CUDA graphs keep working);
    `current`: the model's state_dict when the caller has it already (it is rebuilt otherwise)."""
    current = model.state_dict() if current is None else current
    copy_pairs([current[name] for name in tensors], list(tensors.values()))


@torch.no_grad()
def copy_pairs(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """destinations[i] <- sources[i], in one fused copy, finished before it returns."""
    torch._foreach_copy_(destinations, sources)
    if destinations and destinations[0].is_cuda:
        # done before the source is let go or reused, and before the next task reads them
        torch.cuda.synchronize()
