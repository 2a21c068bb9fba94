"""Conversations decoded across turns in the static decoder's rows: a row whose turn ends waits for its tool
results with its KV cache kept, and rejoins the running batch with only the new tokens fed in.

Who calls it: mortal.workers.rollout.engines.transformers_engine (`converse`, on its graph thread) for
mortal.workers.rollout.multiturn's continuous path: every rollout of a task is one conversation.
The loop, per task:
  1. Each row takes a conversation: its prompt is prefilled into the row (columns 0..P-1) and its first token
     sampled; conversations past the rows wait for a free row.
  2. Decode steps replay (one captured graph per shape, as single-turn) over every row; a row that sampled
     an end-of-turn token, or filled its T completion columns, freezes in place (its KV cache kept).
  3. Every `sync_every` steps, one read-back: each frozen row's new turn is handed to `on_turn_end`, which
     returns a future of the tokens to feed in next (a tool result and the next turn's template), or None
     when the conversation is over. The row waits; the other rows keep decoding.
  4. A finished future's tokens are written into the row's forced-token buffer: the next steps feed them in
     one per step (their logprobs 0, never sampled) and the row samples again after the last, at the
     position the conversation reached: no re-prefill of the history. A conversation that is over frees its
     row for a waiting one.
  5. With no row decoding and futures outstanding, wait for the first to finish; the call ends when every
     conversation is over.
Sampling: each row draws its noise from a counter-based hash of (its conversation's key, token index, token
id), not from torch's generator, so a conversation's tokens depend on its key, the weights and its tool
results only, never on when its tools answered or which row it ran in (exact resume replays a task).
What it must not do: read the GPU inside a step (the graph replays blind), let a frozen row advance or write
anywhere but its own last column, or call the user's tools itself (the futures do, off this thread).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mortal.workers.rollout.engines.base import OnTurnEnd
from mortal.workers.rollout.engines.static_decode import (
    DecodeState,
    PreparedShape,
    Prompts,
    RowCache,
    Sampling,
    StaticDecoder,
    processed_logprobs,
)

MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2**32). Why hand-written:
    the step must draw noise per row from (key, position) inside a CUDA graph, which torch's generators
    cannot do per row. A product past 2**63 wraps, and the mask keeps its low 32 bits, which are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_noise(keys: torch.Tensor, t: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """[R, V] exponential noise for the exponential race, a pure function of each row's key, its token index
    t and the token id (vocab_hash: mix32 of the ids). Uniforms of 24 bits, the float32 mantissa."""
    step = mix32((keys + t * 0x9E3779B9) & MASK32)
    bits = mix32(step[:, None] ^ vocab_hash[None, :]) >> 8
    uniform = (bits.float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def hashed_sample(
    logits: torch.Tensor, sampling: Sampling, keys: torch.Tensor, t: torch.Tensor, vocab_hash: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the processed distribution, the race run on row_noise."""
    logprobs = processed_logprobs(logits, sampling)
    tokens = (logprobs.exp() / row_noise(keys, t, vocab_hash)).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def conversation_key(seed: int) -> int:
    """A conversation's 32-bit noise key from its seed (any int)."""
    folded = torch.tensor([(seed & MASK32) ^ ((seed >> 32) & MASK32)], dtype=torch.long)
    return int(mix32(mix32(folded) ^ 0x5BD1E995)[0])


