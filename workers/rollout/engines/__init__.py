"""Generation engines behind one interface (base.Engine): `transformers` everywhere, `vllm` where installed.

`select_engine(spec.generation.engine)` returns the Engine class to use; the rollout worker then
calls `cls.create(spec.model, tokenizer)`. `auto` means vLLM when it is importable and a CUDA GPU
is visible, else transformers. Asking for vLLM where it cannot run is fatal (it never will).
Engine modules are imported only when selected (vLLM and torch are heavy).
"""

from __future__ import annotations

from mortal.workers.errors import FatalWorkerError
from mortal.workers.rollout.engines.base import Completion, Engine, GenerationParams

ENGINES = ("auto", "transformers", "vllm")

__all__ = ["ENGINES", "Completion", "Engine", "GenerationParams", "resolve_engine_name", "select_engine"]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_engine_name(name: str, device: str = "cuda") -> str:
    """`auto` -> vllm where vLLM is installed and the rollout runs on a GPU (`device` from
    spec.rollout.gpu), else transformers; vllm without vLLM or a GPU is fatal."""
    from mortal.workers.rollout.engines.vllm_engine import vllm_available

    if name == "auto":
        return "vllm" if device == "cuda" and vllm_available() and _cuda_available() else "transformers"
    if name == "vllm" and not vllm_available():
        raise FatalWorkerError(
            "EngineUnavailable",
            "spec.generation.engine 'vllm': vLLM is not installed on this "
            "worker; install it (pip install vllm) or use engine: transformers or auto",
        )
    if name == "vllm" and (device != "cuda" or not _cuda_available()):
        raise FatalWorkerError(
            "EngineUnavailable",
            "spec.generation.engine 'vllm' needs a CUDA GPU; set "
            "spec.rollout.gpu, or use engine: transformers or auto",
        )
    if name not in ENGINES:
        raise FatalWorkerError(
            "EngineUnavailable", f"spec.generation.engine {name!r}: known engines {ENGINES}"
        )
    return name


def select_engine(name: str, device: str = "cuda") -> type[Engine]:
    """The Engine class for `spec.generation.engine` on this machine and the rollout's device."""
    if resolve_engine_name(name, device) == "vllm":
        from mortal.workers.rollout.engines.vllm_engine import VllmEngine

        return VllmEngine
    from mortal.workers.rollout.engines.transformers_engine import TransformersEngine

    return TransformersEngine
