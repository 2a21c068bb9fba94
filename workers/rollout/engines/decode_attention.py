"""Attention for one query token per row that reads each key/value head once, for grouped-query models.

Who uses it: StaticDecoder (mortal.workers.rollout.engines.static_decode) calls `install(model)` on the
rollout's model. Every forward with more than one query token (the decoder's prefills, a per-prompt
`generate`) goes to transformers' own "sdpa" function unchanged; only decode steps take the packed
path below.

Why: in a grouped-query model G query heads share each key/value head. Given a mask, transformers'
sdpa attention expands every key/value head to its G query heads (`repeat_kv`) before calling SDPA
(transformers 5.17 always; later ones pack the query instead, but only when not compiling, and the
decode step is compiled). The decoder's static cache holds P + T columns for every row, so that
expansion writes and reads the layer's whole K and V cache G times over at every step: at 256 rows
the copy, not the weights, set the step's time (SmolLM2-135M, G = 3, and Qwen2.5-0.5B's shape,
G = 7, both took about 10 ms per decode step on an H100, bench/decode_lengths.py). With a single
query token, the G query heads of one key/value head can instead be laid out as G query positions of
that head: SDPA then reads each head's K and V once and computes the same scores. The mask a decode
step passes ([rows, 1, 1, P + T], one row of columns shared by every head) broadcasts over them
unchanged, so nothing else in the decoder changes. On a CUDA GPU with Triton the packed call goes to
decode_attention_kernel's split-column kernel instead of SDPA (it skips the columns a row cannot see).

What it must not do: change the model's weights, its results beyond floating-point summation order
(tests/workers/rollout/engines/test_decode_attention.py compares it with transformers' sdpa), or the
attention of a model that does not run "sdpa" (install leaves such a model as it is).
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


def packed_decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, H_kv, L, D];
    returns ([B, q, H, D], None) as sdpa_attention_forward does."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_len, dim = query.shape
    if q_len != 1 or groups == 1 or dropout or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # query head h reads key/value head h // G (repeat_kv's order), so [B, H, 1, D] -> [B, H_kv, G, D]
    packed = query.reshape(batch, heads // groups, groups, dim)
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    if decode_attention_kernel.supports(packed, key, value) and mask is not None:
        out = torch.ops.mortal.decode_attention(packed, key, value, additive(mask, query.dtype)[:, 0, 0].expand(batch, -1),
                                                dim ** -0.5 if scaling is None else scaling)
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
