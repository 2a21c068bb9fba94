"""Will the model fit the GPU the spec asks for? A lower bound, refused only when it is certain not to.

Who calls it: `mortalctl apply` (mortal.client.apply), with the parameter count read from the
model's safetensors headers (mortal.workers.models.count_parameters); tests call it directly.
Pure: no I/O. What it must not do: guess. The bound adds only what every run of that spec must hold at
once (the actor's weights, gradients and AdamW moments, sharded or not; colocated rollouts' copies or
shares; the ring of weight snapshots; the gathered model without resharding), in bytes of the dtype
each is held in, against the GPU's memory as sold (backends.gpus.GPU_MEMORY). It leaves out what
depends on the data (activations, the KV cache, the CUDA context), so "does not fit" holds for every
batch size, and silence still allows an out-of-memory later (the MemoryFits condition).

Kept apart from the bound: `fitting_micro_batch`, an ESTIMATE of the actor's activations used only to
choose a smaller micro batch before launch (the same step in more passes), never to refuse a spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from mortal.controller.backends.gpus import GPU_MEMORY, gpu_memory, wants_gpu
from mortal.specs.training import TrainingSpec

DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}  # auto on a GPU is bfloat16
ADAMW_COPIES = 4  # weights, gradients, exp_avg, exp_avg_sq
AMBIGUOUS = ("A100", "H100!", "B200+")  # names not to suggest: several sizes, or a variant of another name


@dataclass(frozen=True)
class Misfit:
    """A spec field whose GPU cannot hold what the spec asks of it."""

    field: str  # e.g. spec.actor.gpu
    message: str


def certain_misfits(spec: TrainingSpec, parameters: int) -> list[Misfit]:
    """Each worker whose GPU is smaller than the least it must hold (see the module docstring)."""
    per = DTYPE_BYTES[spec.model.dtype]
    served = DTYPE_BYTES[spec.rollout_model().dtype]  # what rollouts and snapshots hold
    found = []
    actor = spec.actor.gpu
    if wants_gpu(actor) and gpu_memory(actor) is not None:
        bound = _actor_bound(spec, parameters)
        full, ranks, replicated, parts, need = (
            bound.full,
            spec.actor.count,
            bound.replicated,
            bound.parts,
            bound.need,
        )
        share, colocated, gathered, ring = bound.share, bound.colocated, bound.gathered, bound.ring
        if need > _capacity(actor):
            fixes = ["train a LoRA adapter (model.lora: {r: 16})"] if full and ranks == 1 else []
            if gathered:
                fixes.append("actor.reshardAfterForward: true (each layer gathered only while it computes)")
            if full and replicated:
                fixes.append(
                    "shard the actor's weights, gradients and AdamW state over its ranks "
                    "(actor.strategy: fsdp)"
                )
            elif full and not spec.actor.cpu_offload:
                fixes.append(f"shard the actor over more GPUs (actor.count: {ranks * 2})")
            if share:
                fixes.append("a smaller rollout.gpuMemoryUtilization")
            if ring > 2:
                fixes.append("sync.keepVersions: 2 (one snapshot fewer)")
            if ring:
                fixes.append("sync.method: volume (no snapshots on the GPU)")
            if colocated:
                fixes.append(
                    "give the rollouts GPUs of their own (rollout.colocate: false, no colocatedReplicas)"
                )
            fixes.append(f"a GPU with more memory ({_larger(actor, need)})")
            found.append(
                Misfit(
                    "spec.actor.gpu", _message(actor, parameters, per, spec.model.dtype, need, parts, fixes)
                )
            )
    rollout = spec.rollout.gpu
    if spec.rollout.replicas and wants_gpu(rollout) and gpu_memory(rollout) is not None:
        found.extend(_rollout_misfits(spec, parameters, served))
    return found


@dataclass(frozen=True)
class _ActorBound:
    """What the actor's GPU must hold whatever the data (the module docstring's bound), and its parts in
    words."""

    need: int
    parts: list[str]
    full: bool
    replicated: bool
    share: float | None
    colocated: int
    gathered: int
    ring: int


def _actor_bound(spec: TrainingSpec, parameters: int) -> _ActorBound:
    per = DTYPE_BYTES[spec.model.dtype]
    served = DTYPE_BYTES[spec.rollout_model().dtype]  # what rollouts and snapshots hold
    actor = spec.actor.gpu
    full = spec.model.lora is None
    ranks = spec.actor.count
    replicated = spec.actor.strategy == "ddp"
    copies = (0 if spec.actor.cpu_offload else ADAMW_COPIES / (1 if replicated else ranks)) if full else 1
    parts = ["weights, gradients and AdamW's two moments" if full else "the frozen base weights (LoRA)"]
    if ranks > 1 and replicated:
        parts[0] = f"{parts[0]}, whole on each of {ranks} ranks (strategy ddp)"
    elif ranks > 1:
        parts[0] = (
            f"{parts[0]} in host memory (cpuOffload)"
            if spec.actor.cpu_offload
            else f"1/{ranks} of the {parts[0]} (FSDP2 shards)"
        )
    colocated = spec.colocated_per_gpu()
    share = spec.rollout.gpu_memory_utilization
    rollouts_hold = colocated * (int(share * _capacity(actor)) if share else served * parameters)
    if colocated and share:
        parts.append(
            f"{share} of the GPU for {'each of ' if colocated > 1 else ''}{colocated} colocated "
            f"rollout{'s' if colocated > 1 else ''}"
        )
    elif colocated:
        parts.append(f"{colocated} colocated rollout cop{'y' if colocated == 1 else 'ies'} of the weights")
    gathered = served * parameters if ranks > 1 and not spec.actor.reshard_after_forward else 0
    if gathered:
        parts.append("the whole model gathered from the forward to the backward (reshardAfterForward: false)")
    sync = spec.sync_method()
    # LoRA's ring holds the adapters' factors alone: left out.
    ring = spec.sync.keep_versions if sync in ("ipc", "nccl") and full else 0
    if ring:
        parts.append(f"{ring} snapshots of the weights for sync {sync}")
    need = int(copies * per * parameters + ring * served * parameters) + rollouts_hold + gathered
    return _ActorBound(need, parts, full, replicated, share, colocated, gathered, ring)


def _rollout_misfits(spec: TrainingSpec, parameters: int, per: int) -> list[Misfit]:
    """A rollout on its own GPU that cannot hold the weights; any rollout whose share cannot."""
    gpu, share, need = spec.rollout.gpu, spec.rollout.gpu_memory_utilization, per * parameters
    if share is not None and need > share * _capacity(gpu):
        return [
            Misfit(
                "spec.rollout.gpuMemoryUtilization",
                f"{share} of {gpu}'s {_capacity(gpu) / 1e9:.0f} GB is "
                f"{share * _capacity(gpu) / 1e9:.1f} GB; the rollout's copy of a model of "
                f"{parameters / 1e9:.2f}B parameters needs at least {need / 1e9:.1f} GB of it, before "
                "any KV cache. Fix: a larger rollout.gpuMemoryUtilization (at least "
                f"{need / _capacity(gpu):.2f})"
                + ("" if spec.rollout.colocate else f"; or a GPU with more memory ({_larger(gpu, need)})"),
            )
        ]
    # Some rollouts are on GPUs of their own.
    if spec.rollout.colocated_count < spec.rollout.replicas and need > _capacity(gpu):
        return [
            Misfit(
                "spec.rollout.gpu",
                _message(
                    gpu,
                    parameters,
                    per,
                    spec.model.dtype,
                    need,
                    ["the weights"],
                    [f"a GPU with more memory ({_larger(gpu, need)})"],
                ),
            )
        ]
    return []


def _message(
    gpu: str, parameters: int, per: int, dtype: str, need: int, parts: list[str], fixes: list[str]
) -> str:
    shown = "bfloat16" if dtype == "auto" else dtype  # auto is bfloat16 on a GPU
    return (
        f"{gpu} has {_capacity(gpu) / 1e9:.0f} GB; a model of {parameters / 1e9:.2f}B parameters in "
        f"{shown} ({per} bytes each) needs at least {need / 1e9:.1f} GB on it for {' + '.join(parts)}, "
        f"before any activation or KV cache. Fix: {'; or '.join(fixes)}"
    )


def _capacity(gpu: str) -> int:
    """The memory of a GPU type its caller found in the table (gpu_memory is not None)."""
    memory = gpu_memory(gpu)
    if memory is None:
        raise ValueError(f"no memory size known for GPU type {gpu!r}")
    return memory


def _larger(gpu: str, need: int) -> str:
    bigger = sorted(
        (size, name) for name, size in GPU_MEMORY.items() if size >= need and name not in AMBIGUOUS
    )
    return f"e.g. {bigger[0][1]}" if bigger else f"none of {', '.join(sorted(GPU_MEMORY))} is large enough"


@dataclass(frozen=True)
class ModelShape:
    """What the activations of a decoder's training pass scale with (the model's config.json)."""

    hidden: int  # hidden_size
    intermediate: int  # intermediate_size (the MLP's gate and up projections)
    layers: int  # num_hidden_layers
    kv_width: int  # num_key_value_heads x head_dim: each of k and v per token
    vocab: int  # vocab_size

    @classmethod
    def from_config(cls, config: dict) -> ModelShape | None:
        """The shape in a transformers config; None when a field is missing (another architecture)."""
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or hidden // heads)
            return cls(
                hidden,
                int(config["intermediate_size"]),
                int(config["num_hidden_layers"]),
                int(config.get("num_key_value_heads") or heads) * head_dim,
                int(config["vocab_size"]),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None


@dataclass(frozen=True)
class MicroBatchChoice:
    """The largest micro batch whose estimate fits the actor's GPU, and the sentence that says why."""

    size: int
    reason: str


