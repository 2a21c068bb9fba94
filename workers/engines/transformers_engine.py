"""The `transformers` engine: `model.generate` on one prompt at a time, on every machine.

Who calls it: mortal.workers.rollout through the Engine interface (base.py says the contract).
Sampling: `num_return_sequences=n` on ONE prompt (no padding between prompts, so a task's tokens
do not depend on the worker that ran it), seeded inside a forked RNG so the worker's global RNG is
untouched. The model's own generation_config (hub defaults such as top_k=50 or a repetition
penalty) is replaced by a neutral one: the spec alone decides how tokens are sampled, as TRL's
GenerationConfig does. Logprobs come from the processed scores (`output_scores`): the
distribution the token was drawn from, temperature, top-k and top-p applied.
What it must not do: pick up new weights mid-task (the worker calls load_weights between tasks),
or make a faster GPU path (static cache + torch.compile is the performance issue's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mortal.workers.engines.base import Completion, Engine, GenerationParams, cut_at_eos, eos_token_ids
from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import default_device, load_model
from mortal.workers.weights import WeightsError, load_published

if TYPE_CHECKING:
    from mortal.specs.training import ModelSpec


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from transformers import GenerationConfig

        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_ids = eos_token_ids(tokenizer, model.generation_config.eos_token_id)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.pad_id = pad
        # Neutral defaults: generate() fills every unset field from model.generation_config.
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self.eos_ids, pad_token_id=pad
        )

    @classmethod
    def create(cls, model_spec: ModelSpec, tokenizer: Any, device: str | None = None) -> TransformersEngine:
        return cls(load_model(model_spec, device or default_device(), for_training=False), tokenizer)

    def _generation_config(self, n: int, params: GenerationParams) -> Any:
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=True,
            num_return_sequences=n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or 0,  # 0 = off (transformers' default would be 50)
            repetition_penalty=1.0,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_scores=True,
            disable_compile=True,
        )

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], n: int, seed: int, params: GenerationParams) -> list[Completion]:
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()] if cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=self._generation_config(n, params),
            )
        tokens = out.sequences[:, input_ids.shape[1]:]
        logprobs = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
        for t, scores in enumerate(out.scores):
            step = torch.log_softmax(scores.float(), dim=-1)
            logprobs[:, t] = step.gather(1, tokens[:, t : t + 1]).squeeze(1)
        ids, lps = tokens.tolist(), logprobs.tolist()
        return [cut_at_eos(ids[i], lps[i], self.eos_ids) for i in range(n)]

    def load_weights(self, path: str) -> None:
        try:
            load_published(self.model, path)
        except WeightsError as exc:
            raise FatalWorkerError("WeightsMismatch", f"published weights do not fit the rollout model: {exc}") from exc

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
