"""Conversations across turns on vLLM's engine: a turn that ends leaves the batch, its next one rejoins it.

Who calls it: mortal.workers.rollout.engines.vllm_engine (VllmEngine.converse), for the tool loop's
continuous path (mortal.workers.rollout.multiturn). vLLM batches continuously on its own; what the offline
`LLM.generate` call lacks is a way to add a request while others decode. Here vLLM's engine is stepped
directly (`LLMEngine.add_request`, `step`, `has_unfinished_requests`, `abort_request`):
  1. Every conversation's first turn is a request (its prompt, its seed, the whole token budget).
  2. The engine steps; a request that finishes is the end of a turn, handed to `on_turn_end`, which answers
     with a future of the tokens to feed in (a tool result and the next turn's template) or of None.
  3. Between steps, each answered future whose conversation has room left becomes a new request: the whole
     history (prompt, turns, fed tokens) as its prompt, the budget left as its max_tokens. vLLM's prefix
     caching finds the history's K/V, so only the fed tokens are prefilled.
  4. With no request running, it waits for the first future to answer; it returns when none is left.
Turn k (from 0) of a conversation samples with a seed made from the conversation's seed and k, so what a
conversation samples depends on its seed, the weights and what was fed in, not on when its tools answered
(up to vLLM's own numerics, which depend on the batch).
What it must not do: leave a request running when it raises (a future's exception aborts the rest), or
send a conversation past its budget (model and fed tokens together, as the transformers engine counts).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mortal.workers import schedule
from mortal.workers.rollout.engines.base import Completion, OnTurnEnd, cut_at_eos

_CALLS = itertools.count()  # request ids unique over the engine's life: vLLM refuses a reused one


def completion_of(child: Any, eos_ids: list[int]) -> Completion:
    """A vLLM CompletionOutput's tokens and their sampled logprobs, up to and including its first EOS."""
    if child.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although SamplingParams asked for them")
    ids = list(child.token_ids)
    logprobs = [step[token].logprob for step, token in zip(child.logprobs, ids, strict=True)]
    return cut_at_eos(ids, logprobs, eos_ids)


class VllmDroppedRequests(RuntimeError):
    """vLLM holds none of the requests still waited on (it dropped them without a finished output)."""

    def __init__(self, requests: list[str]) -> None:
        super().__init__(f"vLLM dropped requests {', '.join(requests)} without finishing them")
        self.requests = requests


@dataclass
class _Conversation:
    """One conversation's history (prompt and everything after it) and its count of finished turns."""

    seed: int
    history: list[int]
    used: int = 0  # completion tokens so far: the model's and the fed ones
    turns: int = 0

    def turn_seed(self) -> int:
        """The next turn's seed: the conversation's for its first, then one made from it and the turn's
        number (the conversation's seed stands for its sample)."""
        return schedule.turn_seed(self.seed, 0, self.turns) if self.turns else self.seed


class Conversations:
    """One `converse` call: its conversations, the engine's requests of them, the futures waited on.

    `sampling(seed, max_tokens)` makes the SamplingParams of one turn; `prompt(ids)` vLLM's prompt of ids."""

    def __init__(
        self,
        engine: Any,
        sampling: Callable[[int, int], Any],
        prompt: Callable[[list[int]], Any],
        eos_ids: list[int],
        max_tokens: int,
    ) -> None:
        self.engine, self.sampling, self.prompt = engine, sampling, prompt
        self.eos_ids, self.max_tokens = eos_ids, max_tokens
        self.call = next(_CALLS)
        self.by_request: dict[str, int] = {}
        self.waiting: dict[concurrent.futures.Future[list[int] | None], int] = {}

    def run(self, prompts: list[list[int]], seeds: list[int], on_turn_end: OnTurnEnd) -> None:
        """Steps 1-4 of the module docstring."""
        conversations = [_Conversation(seed, list(ids)) for ids, seed in zip(prompts, seeds, strict=True)]
        try:
            for i in range(len(conversations)):
                self._submit(i, conversations[i])
            while self.by_request or self.waiting:
                if self.by_request:
                    if not self.engine.has_unfinished_requests():  # never finished: stepping would spin
                        raise VllmDroppedRequests(sorted(self.by_request))
                    for output in self.engine.step():
                        if output.finished:
                            self._turn_ended(output, conversations, on_turn_end)
                else:
                    concurrent.futures.wait(self.waiting, return_when=concurrent.futures.FIRST_COMPLETED)
                self._resume_answered(conversations)
        except BaseException:
            if self.by_request:
                self.engine.abort_request(list(self.by_request))
            for future in self.waiting:
                future.cancel()
            raise

    def _submit(self, i: int, conversation: _Conversation) -> None:
        """A request for the conversation's next turn: its history, its turn's seed, the budget left."""
        seed = conversation.turn_seed()
        request = f"mortal-{self.call}-{i}-{conversation.turns}"
        budget = self.max_tokens - conversation.used
        self.engine.add_request(request, self.prompt(conversation.history), self.sampling(seed, budget))
        self.by_request[request] = i

    def _turn_ended(self, output: Any, conversations: list[_Conversation], on_turn_end: OnTurnEnd) -> None:
        """Step 2: a finished request's tokens (up to its EOS) to the history and to `on_turn_end`."""
        i = self.by_request.pop(output.request_id)
        conversation = conversations[i]
        turn = completion_of(output.outputs[0], self.eos_ids)
        conversation.history += turn.ids
        conversation.used += len(turn.ids)
        conversation.turns += 1
        future = on_turn_end(i, turn.ids, turn.logprobs)
        if future is not None:
            self.waiting[future] = i

    def _resume_answered(self, conversations: list[_Conversation]) -> None:
        """Step 3: answered futures' tokens fed in and the next turn asked for (or the conversation over)."""
        for future in [f for f in self.waiting if f.done()]:
            i = self.waiting.pop(future)
            fed = future.result()
            conversation = conversations[i]
            if not fed or conversation.used + len(fed) >= self.max_tokens:  # no room to sample after them
                continue
            conversation.history += fed
            conversation.used += len(fed)
            self._submit(i, conversation)
