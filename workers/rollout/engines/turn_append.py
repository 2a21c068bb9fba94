"""Tokens appended to rows mid-conversation (a tool's answer and the next turn's template): one forward for
every row resumed at a check, recorded as a CUDA graph per bucket of (rows, width) and replayed after.

Who calls it: turn_decode.TurnDecoder, step 4 of its loop, on the engine's graph thread; one TurnAppender
per prepared shape (its cache and state), kept with the shape.
Why graphs: an eager forward of a transformers model spends its time launching each layer's kernels from
Python, and the GPU waits for it (the decode steps before it were read back). A tool loop appends at most
checks of a step, so those forwards were a large part of a step's generation.
The layout, fixed per bucket so that one recorded graph serves every append of it:
  1. The k rows resumed are padded to the next power of two by repeating the first one: a repeated row
     computes and writes exactly what the first does, so its writes change nothing.
  2. Each row's inputs are its last token (the end of its turn, whose K/V no decode step may have written
     yet) and the tokens fed to it, right-aligned in a width of a power of two (at least MIN_WIDTH): the
     slots before them repeat the last token at its own column and position and see what it sees, so their
     K/V equal its K/V and their writes change nothing either. Every row's last input is its last fed
     token, so the head runs on one position (logits_to_keep=1), not on the width.
  3. The token after the fed ones is sampled (noise index t + fed), the fed tokens go into the row's token
     record (logprob 0; a padding slot writes 0 to the spare column T), and the row decodes on from there.
  4. A bucket's first append runs eagerly, then its graph is recorded (recording runs nothing); buckets of
     more than GRAPH_TOKENS inputs always run eagerly, since a graph keeps its peak activations allocated.
What it must not do: read the GPU back, write anything of a row not resumed, or change a column of a
resumed row other than its last token's and the fed tokens' (the rest of its cache is its conversation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mortal.workers.rollout.engines.hashed_noise import hashed_sample
from mortal.workers.rollout.engines.static_decode import AppendedTokens, RowCache, Sampling
from mortal.workers.rollout.engines.turn_state import TurnState

MIN_WIDTH = 8  # the narrowest bucket: a calculator's answer and the next turn's template fit in one or two
# The most inputs (rows x width) an append is recorded for; wider appends (a long tool output) run eagerly.
GRAPH_TOKENS = 8192


@dataclass(frozen=True)
class Bucket:
    """An append's padded shape: rows (a power of two) by width (a power of two, at least MIN_WIDTH)."""

    rows: int
    width: int

    @classmethod
    def of(cls, resumed: list[tuple[int, int, list[int]]]) -> Bucket:
        rows = 1 << (len(resumed) - 1).bit_length()
        inputs = 1 + max(len(fed) for _, _, fed in resumed)
        return cls(rows, max(MIN_WIDTH, 1 << (inputs - 1).bit_length()))


class AppendInputs:
    """A bucket's input tensors on the device, rewritten in place before each of its appends: the rows,
    their token index t (the last token's index + 1), how many tokens each is fed, and those tokens
    right-aligned in [rows, width] (zeros before them)."""

    def __init__(self, bucket: Bucket, device: torch.device) -> None:
        self.bucket = bucket
        self.rows = torch.zeros(bucket.rows, dtype=torch.long, device=device)
        self.t = torch.zeros(bucket.rows, dtype=torch.long, device=device)
        self.fed_lengths = torch.ones(bucket.rows, dtype=torch.long, device=device)
        self.fed = torch.zeros(bucket.rows, bucket.width, dtype=torch.long, device=device)
        self.slots = torch.arange(bucket.width, device=device)
        self.batch = torch.arange(bucket.rows, device=device).repeat_interleave(bucket.width)
        self.position = self.slots.repeat(bucket.rows)

    def load(self, resumed: list[tuple[int, int, list[int]]]) -> None:
        """(row, t, fed tokens) of each resumed row, the first repeated to fill the bucket's rows; one host
        buffer, copied without waiting for the work queued on the device (pinned, asynchronous)."""
        width = self.bucket.width
        padded = resumed + [resumed[0]] * (self.bucket.rows - len(resumed))
        host = torch.zeros(len(padded), 3 + width, dtype=torch.long)
        for i, (row, t, fed) in enumerate(padded):
            host[i, 0], host[i, 1], host[i, 2] = row, t, len(fed)
            host[i, 3 + width - len(fed) :] = torch.tensor(fed, dtype=torch.long)
        if self.rows.device.type == "cuda":
            host = host.pin_memory()
        sent = host.to(self.rows.device, non_blocking=True)
        self.rows.copy_(sent[:, 0])
        self.t.copy_(sent[:, 1])
        self.fed_lengths.copy_(sent[:, 2])
        self.fed.copy_(sent[:, 3:])


