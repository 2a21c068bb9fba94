"""The `transformers` engine: a transformers causal LM on every machine, batched on CUDA.

Who calls it: mortal.workers.rollout.loop through the Engine interface (base.py says the contract).
- CPU (and `compiled=False`): `model.generate` on one prompt at a time, seeded inside a forked RNG, so a
  prompt's tokens are bit-for-bit reproducible whichever worker runs it (exact resume relies on it).
- CUDA: all completions of the task's prompts in one `StaticDecoder.generate` (static_decode.py says why),
  prompts left-padded to a multiple of PROMPT_BUCKET so a few shapes cover every prompt; its tokens depend
  on `max_rows` too, which spec.generation.maxNumSeqs sets for every worker. Captured graphs belong to the
  thread that captured them, so batched generates run on one thread of their own. The first preparation of
  each shape is logged with whether the run's compile cache served it (compile_cache.py).
- Tool-calling rollouts, everywhere (`converse`: turn_decode.py): each conversation kept in a decoder row
  across its turns, on CUDA in the batched path's decoder, elsewhere in an eager one made for them (its
  sampling noise is hashed per conversation, so its tokens are as reproducible as the per-prompt path's).
The model's own generation_config is never read: the spec alone decides how tokens are sampled, as TRL's
does. New weights are copied into the same tensors, so captured graphs see them.
What it must not do: pick up new weights mid-task (the worker calls load_weights between tasks).
"""

from __future__ import annotations

import logging
import statistics
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import default_device, load_model
from mortal.workers.rollout.engines.base import (
    Completion,
    Engine,
    GenerationParams,
    OnTurnEnd,
    cut_at_eos,
    eos_token_ids,
)
from mortal.workers.rollout.engines.compile_cache import CompileWatch, persist, start_compile_workers
from mortal.workers.rollout.engines.hashed_noise import conversation_key
from mortal.workers.rollout.engines.static_decode import (
    DEFAULT_MAX_ROWS,
    DecodeStats,
    Sampling,
    StaticDecoder,
    Stepper,
)
from mortal.workers.rollout.engines.turn_decode import TURNS, TurnDecoder, TurnStats
from mortal.workers.sync.base import WeightsError, WeightTransport
from mortal.workers.sync.volume import VolumeTransport

if TYPE_CHECKING:
    from mortal.specs.training import ModelSpec


PROMPT_BUCKET = 64  # batched path: prompts are left-padded to a multiple of this many tokens
log = logging.getLogger("mortal.worker")
_GRAPH_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mortal-batched-generate")