def activation_bytes(spec: TrainingSpec, shape: ModelShape, micro: int) -> int:
    """An ESTIMATE (not a bound) of what one rank's forward saves for backward over `micro` completions.

    Per token and layer, the tensors autograd keeps for a Llama/Qwen-style layer (RMSNorms, attention's
    inputs and outputs, the MLP's intermediates), or with gradient checkpointing each layer's input plus one
    layer recomputed; generation.maxTokens tokens per completion, plus the fused LM head's float32 gradient.
    The CUDA context and the allocator's slack are left out: a run it says fits may still run out of
    memory, and then the controller halves the micro batch (mortal.controller.heal)."""
    b = 2 if spec.actor.mixed_precision else DTYPE_BYTES[spec.model.dtype]
    layer = (
        2 * (4 + b) * shape.hidden + b * (3 * shape.hidden + 3 * shape.kv_width) + 4 * b * shape.intermediate
    )
    tokens = -(-micro // spec.actor.count) * spec.generation.max_tokens
    if spec.model.gradient_checkpointing:
        saved = tokens * (shape.layers * b * shape.hidden + layer)
    else:
        saved = tokens * shape.layers * layer
    return saved + 4 * shape.vocab * shape.hidden


def fitting_micro_batch(spec: TrainingSpec, parameters: int, shape: ModelShape) -> MicroBatchChoice | None:
    """The largest micro batch under the spec's whose estimate fits the actor's GPU beside what it must hold
    (`certain_misfits`' bound); None when the spec's fits, it set microBatchSize itself, its GPU's size is
    unknown, or none fits (then `certain_misfits` or the out-of-memory diagnosis speaks). Only a micro batch
    is chosen: the same step in more passes; the user's spec is left as it is."""
    actor, algorithm = spec.actor.gpu, spec.algorithm
    if algorithm.micro_batch_size is not None or not wants_gpu(actor) or gpu_memory(actor) is None:
        return None
    capacity, held = _capacity(actor), _actor_bound(spec, parameters).need
    batch = algorithm.batch_size
    if held + activation_bytes(spec, shape, batch) <= capacity:
        return None
    for size in range(batch // 2, 0, -1):
        if batch % size or size % spec.actor.count:
            continue
        estimate = held + activation_bytes(spec, shape, size)
        if estimate <= capacity:
            return MicroBatchChoice(
                size,
                (
                    f"actor micro batch {batch} -> {size} before launch: "
                    f"{actor}'s {capacity / 1e9:.0f} GB hold "
                    f"an estimated {estimate / 1e9:.1f} GB with {size} completions a pass "
                    f"({held / 1e9:.1f} GB "
                    f"without activations), not {(held + activation_bytes(spec, shape, batch)) / 1e9:.1f} GB "
                    f"with {batch}; {batch // size} passes a step, gradients accumulated: the same step"
                ),
            )
    return None
