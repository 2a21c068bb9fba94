"""Conversations decoded across turns in the static decoder's rows: a row whose turn ends waits for its tool
results with its KV cache kept, and rejoins the running batch with only the new tokens fed in.

Who calls it: mortal.workers.rollout.engines.transformers_engine (`converse`, on its graph thread) for
mortal.workers.rollout.multiturn's continuous path: every rollout of a task is one conversation.
The loop, per task:
  1. Each row takes a conversation: its prompt is prefilled into the row (columns 0..P-1) and its first token
     sampled; conversations past the rows wait for a free row.
  2. Decode steps replay (one captured graph per shape, as single-turn) over every row; a row that sampled
     an end-of-turn token, or filled its T completion columns, freezes in place (its KV cache kept).
  3. Every `sync_every` steps, a read-back is copied to the host while the next steps are queued, and the one
     before it is read (so the GPU never waits for Python): each row it shows frozen hands its new turn to
     `on_turn_end`, which returns a future of the tokens to feed in next (a tool result and the next turn's
     template), or None when the conversation is over. The row waits; the other rows keep decoding. A
     read-back taken before a row's last prefill or append says nothing of its current turn.
  4. A finished future's tokens are appended to the row in one forward with every other row resumed at
     this check (turn_append: each written at its own columns and seeing its own cache; on CUDA a graph
     replayed per bucket of rows and width), and the token after them sampled: nothing of the history is
     prefilled again, and the row decodes on with the others. A conversation that is over frees its row for
     a waiting one.
  5. With no row decoding and futures outstanding, wait for the first to finish; the call ends when every
     conversation is over.
Sampling: each row draws its noise from a counter-based hash (hashed_noise) of (its conversation's key,
token index, token id), not from torch's generator, so a conversation's tokens depend on its key, the weights
and its tool results only, never on when its tools answered or which row it ran in (exact resume replays
a task).
What it must not do: read the GPU inside a step (the graph replays blind), let a frozen row advance or write
anywhere but its own last column, or call the user's tools itself (the futures do, off this thread).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mortal.workers.rollout.engines.base import OnTurnEnd
from mortal.workers.rollout.engines.hashed_noise import compiled_sample, hashed_sample
from mortal.workers.rollout.engines.static_decode import (
    PreparedShape,
    Prompts,
    RowCache,
    Sampling,
    StaticDecoder,
)
from mortal.workers.rollout.engines.turn_append import TurnAppender
from mortal.workers.rollout.engines.turn_state import TurnState

APPENDS = "turn appends"  # a shape's TurnAppender, in PreparedShape.extras
# Decode steps between read-backs. A read-back is copied while the next steps run and read one interval
# later, so it costs the GPU no wait; a turn's end is seen within two intervals, and a tool loop's turns are
# a few tokens each, so the interval is short.
TURN_SYNC_EVERY = 2


class TurnStepper:
    """The stepper (static_decode.Stepper) of conversations: rows that ended a turn stay put."""

    kind = "turns"
    new_state = TurnState  # (rows, prompt_len, max_tokens, vocab, dtype, device), as Stepper.new_state

    def step_function(
        self,
        forward: Callable[..., Any],
        cache: RowCache,
        state: TurnState,
        sampling: Sampling,
        compiled: bool = False,
    ) -> Callable[[], None]:
        """One decode step over every row: fixed-shape tensor ops only (it is recorded as a CUDA graph).
        `compiled`: the sampling is compiled too (hashed_noise.compiled_sample says why)."""
        last_column = state.prompt_len - 1
        max_tokens = state.max_tokens
        sample = compiled_sample if compiled else hashed_sample

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
            token, logprob = sample(logits, sampling, state.keys, state.t, state.vocab_hash)
            # 2. recorded at each row's t (a frozen row's lands past its conversation, never kept)
            at = state.t.clamp(max=max_tokens)[:, None]
            state.tokens.scatter_(1, at, token[:, None])
            state.logprobs.scatter_(1, at, logprob[:, None])
            state.ended.logical_or_(state.stop[token] & live)
            # 3. live rows move on
            state.last_token.copy_(torch.where(live[:, None], token[:, None], state.last_token))
            state.positions.add_(live.long()[:, None])
            state.t.add_(live.long())

        return step


TURNS = TurnStepper()


@dataclass
class TurnStats:
    """What one converse did, for the worker's log: rows, decode steps, read-backs, turns, tokens appended to
    rows (tool answers), prompts prefilled, and the seconds this thread spent appending, prefilling and
    waiting with every row on a future (host seconds: a read-back waits for the GPU work queued before it).
    `read_wait_seconds` against `seconds` says which side waits: the host on the GPU (much of the call spent
    in read-back waits) or the GPU on the host (little: the GPU had run out of queued steps by then); the
    host's own parts (queueing steps, handing turns over, appends, prefills) say where its time went."""

    rows: int
    conversations: int
    decode_steps: int = 0
    checks: int = 0  # read-backs of the rows' ends
    turns: int = 0
    appends: int = 0  # forwards (or their graphs' replays) that appended tokens
    appended_tokens: int = 0
    waits: int = 0  # times every row waited on tools at once
    prefills: int = 0  # eager prefills of prompts into rows
    append_seconds: float = 0.0
    prefill_seconds: float = 0.0
    wait_seconds: float = 0.0
    read_wait_seconds: float = 0.0  # blocked in read-backs' waits: the GPU had not reached them yet
    queue_seconds: float = 0.0  # queueing decode steps and their read-backs (graph replays, async copies)
    hand_over_seconds: float = 0.0  # handing ended turns to on_turn_end (after the read-back's wait)
    seconds: float = 0.0  # the whole call
    # each conversation's model tokens over its turns (fed tokens not counted): the call lasts as long as the
    # longest conversation, so the longest against the median says how much of it was one straggler
    model_tokens: list[int] = field(default_factory=list)


