"""Attention for one query token per row that reads each key/value head once, for grouped-query models.

Who uses it: StaticDecoder (mortal.workers.rollout.engines.static_decode) calls `install(model)` on the
rollout's model; only decode steps take the packed path, every other forward goes to transformers' "sdpa".
Why: given a mask, transformers' sdpa expands each key/value head to its G query heads before SDPA, so a
decode step over a static cache of P + T columns copies the layer's whole K and V cache G times, and that
copy, not the weights, set a step's time (bench/decode_lengths.py). With one query token, the G query heads
of a key/value head can be laid out as G query positions of that head: SDPA reads K and V once and
computes the same scores, and the decode step's mask broadcasts over them unchanged. On a CUDA GPU with
Triton the packed call goes to decode_attention_kernel instead.
What it must not do: change the model's weights, its results beyond floating-point summation order
(tests/workers/rollout/engines/test_decode_attention.py), or a model that does not run "sdpa".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mortal.workers.rollout.engines import decode_attention_kernel

NAME = "mortal_decode_sdpa"


def packed_decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, H_kv, L, D];
    returns ([B, q, H, D], None) as sdpa_attention_forward does."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    if q_len != 1 or groups == 1 or dropout or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # query head h reads key/value head h // G (repeat_kv's order), so [B, H, 1, D] -> [B, H_kv, G, D]
    packed = query.reshape(batch, heads // groups, groups, dim)
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    if decode_attention_kernel.supports(packed, key, value) and mask is not None:
        out = torch.ops.mortal.decode_attention(
            packed,
            key,
            value,
            additive(mask, query.dtype)[:, 0, 0].expand(batch, -1),
            dim**-0.5 if scaling is None else scaling,
        )
        return out.view(batch, 1, heads, dim), None
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: seen) as SDPA's additive one; an additive mask as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def install(model: Any) -> bool:
    """Make `model` (and its submodels) use the packed decode attention when it runs "sdpa"; returns
    whether it did. Registering is idempotent: the name maps to the same function every time."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
