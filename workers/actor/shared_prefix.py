"""The loss's forward with the prompt prefix every row shares computed once, in one packed row.

Called by mortal.workers.actor.padding_shift.shifted_call, on rows whose padding it has moved to their end;
the attention half by padding_shift.trailing_padding_attention, for calls that carry LAYOUT.
Why: a tool-calling run's prompts begin with the same system prompt and tool schemas (hundreds of tokens)
and differ only in their last message, so most of each row's forward repeats every other row's. Here the
longest prefix that every row has, token for token, and every row's remaining tokens are laid end to end in
one row (the prefix once, then each row's rest), which the model runs as any single row; only attention
sees the layout: the prefix's queries attend causally within it, each row's queries attend to the prefix's
keys and causally to their own row's. The gradient through the prefix's K/V sums every row's, as the rows'
own forwards would have. One row, no cache: every layer runs the same code on the same kinds of input, so a
regionally compiled layer compiles once (a K/V cache indexed by each layer's number did not: it recompiled
per layer until torch.compile's limit and ran the rest eager).
Positions: each row's tokens are numbered from 0, as generation numbers them; TRL's own masked forward
numbers a left-padded row from its padding, which a rotary model's attention does not see (it reads only the
distance between two positions), so the values equal the masked forward's up to rounding. Models without
rotary position embeddings are left to the plain path, as is anything the layout would change: a prefix
shorter than MIN_SHARED_PREFIX, a scored token inside it, a sliding-window layer, extra per-call inputs, or
MORTAL_SHARED_PREFIX=0 in the worker's environment.
What it must not do: change what the loss reads (per-token outputs keep their shape; positions inside the
prefix are unscored and read 0, as TRL's are), or copy the prefix per row before the attention needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mortal.workers.prefix import MIN_SHARED_PREFIX, wanted

# The forward kwarg transformers hands down to every attention call: (prefix tokens, rows) of a packed row
LAYOUT = "mortal_shared_prefix_layout"


def usable(model: Any, rows: int, extra: Mapping[str, Any]) -> bool:
    """Whether `model`'s loss forward may take the shared path: a rotary model without sliding-window
    layers, over more than one row, with no inputs beyond the ones the layout handles (`extra`: the call's
    other arguments; use_cache is TRL's own off switch, which it keeps)."""
    backbone = model.get_decoder()
    return (
        wanted()
        and rows > 1
        and not set(extra) - {"use_cache"}
        and hasattr(backbone, "rotary_emb")
        and not any(getattr(module, "sliding_window", None) for module in backbone.modules())
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
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    prefix: int,
    per_token_outputs: tuple[str, ...],
) -> Any:
    """TRL's fused forward over rows whose first `prefix` tokens are one shared prefix, run as one packed row
    (module docstring); the per-token outputs as the whole rows' would be: rows x (length - 1)."""
    rows, length = input_ids.shape
    rest = length - prefix
    device = input_ids.device
    packed = torch.cat([input_ids[0, :prefix], input_ids[:, prefix:].reshape(-1)])[None]
    positions = torch.cat(
        [torch.arange(prefix, device=device), torch.arange(prefix, length, device=device).repeat(rows)]
    )[None]
    # each position's next-token label, as TRL shifts them within a row; a row's last position has none
    # (a prefix token's is unscored: shared_length cuts the prefix before the first scored one)
    own_next = torch.cat([labels[:, prefix + 1 :], labels.new_full((rows, 1), -100)], dim=1)
    next_labels = torch.cat([labels.new_full((prefix,), -100), own_next.reshape(-1)])[None]
    outputs = forward(
        input_ids=packed,
        position_ids=positions,
        shift_labels=next_labels,
        fused_lm_head=True,
        **{LAYOUT: (prefix, rows)},
    )
    for name in per_token_outputs:
        value = getattr(outputs, name, None)
        if value is not None:
            own = value[0, prefix:].reshape(rows, rest)[:, :-1]
            setattr(outputs, name, torch.cat([own.new_zeros(rows, prefix), own], dim=1))
    return outputs


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: tuple[int, int],
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention over one packed row (shared_call's): the prefix's queries causal within
    it, each row's queries over the prefix's keys and, causally, their own row's. Returns the packed row's
    output, as the attention function of a single row would."""
    prefix, rows = layout
    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    rest = (total - prefix) // rows

    def by_row(states: torch.Tensor) -> torch.Tensor:  # [1, h, rows * rest, d] -> [rows, h, rest, d]
        return states[:, :, prefix:].reshape(states.shape[1], rows, rest, dim).transpose(0, 1)

    def with_prefix(states: torch.Tensor) -> torch.Tensor:
        shared = states[:, :, :prefix].expand(rows, -1, -1, -1)
        return torch.cat([shared, by_row(states)], dim=2)

    kwargs.pop("is_causal", None)
    head, _ = sdpa_attention_forward(
        module, query[:, :, :prefix], key[:, :, :prefix], value[:, :, :prefix], None, is_causal=True, **kwargs
    )
    columns = torch.arange(prefix + rest, device=query.device)
    sees = columns[None, :] <= prefix + torch.arange(rest, device=query.device)[:, None]
    own, _ = sdpa_attention_forward(
        module, by_row(query), with_prefix(key), with_prefix(value), sees[None, None], **kwargs
    )
    return torch.cat([head, own.reshape(1, rows * rest, heads, dim)], dim=1), None
