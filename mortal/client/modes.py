"""The seed's execution modes for `MortalTrainer`: SingleNode, Distributed and GPUConfig.

    MortalTrainer(mode=SingleNode(gpu="A100", use_vllm=True, vllm_mode="colocate"), ...)
    MortalTrainer(mode=Distributed(actor="A100", rollout="A10G", num_rollout_workers=2), ...)

Each mode is a small frozen dataclass whose `spec_fields()` says which TrainingRun spec blocks it
sets (actor, rollout, generation, sync); `MortalTrainer` merges them into the spec. Pure data: no
I/O, no torch; the spec validates the result (e.g. a sync method that is not built yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class GPUConfig:
    """A GPU type and how many of it, e.g. GPUConfig("A100", count=2); "none" means CPU."""

    type: str = "A100"
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"GPUConfig.count must be >= 1 (got {self.count})")


def as_gpu(gpu: str | GPUConfig) -> GPUConfig:
    """ "A100" -> GPUConfig("A100", 1); a GPUConfig as is."""
    return gpu if isinstance(gpu, GPUConfig) else GPUConfig(str(gpu), 1)


@dataclass(frozen=True)
class SingleNode:
    """Everything on one machine: the trainer and one generation worker on the same GPU type.

    `use_vllm` selects the vLLM engine. `vllm_mode="colocate"` runs a rollout worker on each of the
    trainer's GPUs (spec rollout.colocate): with GPUConfig(type, count=N) the trainer is sharded over N
    GPUs (actor.count, FSDP2) and N rollout workers share them, one a GPU, as TRL's colocate mode runs a
    vLLM beside each training process. `"serve"` gives generation its own GPUs: with GPUConfig(type,
    count=N) the trainer takes one and N-1 rollout workers take the rest (N >= 2).
    """

    gpu: str | GPUConfig = "A100"
    use_vllm: bool = False
    vllm_mode: Literal["colocate", "serve"] = "colocate"

    def spec_fields(self) -> dict[str, Any]:
        gpu = as_gpu(self.gpu)
        if self.vllm_mode not in ("colocate", "serve"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'serve' (got {self.vllm_mode!r})")
        if self.vllm_mode == "serve" and gpu.count < 2:
            raise ValueError(
                f"vllm_mode='serve' puts generation on its own GPU and needs at least 2: "
                f"SingleNode(gpu=GPUConfig({gpu.type!r}, count=2), vllm_mode='serve')"
            )
        colocate = self.vllm_mode == "colocate"
        return {
            "actor": {"gpu": gpu.type, "count": gpu.count} if colocate else {"gpu": gpu.type},
            "rollout": {
                "gpu": gpu.type,
                "replicas": gpu.count if colocate else gpu.count - 1,
                "colocate": colocate,
            },
            "generation": {"engine": "vllm" if self.use_vllm else "auto"},
        }


@dataclass(frozen=True)
class Distributed:
    """A trainer (actor) and `num_rollout_workers` generation workers, each on its own GPU type; with
    actor=GPUConfig(type, count=N) the trainer is sharded over N GPUs (actor.count, FSDP2).

    `weight_sync_method`: auto (the fastest built method) or one of the spec's sync methods; the
    seeds' names are accepted as the spec accepts them (reload and checkpoint = volume, direct = ipc:
    specs/training.py SYNC_ALIASES). `engine`: the spec's generation.engine (nccl needs
    "transformers"). Scale the rollout workers later with `mortalctl scale NAME rollout=N`.
    """

    actor: str | GPUConfig = "A100"
    rollout: str | GPUConfig = "A10G"
    num_rollout_workers: int = 2
    weight_sync_method: str = "auto"
    sync_weights_every: int = 1
    engine: Literal["auto", "vllm", "transformers"] = "auto"

    def spec_fields(self) -> dict[str, Any]:
        actor, rollout = as_gpu(self.actor), as_gpu(self.rollout)
        return {
            "actor": {"gpu": actor.type, "count": actor.count},
            "rollout": {"gpu": rollout.type, "replicas": self.num_rollout_workers * rollout.count},
            "sync": {"method": self.weight_sync_method, "every": self.sync_weights_every},
            "generation": {"engine": self.engine},
        }