class TurnState(DecodeState):
    """The single-turn state plus, per row: its noise key, the tokens to feed in at token indices (forced)
    and the index they stop at (forced_until)."""

    def __init__(
        self,
        rows: int,
        prompt_len: int,
        max_tokens: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(rows, prompt_len, max_tokens, vocab, dtype, device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        self.forced = torch.zeros(rows, max_tokens + 1, dtype=torch.long, device=device)
        self.forced_until = torch.zeros(rows, dtype=torch.long, device=device)
        self.vocab_hash = mix32(torch.arange(vocab, dtype=torch.long, device=device))


class TurnStepper:
    """The stepper (static_decode.Stepper) of conversations: frozen rows stay put, forced tokens are fed."""

    kind = "turns"

    def new_state(
        self,
        rows: int,
        prompt_len: int,
        max_tokens: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> TurnState:
        return TurnState(rows, prompt_len, max_tokens, vocab, dtype, device)

    def step_function(
        self, forward: Callable[..., Any], cache: RowCache, state: TurnState, sampling: Sampling
    ) -> Callable[[], None]:
        """One decode step over every row: fixed-shape tensor ops only (it is recorded as a CUDA graph)."""
        last_column = state.prompt_len - 1
        max_tokens = state.max_tokens

        def step() -> None:
            # 1. a row decodes while below T and not ended; a frozen row rewrites its last token's K/V at the
            #    same column and position (the same values) and records nothing it keeps
            live = (state.t < max_tokens) & ~state.ended
            torch.add(state.t, last_column, out=state.columns)
            state.mask.scatter_(3, state.columns.view(-1, 1, 1, 1), 0.0)
            logits = forward(
                input_ids=state.last_token,
                position_ids=state.positions,
                attention_mask=state.mask,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            sampled, logprob = hashed_sample(logits, sampling, state.keys, state.t, state.vocab_hash)
            # 2. a forced token replaces the sampled one (logprob 0, never an end of turn)
            at = state.t.clamp(max=max_tokens)[:, None]
            forced = state.t < state.forced_until
            token = torch.where(forced, state.forced.gather(1, at).squeeze(1), sampled)
            logprob = torch.where(forced, torch.zeros_like(logprob), logprob)
            state.tokens.scatter_(1, at, token[:, None])
            state.logprobs.scatter_(1, at, logprob[:, None])
            state.ended.logical_or_(state.stop[token] & ~forced & live)
            # 3. live rows move on
            state.last_token.copy_(torch.where(live[:, None], token[:, None], state.last_token))
            state.positions.add_(live.long()[:, None])
            state.t.add_(live.long())

        return step


TURNS = TurnStepper()


@dataclass
class TurnStats:
    """What one converse measured: rows, decode steps, turns, and the share of row-steps that produced a
    conversation's token (the rest: rows frozen or free)."""

    rows: int
    conversations: int
    decode_steps: int = 0
    turns: int = 0
    useful_tokens: int = 0  # the conversations' tokens, model and fed in
    waits: int = 0  # times every row waited on tools at once

    @property
    def useful_fraction(self) -> float:
        return self.useful_tokens / max(self.rows * self.decode_steps, 1)


class TurnSchedule:
    """Which conversation each row holds and what it is doing; pure bookkeeping, no tensors.

    A row is free, decoding (live) or waiting for its future. `turn_start[row]` is the token index its
    current turn began at (after any tokens fed in)."""

    def __init__(self, rows: int, conversations: int) -> None:
        self.held: list[int | None] = [None] * rows
        self.live = [False] * rows
        self.turn_start = [0] * rows
        self.parked_at = [0] * rows  # a waiting row's token index (frozen rows do not move)
        self.waiting: dict[concurrent.futures.Future[list[int] | None], int] = {}  # future -> row
        self.next_conversation = 0
        self.conversations = conversations

    def assign(self) -> list[tuple[int, int]]:
        """Free rows given the next conversations, in order: (row, conversation)."""
        given = []
        for row, held in enumerate(self.held):
            if held is None and self.next_conversation < self.conversations:
                given.append((row, self.next_conversation))
                self.held[row], self.live[row], self.turn_start[row] = self.next_conversation, True, 0
                self.next_conversation += 1
        return given

    def park(self, row: int, future: concurrent.futures.Future[list[int] | None], t: int) -> None:
        self.live[row], self.parked_at[row] = False, t
        self.waiting[future] = row

    def release(self, row: int) -> None:
        self.held[row], self.live[row] = None, False

    def resume(self, row: int, turn_start: int) -> None:
        self.live[row], self.turn_start[row] = True, turn_start

    @property
    def any_live(self) -> bool:
        return any(self.live)

    @property
    def done(self) -> bool:
        return (
            not self.waiting
            and all(h is None for h in self.held)
            and self.next_conversation == self.conversations
        )


class TurnDecoder:
    """Conversations over a StaticDecoder's rows (the module docstring: the loop). `last_stats` after each."""

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder = decoder
        self.last_stats: TurnStats | None = None

    @torch.no_grad()
    def converse(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        keys: list[int],
        max_tokens: int,
        sampling: Sampling,
        eos_ids: list[int],
        on_turn_end: OnTurnEnd,
        min_rows: int = 0,
    ) -> None:
        """Run every conversation (left-padded prompts [C, P], one noise key each) to its end; what each
        turn said reaches the caller through `on_turn_end` only. `max_tokens`: each conversation's whole
        budget, model and fed-in tokens together (T columns of its row)."""
        decoder = self.decoder
        conversations, width = input_ids.shape
        shape = decoder.prepare(conversations, width, max_tokens, sampling, min_rows, stepper=TURNS)
        state: TurnState = shape.state  # type: ignore[assignment]
        shape.cache.reset()
        state.stop.zero_()
        state.stop[[i for i in eos_ids if 0 <= i < decoder.vocab]] = True
        state.ended.fill_(True)  # rows without a conversation stay frozen
        state.forced_until.zero_()
        prompts = Prompts(
            input_ids.to(decoder.device),
            attention_mask.to(decoder.device, torch.bool),
            max_tokens,
            decoder.dtype,
        )
        key_of = torch.tensor(keys, dtype=torch.long, device=decoder.device)
        schedule = TurnSchedule(state.rows, conversations)
        stats = TurnStats(rows=state.rows, conversations=conversations)
        self._fill(shape, prompts, key_of, schedule.assign(), sampling)
        try:
            while not schedule.done:
                if schedule.any_live:
                    for _ in range(decoder.sync_every):
                        shape.advance()
                    stats.decode_steps += decoder.sync_every
                    self._hand_over(state, schedule, on_turn_end, stats)
                elif schedule.waiting:
                    stats.waits += 1
                    concurrent.futures.wait(schedule.waiting, return_when=concurrent.futures.FIRST_COMPLETED)
                self._take_answers(state, schedule, stats)
                self._fill(shape, prompts, key_of, schedule.assign(), sampling)
        finally:
            for future in schedule.waiting:
                future.cancel()
        self.last_stats = stats

    def _hand_over(
        self, state: TurnState, schedule: TurnSchedule, on_turn_end: OnTurnEnd, stats: TurnStats
    ) -> None:
        """Step 3: one read-back; each live row that ended its turn or its budget hands the turn over."""
        ended, t = torch.stack([state.ended.long(), state.t]).tolist()
        done = [r for r in range(state.rows) if schedule.live[r] and (ended[r] or t[r] >= state.max_tokens)]
        if not done:
            return
        rows = torch.tensor(done, device=state.tokens.device)
        tokens, logprobs = state.tokens[rows].tolist(), state.logprobs[rows].tolist()
        for row, ids, lps in zip(done, tokens, logprobs, strict=True):
            start, stop = schedule.turn_start[row], t[row]
            stats.turns += 1
            conversation = schedule.held[row]
            assert conversation is not None
            future = on_turn_end(conversation, ids[start:stop], lps[start:stop])
            if future is None:
                stats.useful_tokens += stop
                schedule.release(row)
            else:  # even at the budget's end: the caller decides (its tools run, as TRL's loop runs them)
                schedule.park(row, future, stop)

    def _take_answers(self, state: TurnState, schedule: TurnSchedule, stats: TurnStats) -> None:
        """Step 4: finished futures' tokens fed into their rows (or the rows freed); exceptions raised."""
        finished = [f for f in schedule.waiting if f.done()]
        for future in finished:
            row = schedule.waiting.pop(future)
            fed = future.result()
            t = schedule.parked_at[row]  # a frozen row's t, as last read back
            if not fed or t + len(fed) > state.max_tokens:
                stats.useful_tokens += t
                schedule.release(row)
                continue
            state.forced[row, t : t + len(fed)] = torch.tensor(fed, device=state.forced.device)
            state.forced_until[row] = t + len(fed)
            state.ended[row] = False
            schedule.resume(row, t + len(fed))

    def _fill(
        self,
        shape: PreparedShape,
        prompts: Prompts,
        key_of: torch.Tensor,
        given: list[tuple[int, int]],
        sampling: Sampling,
    ) -> None:
        """Step 1: prefill the given conversations' prompts into their rows and sample each first token."""
        if not given:
            return
        state: TurnState = shape.state  # type: ignore[assignment]
        device = state.tokens.device
        rows = torch.tensor([row for row, _ in given], device=device)
        chosen = torch.tensor([c for _, c in given], device=device)
        logits = self.decoder.prefill(shape, prompts, rows, chosen)
        state.keys[rows] = key_of[chosen]
        first = torch.zeros(len(given), dtype=torch.long, device=device)
        token, logprob = hashed_sample(logits, sampling, state.keys[rows], first, state.vocab_hash)
        state.tokens[rows, 0], state.logprobs[rows, 0] = token, logprob
        state.last_token[rows] = token[:, None]
        state.t[rows] = 1
        state.forced_until[rows] = 0
        state.ended[rows] = state.stop[token]
