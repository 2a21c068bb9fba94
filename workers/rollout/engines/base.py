"""The one interface every generation engine implements, and what it returns.

Who calls it: mortal.workers.rollout.loop (one `generate` per task: the task's prompts, `n` completions
each, with one seed per prompt; one `load_weights` per new weight version, between tasks only).
Engines: transformers_engine (every machine) and vllm_engine (where vLLM is installed);
`mortal.workers.rollout.engines.select_engine` picks.
Contract: `generate` is deterministic per (weights, prompts, n, seeds, params) on one kind of
machine, returns each completion cut after its first end-of-sequence token (included, as TRL
expects) and, per token, the log-probability of the sampled token under the distribution it was
sampled from (temperature, top-k and top-p applied: vLLM's "processed_logprobs").
An engine may batch a task's prompts together (on a GPU, all of them in one batch: that is where
the speed is). A task's prompts are fixed by the run's seed and step (mortal.workers.schedule), so
the batch, and with it the tokens, never depends on which worker ran the task or when.
What it must not do: batch prompts of different tasks together.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mortal.specs.training import GenerationSpec, ModelSpec
    from mortal.workers.sync.base import WeightTransport


@dataclass(frozen=True)
class GenerationParams:
    """Sampling settings, from spec.generation (top_k None = no top-k filter)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    # The batched GPU path left-pads prompts to at least min_prompt_width tokens and decodes with at least
    # min_rows rows: the tool loop sets both so that every turn of a task, its history growing and its
    # live rollouts fewer, replays one captured shape. Other paths ignore them.
    min_prompt_width: int = 0
    min_rows: int = 0

    @classmethod
    def from_spec(cls, spec: GenerationSpec) -> GenerationParams:
        return cls(
            max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k
        )


# A conversation's turn ended: (conversation, the turn's ids, their logprobs) -> a future of the ids to feed
# in next, or None when the conversation is over (Engine.converse).
OnTurnEnd = Callable[[int, list[int], list[float]], "Future[list[int] | None] | None"]


@dataclass(frozen=True)
class Completion:
    """One sampled completion: token ids (ending with EOS when it stopped) and their logprobs."""

    ids: list[int]
    logprobs: list[float]


def eos_token_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> list[int]:
    """The ids that end a completion, as TRL computes them: the tokenizer's EOS, then the model's."""
    ids = (
        []
        if generation_eos is None
        else [generation_eos]
        if isinstance(generation_eos, int)
        else list(generation_eos)
    )
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids = [tokenizer.eos_token_id, *ids]
    return ids


def cut_at_eos(ids: list[int], logprobs: list[float], eos_ids: list[int]) -> Completion:
    """Keep tokens up to and including the first EOS; what follows it is padding."""
    stop = set(eos_ids)
    for i, token in enumerate(ids):
        if token in stop:
            return Completion(ids[: i + 1], logprobs[: i + 1])
    return Completion(list(ids), list(logprobs))


class Engine(abc.ABC):
    """A generation engine bound to one model; `load_weights` swaps in a published version."""

    name: str = "engine"

    @classmethod
    @abc.abstractmethod
    def create(
        cls,
        model_spec: ModelSpec,
        tokenizer: Any,
        device: str | None = None,
        max_num_seqs: int | None = None,
        memory_share: float | None = None,
        compile_scope: str = "auto",
    ) -> Engine:
        """Load the spec's model into a new engine (device None: a GPU when there is one); `max_num_seqs`
        (spec.generation.maxNumSeqs) caps the sequences decoded at once, None: the engine's default;
        `memory_share` (TrainingSpec.rollout_memory_share) is the share of the GPU the engine may hold,
        None: no cap (ignored on the CPU); `compile_scope` (spec.generation.compileScope) is what an engine
        that compiles its decode step compiles (the others ignore it)."""

    @abc.abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, seeds: list[int], params: GenerationParams
    ) -> list[list[Completion]]:
        """`n` completions of each prompt (prompt i sampled with seeds[i]), one list per prompt."""

    def continues_turns(self) -> bool:
        """Whether `converse` runs here (False: the tool loop calls `generate` once per turn instead)."""
        return False

    def converse(
        self, prompts: list[list[int]], seeds: list[int], params: GenerationParams, on_turn_end: OnTurnEnd
    ) -> None:
        """Decode each prompt as a conversation of turns until every one is over (seeds[i]: conversation
        i's). When a turn ends (an EOS, or the conversation's max_tokens, model and fed-in tokens together,
        used up), `on_turn_end(i, turn_ids, turn_logprobs)` returns a future of the tokens to feed in before
        the next turn (a tool result and the next turn's template), or None, or a future of None, when the
        conversation is over. Turns of other conversations go on while one waits: what a conversation
        samples depends on its seed, the weights and what was fed in, never on when. A future's exception
        is raised from here."""
        raise NotImplementedError(f"the {self.name} engine does not continue conversations across turns")

    def max_model_len(self) -> int | None:
        """The longest sequence (prompt + completion) the model takes; None: no known limit. Multi-turn
        rollouts stop appending tool results before a conversation reaches it (as TRL's loop does)."""
        return None

    def generation_stats(self) -> dict[str, float]:
        """What the last `generate` measured about itself, for the worker's log (empty: nothing)."""
        return {}

    @abc.abstractmethod
    def load_weights(self, path: str, transport: WeightTransport | None = None) -> None:
        """Replace the weights with the version published at `path`, which travels by `transport` (the one
        its row names; None: a folder of files, as sync volume writes them)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the model (the worker is exiting)."""
