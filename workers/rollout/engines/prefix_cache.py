"""The prompt prefix every conversation of a call shares, prefilled once and copied into each row it fills.

Who calls it: mortal.workers.rollout.engines.static_decode (StaticDecoder.prompts builds it with the call's
Prompts; StaticDecoder.prefill writes it into the rows it fills), for single-turn generation and for the turn
decoder's conversations alike.
Why: a tool-calling run's prompts begin with the same system prompt and tool schemas (hundreds of tokens) and
differ only in their last message; prefilling every row's whole prompt repeats that work once per row. Here:
  1. The longest run of real tokens every prompt begins with (less its last token, so each row still has one
     to compute) is found once per call; shorter than MIN_SHARED_PREFIX, or with one prompt, nothing is kept.
  2. That prefix goes through the model once (one row, its own cache), each layer's K/V kept.
  3. Filling rows, the K/V is copied into each row's cache at the columns its prompt's first real tokens
     take (left padding moves them), and only the columns after the prefix are prefilled; they attend to the
     copy as they would have to their own.
Each row's positions count from its first real token, so the prefix's K/V (rotary or not) is the same in
every row; the values equal a whole prefill's up to floating-point summation order (the prefix runs as one
row instead of many). MORTAL_SHARED_PREFIX=0 (mortal.workers.prefix) turns it off.
What it must not do: write outside the filled rows' prompt columns, or be reused for other prompts or weights
(it lives as long as one call's Prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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


@dataclass(frozen=True)
class PromptPrefix:
    """The shared prefix's length and each decoder layer's K/V of it ([heads, length, head_dim] each)."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def of(cls, model: Any, ids: torch.Tensor, lengths: list[int]) -> PromptPrefix | None:
        """The prefix of these prompts through `model` once (steps 1-2), or None where none is worth it."""
        if not wanted():
            return None
        length = common_length(ids, lengths)
        if not length:
            return None
        start = ids.shape[1] - lengths[0]
        out = model.get_decoder()(
            input_ids=ids[:1, start : start + length],
            position_ids=torch.arange(length, device=ids.device)[None],
            use_cache=True,
        )
        layers = out.past_key_values.layers
        return cls(length, [layer.keys[0] for layer in layers], [layer.values[0] for layer in layers])

    def write(self, layers: list[Any], rows: torch.Tensor, starts: list[int]) -> None:
        """Step 3: into each of `rows` of every cache layer ([R, heads, columns, head_dim] `keys`/`values`),
        the prefix's K/V at columns starts[i] .. starts[i] + length - 1."""
        device = rows.device
        columns = torch.tensor(starts, device=device)[:, None] + torch.arange(self.length, device=device)
        where = (rows[:, None], slice(None), columns)  # indexes [k, length, heads, head_dim]
        for layer, keys, values in zip(layers, self.keys, self.values, strict=True):
            layer.keys[where] = keys.transpose(0, 1)
            layer.values[where] = values.transpose(0, 1)
