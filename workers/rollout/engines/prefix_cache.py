"""The prompt prefix every conversation of a call shares, prefilled once and copied into each row it fills;
its message-aligned pieces kept for the next call (the next task of the step).

Who calls it: mortal.workers.rollout.engines.static_decode (StaticDecoder.prompts builds it with the call's
Prompts and the decoder's PrefixChain; StaticDecoder.prefill writes it into the rows it fills), for
single-turn generation and for the turn decoder's conversations alike; TransformersEngine.load_weights
clears the chain.
Why: a tool-calling run's prompts begin with the same system prompt and tool schemas (hundreds of tokens) and
differ only in their last message; prefilling every row's whole prompt repeats that work once per row, and
once per task where a step's prompts are split over several tasks (a CPU rollout's are one prompt each). Here:
  1. The longest run of real tokens every prompt begins with (less its last token, so each row still has one
     to compute) is found once per call; shorter than MIN_SHARED_PREFIX, or with one prompt, nothing is kept.
  2. That prefix goes through the model once (one row), in pieces that end after each end-of-message token
     (the decoder's stop ids, which chat templates close messages with) and a last piece up to its end; each
     piece attends to the K/V of the pieces before it. A piece that ends at a message end and matches the
     kept chain (the same tokens after the same pieces) is taken from it, not computed; the others are
     computed and kept, replacing the chain from the first one that differed.
  3. Filling rows, the K/V is copied into each row's cache at the columns its prompt's first real tokens
     take (left padding moves them), and only the columns after the prefix are prefilled; they attend to the
     copy as they would have to their own.
Each row's positions count from its first real token, so the prefix's K/V (rotary or not) is the same in
every row; the values equal a whole prefill's up to floating-point summation order (the prefix runs as one
row, in pieces, instead of many). Where the pieces fall depends only on the call's own tokens, and a kept
piece holds exactly what computing it again would give, so a call's tokens and logprobs do not depend on the
calls before it (a resumed run samples what the first run did). MORTAL_SHARED_PREFIX=0 (mortal.workers.prefix)
turns it off.
What it must not do: write outside the filled rows' prompt columns, or keep pieces across a weight change
(PrefixChain.clear) or for another model; the chain holds at most one call's prefix between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from mortal.workers.prefix import MIN_SHARED_PREFIX, wanted


def common_length(ids: torch.Tensor, lengths: list[int]) -> int:
    """How many leading real tokens every left-padded prompt of [C, P] `ids` shares (`lengths`: each one's
    real tokens), at most the shortest one's length less one; 0 when that is fewer than MIN_SHARED_PREFIX
    or there is one prompt."""
    shortest = min(lengths)
    if len(lengths) < 2 or shortest - 1 < MIN_SHARED_PREFIX:
        return 0
    width = ids.shape[1]
    starts = torch.tensor([width - n for n in lengths], device=ids.device)
    aligned = ids.gather(1, starts[:, None] + torch.arange(shortest - 1, device=ids.device)[None, :])
    same = (aligned == aligned[:1]).all(dim=0)
    common = int(same.long().cumprod(dim=0).sum())
    return common if common >= MIN_SHARED_PREFIX else 0


def message_ends(tokens: list[int], boundary_ids: frozenset[int]) -> list[int]:
    """Where the pieces of a prefix end (step 2): after each of its boundary tokens, and at its end."""
    ends = [i + 1 for i, token in enumerate(tokens) if token in boundary_ids]
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    return ends


@dataclass(frozen=True)
class _Piece:
    """A computed piece of a prefix: its own tokens and each decoder layer's K/V of them ([heads, n, dim])."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixChain:
    """The message-aligned pieces of the last call's shared prefix, in order (step 2), for the next call.

    Kept by one decoder for one model; cleared when its weights change. A piece is kept only where it ends
    at a message end: the last piece of a prefix (up to where the prompts part) is the call's own."""

    def __init__(self) -> None:
        self.pieces: list[_Piece] = []
        self.computed_tokens = 0  # tokens put through the model for prefixes so far (tests read it)

    def clear(self) -> None:
        self.pieces = []

    def compute(
        self, model: Any, tokens: list[int], boundary_ids: frozenset[int], device: torch.device
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each decoder layer's K/V of `tokens` ([heads, len, dim]), piece by piece, kept pieces reused."""
        cache, start, kept = DynamicCache(), 0, []
        reusing = True
        for index, end in enumerate(message_ends(tokens, boundary_ids)):
            own = tuple(tokens[start:end])
            at_message_end = tokens[end - 1] in boundary_ids
            reusing = reusing and index < len(self.pieces) and self.pieces[index].tokens == own
            if reusing:
                piece = self.pieces[index]
                for layer, (keys, values) in enumerate(zip(piece.keys, piece.values, strict=True)):
                    cache.update(keys[None], values[None], layer)
            else:
                model.get_decoder()(
                    input_ids=torch.tensor([own], device=device),
                    position_ids=torch.arange(start, end, device=device)[None],
                    past_key_values=cache,
                    use_cache=True,
                )
                self.computed_tokens += end - start
                piece = _Piece(
                    own,
                    [layer.keys[0, :, start:end].clone() for layer in cache.layers],
                    [layer.values[0, :, start:end].clone() for layer in cache.layers],
                )
            if at_message_end:
                kept.append(piece)
            start = end
        self.pieces = kept
        return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]


@dataclass(frozen=True)
class PromptPrefix:
    """The shared prefix's length and each decoder layer's K/V of it ([heads, length, head_dim] each)."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def of(
        cls,
        model: Any,
        ids: torch.Tensor,
        lengths: list[int],
        chain: PrefixChain | None = None,
        boundary_ids: list[int] | tuple[int, ...] = (),
    ) -> PromptPrefix | None:
        """The prefix of these prompts through `model` once (steps 1-2), or None where none is worth it.
        `chain`: the decoder's kept pieces (None: computed alone, nothing kept); `boundary_ids`: the tokens
        that end a message."""
        if not wanted():
            return None
        length = common_length(ids, lengths)
        if not length:
            return None
        start = ids.shape[1] - lengths[0]
        tokens = ids[0, start : start + length].tolist()
        keys, values = (chain if chain is not None else PrefixChain()).compute(
            model, tokens, frozenset(boundary_ids), ids.device
        )
        return cls(length, keys, values)

    def write(self, layers: list[Any], rows: torch.Tensor, starts: list[int]) -> None:
        """Step 3: into each of `rows` of every cache layer ([R, heads, columns, head_dim] `keys`/`values`),
        the prefix's K/V at columns starts[i] .. starts[i] + length - 1."""
        device = rows.device
        columns = torch.tensor(starts, device=device)[:, None] + torch.arange(self.length, device=device)
        where = (rows[:, None], slice(None), columns)  # indexes [k, length, heads, head_dim]
        for layer, keys, values in zip(layers, self.keys, self.values, strict=True):
            layer.keys[where] = keys.transpose(0, 1)
            layer.values[where] = values.transpose(0, 1)
