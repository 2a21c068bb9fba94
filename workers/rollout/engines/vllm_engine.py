"""The `vllm` engine: vLLM's offline `LLM` on this worker's GPU, through vLLM's public API only.

Who calls it: mortal.workers.rollout.loop through the Engine interface (base.py says the contract),
when `spec.generation.engine` is vllm (or auto, with vLLM installed and a GPU). vLLM is imported
lazily, so this module imports everywhere; tests skip cleanly where vLLM is absent.
- generate: one `LLM.generate` over all the task's prompts (token ids), each with its own
  `SamplingParams(n=..., seed=..., logprobs=0)`; vLLM batches them itself and gives each of a
  prompt's n children its own seed (seed + i), so a prompt's tokens depend on its seed alone.
- converse: tool-calling conversations on vLLM's engine, stepped directly: a turn that ends leaves the
  batch while its tools run, and its next turn rejoins it with the history's K/V found by vLLM's prefix
  caching (vllm_conversations.py).
  The engine runs with `logprobs_mode="processed_logprobs"`, as TRL does, so logprobs are those of
  the distribution sampled from (temperature, top-k, top-p applied), like the transformers engine.
- load_weights: the published safetensors are streamed into the running model on every worker
  with `LLM.collective_rpc` (the model's own `load_weights`, HF tensor names), then the prefix
  cache is reset so no KV of the old weights is reused. A LoRA run's version holds only adapters:
  each worker reads the adapted modules' base weights from the model's own files once, and loads
  base + B @ A * scale for those modules (mortal.workers.sync.weights.merged_weight).
What it must not do: read the model's generation_config defaults (`generation_config="vllm"`):
the spec alone decides how tokens are sampled.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.specs.training import VLLM_SHARE
from mortal.workers.models import model_location, resolve_dtype
from mortal.workers.rollout.engines.base import (
    Completion,
    Engine,
    GenerationParams,
    OnTurnEnd,
    eos_token_ids,
)
from mortal.workers.rollout.engines.vllm_conversations import Conversations, completion_of

if TYPE_CHECKING:
    from mortal.specs.training import ModelSpec
    from mortal.workers.sync.base import WeightTransport

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# In each vLLM worker process: the base weights of the modules a LoRA run adapts, read once.
_LORA_BASE: dict[str, Any] = {}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _load_safetensors_on_worker(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker: stream a published file into its model; returns the tensor count."""
    from safetensors import safe_open

    model = worker.model_runner.model
    device = next(model.parameters()).device
    count = 0
    with safe_open(path, framework="pt", device=str(device)) as handle:
        names = list(handle.keys())
        model.load_weights(weights=((name, handle.get_tensor(name)) for name in names))
        count = len(names)
    return count


def base_tensors(location: str, names: list[str], device: str) -> dict[str, Any]:
    """The named tensors from a model folder's own safetensors (one file, or shards and their index)."""
    from safetensors import safe_open

    index = Path(location) / INDEX_FILE
    shard_of = (
        json.loads(index.read_text())["weight_map"] if index.is_file() else dict.fromkeys(names, WEIGHTS_FILE)
    )
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_shard[shard_of[name]].append(name)
    found = {}
    for shard, shard_names in by_shard.items():
        with safe_open(str(Path(location) / shard), framework="pt", device=device) as handle:
            found.update({name: handle.get_tensor(name) for name in shard_names})
    return found


def _load_adapters_on_worker(worker: Any, path: str, location: str) -> int:
    """Runs inside each vLLM worker: base + B @ A * scale into the adapted modules; returns their count."""
    from mortal.workers.sync.volume import read_adapters
    from mortal.workers.sync.weights import merged_weight

    model = worker.model_runner.model
    device = str(next(model.parameters()).device)
    factors, scales = read_adapters(path, device=device)
    missing = [f"{module}.weight" for module in scales if f"{module}.weight" not in _LORA_BASE]
    _LORA_BASE.update(base_tensors(location, missing, device) if missing else {})
    model.load_weights(
        weights=(
            (
                f"{module}.weight",
                merged_weight(
                    _LORA_BASE[f"{module}.weight"],
                    factors[f"{module}.lora_A"],
                    factors[f"{module}.lora_B"],
                    scale,
                ),
            )
            for module, scale in scales.items()
        )
    )
    return len(scales)


def _generation_eos(location: str) -> int | list[int] | None:
    """The model's own end-of-sequence ids (generation_config.json, else config.json), as TRL adds them."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(location).eos_token_id
    except OSError:
        return AutoConfig.from_pretrained(location).eos_token_id


class VllmEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        generation_eos: int | list[int] | None = None,
        location: str | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.location = location  # the model's folder: where a LoRA run's base weights are read from
        self.eos_ids = eos_token_ids(tokenizer, generation_eos)

    @classmethod
    def create(
        cls,
        model_spec: ModelSpec,
        tokenizer: Any,
        device: str | None = None,
        max_num_seqs: int | None = None,
        memory_share: float | None = None,
        compile_scope: str = "auto",
    ) -> VllmEngine:
        # The weight loader is a function sent to vLLM's worker processes (collective_rpc).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM

        location = model_location(model_spec)
        dtype = str(resolve_dtype(model_spec.dtype, "cuda")).removeprefix("torch.")
        llm = LLM(
            model=location,
            dtype=dtype,
            seed=0,
            gpu_memory_utilization=memory_share or VLLM_SHARE,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enable_prefix_caching=True,
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
        )
        return cls(llm, tokenizer, _generation_eos(location), location)

    def _sampling_params(self, n: int, seed: int, params: GenerationParams) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            seed=seed,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k is not None else -1,  # -1 = off in every vLLM release
            max_tokens=params.max_tokens,
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=self.eos_ids,
            detokenize=False,
        )

    def generate(
        self, prompts: list[list[int]], n: int, seeds: list[int], params: GenerationParams
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        requests = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts],
            [self._sampling_params(n, seed, params) for seed in seeds],
            use_tqdm=False,
        )
        return [self._completions(request) for request in requests]

    def continues_turns(self) -> bool:
        """Conversations continue on vLLM's engine, stepped directly (vllm_conversations.py)."""
        return True

    def converse(
        self, prompts: list[list[int]], seeds: list[int], params: GenerationParams, on_turn_end: OnTurnEnd
    ) -> None:
        from vllm.inputs import TokensPrompt

        Conversations(
            self.llm.llm_engine,
            lambda seed, max_tokens: self._sampling_params(1, seed, replace(params, max_tokens=max_tokens)),
            lambda ids: TokensPrompt(prompt_token_ids=list(ids)),
            self.eos_ids,
            params.max_tokens,
        ).run(prompts, seeds, on_turn_end)

    def _completions(self, request: Any) -> list[Completion]:
        return [completion_of(output, self.eos_ids) for output in request.outputs]

    def max_model_len(self) -> int | None:
        return self.llm.llm_engine.model_config.max_model_len

    def load_weights(self, path: str, transport: WeightTransport | None = None) -> None:
        """A version's files, whichever way they reached this node (the spec keeps ring methods from vLLM)."""
        from mortal.workers.sync.volume import is_adapter_version

        if is_adapter_version(path):
            self.llm.collective_rpc(_load_adapters_on_worker, args=(path, self.location))
        else:
            file = os.path.join(path, WEIGHTS_FILE) if os.path.isdir(path) else path
            self.llm.collective_rpc(_load_safetensors_on_worker, args=(file,))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.llm = None
