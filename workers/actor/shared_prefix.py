"""The loss's forward with the prompt prefix every row shares computed once: its K/V shared by all rows.

Called by mortal.workers.actor.padding_shift.shifted_call, on rows whose padding it has moved to their end.
Why: a tool-calling run's prompts begin with the same system prompt and tool schemas (hundreds of tokens)
and differ only in their last message, so most of each row's forward repeats every other row's. Here the
longest prefix that every row has, token for token, is run once (one row, its K/V cached with autograd), the
cache is expanded (a view) to every row, and the rest of the rows run over it with TRL's fused head; the
gradient through the shared K/V sums every row's, as the rows' own forwards would have.
Positions: each row's tokens are numbered from 0, as generation numbers them; TRL's own masked forward
numbers a left-padded row from its padding, which a rotary model's attention does not see (it reads only the
distance between two positions), so the values equal the masked forward's up to rounding. Models without
rotary position embeddings are left to the plain path, as is anything the split would change: a prefix
shorter than MIN_SHARED_PREFIX, a scored token inside it, gradient checkpointing (which turns the cache off),
extra per-call inputs, or MORTAL_SHARED_PREFIX=0 in the worker's environment.
What it must not do: change what the loss reads (per-token outputs keep their shape; positions inside the
prefix are unscored and read 0, as TRL's are), or copy the prefix per row before the attention needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import DynamicCache

from mortal.workers.prefix import MIN_SHARED_PREFIX, wanted


def usable(model: Any, rows: int, extra: Mapping[str, Any]) -> bool:
    """Whether `model`'s loss forward may take the shared path: a rotary model, not checkpointing its
    activations, over more than one row, with no inputs beyond the ones the split handles (`extra`: the
    call's other arguments; use_cache is TRL's own off switch, which the split keeps)."""
    backbone = model.get_decoder()
    return (
        wanted()
        and rows > 1
        and not set(extra) - {"use_cache"}
        and hasattr(backbone, "rotary_emb")
        and not getattr(model, "is_gradient_checkpointing", False)
    )


def shared_length(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> int:
    """How many leading tokens every row has in common (padding trailing), cut before the first position
    any row scores (labels[:, 1:] != -100 there); 0 when fewer than MIN_SHARED_PREFIX."""
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)
    common = int(same.long().cumprod(dim=0).sum())
    scored = (labels[:, 1:] != -100).any(dim=0)
    if scored.any():
        common = min(common, int(scored.long().argmax()))
    return common if common >= MIN_SHARED_PREFIX else 0


def shared_call(
    forward: Any,
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    prefix: int,
    per_token_outputs: tuple[str, ...],
) -> Any:
    """TRL's fused forward over rows whose first `prefix` tokens are one shared prefix (module docstring);
    the per-token outputs as long as the whole rows' would be."""
    rows, length = input_ids.shape
    device = input_ids.device
    head = model.get_decoder()(
        input_ids=input_ids[:1, :prefix],
        position_ids=torch.arange(prefix, device=device)[None],
        use_cache=True,
    )
    shared = DynamicCache()
    for index, layer in enumerate(head.past_key_values.layers):
        shared.update(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1), index)
    outputs = forward(
        input_ids=input_ids[:, prefix:],
        attention_mask=attention_mask,
        labels=labels[:, prefix:],
        position_ids=torch.arange(prefix, length, device=device)[None].expand(rows, -1),
        past_key_values=shared,
        fused_lm_head=True,
    )
    for name in per_token_outputs:
        value = getattr(outputs, name, None)
        if value is not None:
            setattr(outputs, name, torch.cat([value.new_zeros(rows, prefix), value], dim=1))
    return outputs