def cap_memory(device: str, share: float | None) -> int | None:
    """On a CUDA device, cap this process's caching allocator at `share` of the GPU (an allocation past it
    raises torch's out-of-memory here, naming this worker, instead of starving the colocated actor) and
    return the cap in bytes for the decoder to plan its rows in; None (no cap) elsewhere or without a
    share."""
    if share is None or not str(device).startswith("cuda"):
        return None
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.set_per_process_memory_fraction(share, index)
    return int(share * torch.cuda.get_device_properties(index).total_memory)


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        compiled: bool | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
        memory_budget: int | None = None,
        compile_scope: str = "auto",
    ) -> None:
        """`compiled` None: batched graph decoding on CUDA, one eager `generate` per prompt elsewhere.
        `max_rows`: the most sequences the batched path decodes at once (more wait and refill rows).
        `memory_budget`: bytes the batched path's weights and KV caches must fit in (StaticDecoder).
        `compile_scope`: what the batched path's decoder compiles (spec.generation.compileScope)."""
        from transformers import GenerationConfig

        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.compiled = self.device.type == "cuda" if compiled is None else compiled
        self.eos_ids = eos_token_ids(tokenizer, model.generation_config.eos_token_id)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.pad_id = pad
        # Neutral defaults: generate() fills every unset field from model.generation_config.
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self.eos_ids, pad_token_id=pad
        )
        self.max_rows = max_rows
        self.decoder = (
            StaticDecoder(
                model,
                compile=self.device.type == "cuda",
                max_rows=max_rows,
                memory_budget=memory_budget,
                compile_scope=compile_scope,
            )
            if self.compiled
            else None
        )
        # conversations across turns: the batched decoder's rows; on the per-prompt path an eager decoder of
        # its own, made at the first conversation (a run without tools never fuses the model's projections)
        self.turns = TurnDecoder(self.decoder) if self.decoder is not None else None
        self._last_stats: DecodeStats | TurnStats | None = None

    @classmethod
    def create(
        cls,
        model_spec: ModelSpec,
        tokenizer: Any,
        device: str | None = None,
        max_num_seqs: int | None = None,
        memory_share: float | None = None,
        compile_scope: str = "auto",
    ) -> TransformersEngine:
        where = device or default_device()
        # the decoder will compile: its workers start while the model loads
        if torch.device(where).type == "cuda":
            start_compile_workers()
        budget = cap_memory(where, memory_share)
        return cls(
            load_model(model_spec, where, for_training=False),
            tokenizer,
            max_rows=max_num_seqs or DEFAULT_MAX_ROWS,
            memory_budget=budget,
            compile_scope=compile_scope,
        )

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

    def generate(
        self, prompts: list[list[int]], n: int, seeds: list[int], params: GenerationParams
    ) -> list[list[Completion]]:
        if self.decoder is not None:
            return _GRAPH_THREAD.submit(self._generate_batch, prompts, n, seeds[0], params).result()
        return [
            self._generate_one(prompt, n, seed, params) for prompt, seed in zip(prompts, seeds, strict=True)
        ]

    def continues_turns(self) -> bool:
        """Every path continues conversations in a decoder's rows (turn_decode.py): on CUDA the batched
        path's, elsewhere an eager one of the conversations' own (per-prompt generation re-prefills every
        turn and decodes each rollout alone)."""
        return True

    def converse(
        self, prompts: list[list[int]], seeds: list[int], params: GenerationParams, on_turn_end: OnTurnEnd
    ) -> None:
        _GRAPH_THREAD.submit(self._converse, prompts, seeds, params, on_turn_end).result()

    @torch.no_grad()
    def _converse(
        self, prompts: list[list[int]], seeds: list[int], params: GenerationParams, on_turn_end: OnTurnEnd
    ) -> None:
        if self.turns is None:  # the per-prompt path: an eager decoder for conversations
            self.turns = TurnDecoder(StaticDecoder(self.model, compile=False, max_rows=self.max_rows))
        input_ids, attention_mask = self._left_padded(prompts, 1)
        sampling = Sampling(temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p)
        self._prepare_logged(
            self.turns.decoder,
            input_ids.shape[0],
            input_ids.shape[1],
            params.max_tokens,
            sampling,
            stepper=TURNS,
        )
        self.turns.converse(
            input_ids,
            attention_mask,
            [conversation_key(seed) for seed in seeds],
            params.max_tokens,
            sampling,
            self.eos_ids,
            on_turn_end,
        )
        self._last_stats = self.turns.last_stats

    def max_model_len(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def generation_stats(self) -> dict[str, float]:
        """The batched path's last decode: rows, steps, refills and the share of sampled tokens that were
        kept (up to each completion's EOS); empty on the per-prompt path."""
        stats = self._last_stats
        if isinstance(stats, TurnStats):
            return {
                "rows": stats.rows,
                "decode_steps": stats.decode_steps,
                "checks": stats.checks,
                "turns": stats.turns,
                "appends": stats.appends,
                "appended_tokens": stats.appended_tokens,
                "append_s": round(stats.append_seconds, 3),
                "prefills": stats.prefills,
                "prefill_s": round(stats.prefill_seconds, 3),
                "tool_waits": stats.waits,
                "tool_wait_s": round(stats.wait_seconds, 3),
                "read_wait_s": round(stats.read_wait_seconds, 3),
                "queue_s": round(stats.queue_seconds, 3),
                "hand_over_s": round(stats.hand_over_seconds, 3),
                "converse_s": round(stats.seconds, 3),
                "longest_tokens": max(stats.model_tokens, default=0),
                "median_tokens": statistics.median(stats.model_tokens) if stats.model_tokens else 0,
            }
        if stats is None:
            return {}
        return {
            "rows": stats.rows,
            "decode_steps": stats.decode_steps,
            "refills": stats.refills,
            "useful_fraction": round(stats.useful_fraction, 3),
        }

    def _left_padded(
        self, prompts: list[list[int]], n: int, min_width: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask of every prompt repeated n times, left-padded to the bucket (and to
        at least `min_width`)."""
        width = -(-max(min_width, *(len(p) for p in prompts)) // PROMPT_BUCKET) * PROMPT_BUCKET
        rows = [[self.pad_id] * (width - len(p)) + p for p in prompts for _ in range(n)]
        masks = [[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(n)]
        return (
            torch.tensor(rows, dtype=torch.long, device=self.device),
            torch.tensor(masks, dtype=torch.long, device=self.device),
        )

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], n: int, seed: int, params: GenerationParams
    ) -> list[list[Completion]]:
        input_ids, attention_mask = self._left_padded(prompts, n, params.min_prompt_width)
        sampling = Sampling(temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p)
        # CPU: the eager decoder, no CUDA
        devices = [self._cuda_index()] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            # where the decoder's generate() would prepare: the RNG sees the same calls in the same order
            self._prepare_logged(
                self.decoder,
                input_ids.shape[0],
                input_ids.shape[1],
                params.max_tokens,
                sampling,
                params.min_rows,
            )
            tokens, logprobs = self.decoder.generate(
                input_ids, attention_mask, params.max_tokens, sampling, self.eos_ids, params.min_rows
            )
            self._last_stats = self.decoder.last_stats
        ids, lps = tokens.tolist(), logprobs.tolist()
        return [
            [cut_at_eos(ids[i * n + g], lps[i * n + g], self.eos_ids) for g in range(n)]
            for i in range(len(prompts))
        ]

    def _prepare_logged(
        self,
        decoder: StaticDecoder,
        batch: int,
        prompt_len: int,
        max_tokens: int,
        sampling: Sampling,
        min_rows: int = 0,
        stepper: Stepper | None = None,
    ) -> None:
        """`decoder`'s preparation (compile, graph capture) timed apart from decoding; each time it really
        prepared (a new shape, or one it had evicted) it is logged with whether the run's compile cache
        served it, and committed to the volume. generate() then reuses the kept shape."""
        before = decoder.preparations
        with CompileWatch() as watch:
            shape = decoder.prepare(batch, prompt_len, max_tokens, sampling, min_rows, stepper)
        if decoder.preparations == before:
            return
        log.info(
            "decode shape %d rows x %d+%d tokens%s prepared in %s",
            shape.state.rows,
            prompt_len,
            max_tokens,
            f" ({stepper.kind})" if stepper is not None else "",
            watch.report.describe(),
        )
        persist(watch.report)

    def _cuda_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    @torch.no_grad()
    def _generate_one(
        self, prompt_ids: list[int], n: int, seed: int, params: GenerationParams
    ) -> list[Completion]:
        """`n` completions of one unpadded prompt through `model.generate` (bit-for-bit reproducible on
        CPU)."""
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        attention_mask = torch.ones_like(input_ids)
        devices = [self._cuda_index()] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=self._generation_config(n, params),
            )
        tokens = out.sequences[:, input_ids.shape[1] :]
        logprobs = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
        for t, scores in enumerate(out.scores):
            step = torch.log_softmax(scores.float(), dim=-1)
            logprobs[:, t] = step.gather(1, tokens[:, t : t + 1]).squeeze(1)
        ids, lps = tokens.tolist(), logprobs.tolist()
        return [cut_at_eos(ids[i], lps[i], self.eos_ids) for i in range(n)]

    def load_weights(self, path: str, transport: WeightTransport | None = None) -> None:
        # before the load: a load that fails half-way has still changed weights
        for decoder in (self.decoder, self.turns.decoder if self.turns else None):
            if decoder is not None:
                decoder.forget_weights()
        try:
            (transport or VolumeTransport()).load(self.model, path)
        except WeightsError as exc:
            raise FatalWorkerError(
                "WeightsMismatch", f"published weights do not fit the rollout model: {exc}"
            ) from exc

    def close(self) -> None:
        self.model = None
        self.decoder = None
        self.turns = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