class TurnAppender:
    """One shape's appends (the module docstring): each bucket's inputs, and its graph once recorded."""

    def __init__(
        self, model: Any, cache: RowCache, state: TurnState, sampling: Sampling, record: bool
    ) -> None:
        self.model, self.cache, self.state, self.sampling = model, cache, state, sampling
        self.record = record
        self.inputs: dict[Bucket, AppendInputs] = {}
        self.graphs: dict[Bucket, Callable[[], None]] = {}
        self._pool: Any = None

    @property
    def recorded(self) -> int:
        """Graphs recorded so far, one a bucket (for tests and the log)."""
        return len(self.graphs)

    @torch.no_grad()
    def append(self, resumed: list[tuple[int, int, list[int]]]) -> None:
        """Append each (row, t, fed tokens): the row's last token at column P + t - 1, its fed tokens after
        it, and the token after them sampled; each fed list holds at least one token and t + len(fed) < T."""
        bucket = Bucket.of(resumed)
        inputs = self.inputs.get(bucket)
        if inputs is None:
            inputs = self.inputs[bucket] = AppendInputs(bucket, self.state.tokens.device)
        inputs.load(resumed)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph()
            return
        self._run(inputs)
        if self.record and bucket.rows * bucket.width <= GRAPH_TOKENS:
            self.graphs[bucket] = self._recorded(inputs)

    def _recorded(self, inputs: AppendInputs) -> Callable[[], None]:
        """The append of these inputs as a CUDA graph (its eager run, just done, was the warm-up). Every
        bucket's graph draws on one memory pool: they replay one at a time, and none keeps an output."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._run(inputs)
        return graph.replay

    def _run(self, inputs: AppendInputs) -> None:
        """The append itself: fixed-shape tensor ops over `inputs` and the state, nothing read back."""
        state, bucket = self.state, inputs.bucket
        rows = inputs.rows
        pad = bucket.width - 1 - inputs.fed_lengths  # [k]: slots before the last token
        offset = (inputs.slots[None, :] - pad[:, None]).clamp(min=0)  # [k, F]: 0 up to the last token
        first = state.prompt_len + inputs.t - 1  # [k]: the last token's column (token i is at P + i)
        columns = first[:, None] + offset
        ids = torch.where(offset == 0, state.last_token[rows], inputs.fed)
        positions = state.positions[rows] + offset
        writes = AppendedTokens(
            rows, inputs.batch, inputs.position, rows.repeat_interleave(bucket.width), columns.flatten()
        )
        mask = append_mask(state, rows, first, columns)
        self.cache.writes.appended = writes
        try:
            logits = self.model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
        finally:
            self.cache.writes.appended = None
        after = inputs.t + inputs.fed_lengths  # the sampled token's index
        token, logprob = hashed_sample(logits, self.sampling, state.keys[rows], after, state.vocab_hash)
        fed_slot = offset > 0
        record_at = torch.where(fed_slot, inputs.t[:, None] + offset - 1, state.max_tokens)
        record_rows = rows[:, None].expand_as(record_at)
        state.tokens[record_rows, record_at] = torch.where(fed_slot, inputs.fed, 0)
        # zeros on the device: a Python scalar written by index is a host copy, which a graph cannot record
        state.logprobs[record_rows, record_at] = torch.zeros_like(record_at, dtype=state.logprobs.dtype)
        state.tokens[rows, after], state.logprobs[rows, after] = token, logprob
        state.last_token[rows] = token[:, None]
        state.positions[rows] = positions[:, -1:] + 1
        state.t[rows] = after + 1
        state.ended[rows] = state.stop[token]
        state.mask[writes.write_rows, 0, 0, writes.write_columns] = torch.zeros_like(
            writes.write_columns, dtype=state.mask.dtype
        )


def append_mask(
    state: TurnState, rows: torch.Tensor, first: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """[k, 1, F, P + T] additive: what each row saw before its last token's column `first` (its decode mask),
    then the columns from `first` to each input's own, causally (a padding slot, at `first`, sees what the
    last token does)."""
    seen = state.mask[rows, 0, 0] == 0  # [k, P + T]
    every = torch.arange(seen.shape[-1], device=seen.device)
    before = seen & (every[None, :] < first[:, None])
    window = (every[None, None, :] >= first[:, None, None]) & (every[None, None, :] <= columns[:, :, None])
    allowed = before[:, None, :] | window
    blocked = torch.finfo(state.mask.dtype).min
    additive = torch.zeros(allowed.shape, dtype=state.mask.dtype, device=seen.device)
    return additive.masked_fill(~allowed, blocked)[:, None]