class TurnSchedule:
    """Which conversation each row holds and what it is doing; pure bookkeeping, no tensors.

    A row is free, decoding (live) or waiting for its future. `turn_start[row]` is the token index its
    current turn began at (after any tokens fed in)."""

    def __init__(self, rows: int, conversations: int) -> None:
        self.held: list[int | None] = [None] * rows
        self.live = [False] * rows
        self.turn_start = [0] * rows
        # the first read-back that shows the row's current turn: one taken after its prefill or append
        self.shown_from = [0] * rows
        self.parked_at = [0] * rows  # a waiting row's token index (frozen rows do not move)
        self.waiting: dict[concurrent.futures.Future[list[int] | None], int] = {}  # future -> row
        self.next_conversation = 0
        self.conversations = conversations

    def assign(self, next_reading: int) -> list[tuple[int, int]]:
        """Free rows given the next conversations, in order: (row, conversation). `next_reading`: the number
        of the next read-back, the first taken after these rows' prefill."""
        given = []
        for row, held in enumerate(self.held):
            if held is None and self.next_conversation < self.conversations:
                given.append((row, self.next_conversation))
                self.held[row], self.live[row], self.turn_start[row] = self.next_conversation, True, 0
                self.shown_from[row] = next_reading
                self.next_conversation += 1
        return given

    def turn_ended(self, row: int, reading: ReadBack) -> bool:
        """Whether read-back `reading` shows the live row's current turn over (an end-of-turn token, or its
        budget filled); a read-back taken before the row's last prefill or append shows an older turn."""
        if not self.live[row] or reading.number < self.shown_from[row]:
            return False
        return bool(reading.ended[row]) or reading.t[row] >= reading.max_tokens

    def park(self, row: int, future: concurrent.futures.Future[list[int] | None], t: int) -> None:
        self.live[row], self.parked_at[row] = False, t
        self.waiting[future] = row

    def release(self, row: int) -> None:
        self.held[row], self.live[row] = None, False

    def resume(self, row: int, turn_start: int, next_reading: int) -> None:
        self.live[row], self.turn_start[row] = True, turn_start
        self.shown_from[row] = next_reading

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


class ReadBack:
    """The rows' end flags, token indices and token records copied to the host after some decode steps,
    without waiting for them (pinned memory, asynchronous copies; on a CPU the copy is made at once).
    `number` orders read-backs; `wait()` waits for this copy only, not for the steps queued after it, and
    then `ended` and `t` hold one entry a row."""

    def __init__(self, state: TurnState, number: int) -> None:
        self.number = number
        self.max_tokens = state.max_tokens
        records = (state.ended, state.t, state.tokens, state.logprobs)
        self._done: torch.cuda.Event | None = None
        if state.tokens.device.type == "cuda":
            copies = [torch.empty(r.shape, dtype=r.dtype, pin_memory=True) for r in records]
            for copy, record in zip(copies, records, strict=True):
                copy.copy_(record, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            copies = [r.clone() for r in records]
        self._ended, self._t, self.tokens, self.logprobs = copies
        self.ended: list[bool] = []
        self.t: list[int] = []

    def wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        if not self.t:  # as lists once: rows are looked up one by one
            self.ended, self.t = self._ended.tolist(), self._t.tolist()


class TurnDecoder:
    """Conversations over a StaticDecoder's rows (the module docstring: the loop). `last_stats` after each."""

    def __init__(self, decoder: StaticDecoder, sync_every: int = TURN_SYNC_EVERY) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every ({sync_every}) must be at least 1")
        self.decoder = decoder
        self.sync_every = sync_every
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
        started = time.perf_counter()
        decoder = self.decoder
        conversations, width = input_ids.shape
        shape = decoder.prepare(conversations, width, max_tokens, sampling, min_rows, stepper=TURNS)
        state: TurnState = shape.state  # type: ignore[assignment]
        shape.cache.reset()
        state.stop.zero_()
        state.stop[[i for i in eos_ids if 0 <= i < decoder.vocab]] = True
        state.ended.fill_(True)  # rows without a conversation stay frozen
        prompts = decoder.prompts(input_ids, attention_mask, max_tokens, eos_ids)
        key_of = torch.tensor(keys, dtype=torch.long, device=decoder.device)
        schedule = TurnSchedule(state.rows, conversations)
        stats = TurnStats(rows=state.rows, conversations=conversations, model_tokens=[0] * conversations)
        readings = 0  # read-backs taken so far; the next one's number
        self._fill(shape, prompts, key_of, schedule.assign(readings), sampling, stats)
        pending: ReadBack | None = None
        try:
            while not schedule.done:
                if schedule.any_live:
                    queued = time.perf_counter()
                    for _ in range(self.sync_every):
                        shape.advance()
                    stats.decode_steps += self.sync_every
                    taken = ReadBack(state, readings)
                    stats.queue_seconds += time.perf_counter() - queued
                    readings += 1
                    if pending is not None:  # the one before: read while the steps just queued run
                        self._hand_over(pending, state, schedule, on_turn_end, stats)
                    pending = taken
                elif pending is not None:  # no row decodes: the last read-back is all there is to see
                    self._hand_over(pending, state, schedule, on_turn_end, stats)
                    pending = None
                elif schedule.waiting:
                    stats.waits += 1
                    waited = time.perf_counter()
                    concurrent.futures.wait(schedule.waiting, return_when=concurrent.futures.FIRST_COMPLETED)
                    stats.wait_seconds += time.perf_counter() - waited
                self._take_answers(shape, schedule, stats, sampling, readings)
                self._fill(shape, prompts, key_of, schedule.assign(readings), sampling, stats)
        finally:
            for future in schedule.waiting:
                future.cancel()
        stats.checks = readings
        stats.seconds = time.perf_counter() - started
        self.last_stats = stats

    def _hand_over(
        self,
        reading: ReadBack,
        state: TurnState,
        schedule: TurnSchedule,
        on_turn_end: OnTurnEnd,
        stats: TurnStats,
    ) -> None:
        """Step 3: each live row whose turn `reading` shows over hands the turn over (its tokens from the
        read-back's copy: reading the rows themselves would wait for the steps queued since)."""
        started = time.perf_counter()
        reading.wait()
        handing = time.perf_counter()
        stats.read_wait_seconds += handing - started
        for row in [r for r in range(state.rows) if schedule.turn_ended(r, reading)]:
            start, stop = schedule.turn_start[row], reading.t[row]
            stats.turns += 1
            conversation = schedule.held[row]
            assert conversation is not None
            stats.model_tokens[conversation] += stop - start
            ids = reading.tokens[row, start:stop].tolist()
            logprobs = reading.logprobs[row, start:stop].tolist()
            future = on_turn_end(conversation, ids, logprobs)
            if future is None:
                schedule.release(row)
            else:  # even at the budget's end: the caller decides (its tools run, as TRL's loop runs them)
                schedule.park(row, future, stop)
        stats.hand_over_seconds += time.perf_counter() - handing

    def _take_answers(
        self,
        shape: PreparedShape,
        schedule: TurnSchedule,
        stats: TurnStats,
        sampling: Sampling,
        next_reading: int,
    ) -> None:
        """Step 4: finished futures' tokens appended to their rows (or the rows freed); exceptions raised."""
        state = shape.state
        resumed = []
        for future in [f for f in schedule.waiting if f.done()]:
            row = schedule.waiting.pop(future)
            fed = future.result()
            t = schedule.parked_at[row]  # a frozen row's t, as last read back
            if not fed or t + len(fed) >= state.max_tokens:  # no room left to sample after them
                schedule.release(row)
            else:
                resumed.append((row, t, list(fed)))
        if resumed:
            started = time.perf_counter()
            self._append(shape, resumed, sampling)
            stats.append_seconds += time.perf_counter() - started
            stats.appends += 1
            stats.appended_tokens += sum(len(fed) for _, _, fed in resumed)
            for row, t, fed in resumed:
                schedule.resume(row, t + len(fed), next_reading)

    def _append(
        self, shape: PreparedShape, resumed: list[tuple[int, int, list[int]]], sampling: Sampling
    ) -> None:
        """The shape's appender (turn_append, made at its first append) appends every (row, t, tokens)
        resumed and samples the token after them; the rows decode on from there."""
        appender = shape.extras.get(APPENDS)
        if appender is None:
            state: TurnState = shape.state  # type: ignore[assignment]
            record = self.decoder.compile and state.tokens.device.type == "cuda"
            appender = shape.extras[APPENDS] = TurnAppender(
                self.decoder.model, shape.cache, state, sampling, record
            )
        appender.append(resumed)

    def _fill(
        self,
        shape: PreparedShape,
        prompts: Prompts,
        key_of: torch.Tensor,
        given: list[tuple[int, int]],
        sampling: Sampling,
        stats: TurnStats,
    ) -> None:
        """Step 1: prefill the given conversations' prompts into their rows and sample each first token."""
        if not given:
            return
        started = time.perf_counter()
        state: TurnState = shape.state  # type: ignore[assignment]
        device = state.tokens.device
        rows = torch.tensor([row for row, _ in given], device=device)
        chosen = [c for _, c in given]
        logits = self.decoder.prefill(shape, prompts, rows, chosen)
        state.keys[rows] = key_of[torch.tensor(chosen, device=device)]
        first = torch.zeros(len(given), dtype=torch.long, device=device)
        token, logprob = hashed_sample(logits, sampling, state.keys[rows], first, state.vocab_hash)
        state.tokens[rows, 0], state.logprobs[rows, 0] = token, logprob
        state.last_token[rows] = token[:, None]
        state.t[rows] = 1
        state.ended[rows] = state.stop[token]
        stats.prefills += 1
        stats.prefill_seconds += time.perf_counter() - started
