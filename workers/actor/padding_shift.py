"""The actor's training attention without a padding mask: each row's leading padding moved to its end.

Called once by mortal.workers.actor.training on a CUDA actor, after TRL patched the model's forward with
its fused LM head (trl_seam assumption 6). Why: TRL's batch is prompts padded on the left beside
completions padded on the right (trl_seam assumption 10), so every forward of the loss passes a padding
mask, and given a mask SDPA cannot use its flash kernel under torch.compile; the memory-efficient one it
takes instead is a large share of a compiled step (docs/benchmarks.md has the measurements).
With the left padding rolled to the row's end, all padding trails the real tokens, and under a causal mask
no real token sees it: a shifted call rolls input_ids, labels and the mask, passes each real token its
original position, lets SDPA run causal (the attention function registered here drops the mask; a
sliding-window layer keeps its own), and rolls every per-token output back.
It must not change anything else: other calls and inputs go to TRL's forward and transformers' sdpa
untouched, and the values equal the masked forward's up to the kernel's rounding
(tests/workers/actor/test_padding_shift.py). MORTAL_PADDING_SHIFT=0 in the worker's environment leaves it
out (bench/gpu_step.py --no-padding-shift), the way back should a model or kernel disagree with it.
Rows that share a long prompt prefix (a tool-calling run's system prompt and tool schemas) have it computed
once, laid end to end with every row's remaining tokens in one row (shared_prefix.py), whose attention
the function registered here hands to shared_prefix.packed_attention.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MethodType
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from mortal.workers.actor import shared_prefix

ENV = "MORTAL_PADDING_SHIFT"  # "0": the actor leaves the shift out
NAME = "mortal_trailing_padding_sdpa"
FLAG = "mortal_padding_trails"  # the forward kwarg transformers hands down to every attention call
PER_TOKEN_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_NEEDED = frozenset({"input_ids", "attention_mask", "labels"})  # what a shifted call rolls
_HANDLED = _NEEDED | {"use_cache", "output_router_logits"}  # and what it may pass on unchanged


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the actor installs the shift: unless ENV is "0"."""
    return environ.get(ENV, "1").strip() != "0"


def leading_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's count of zeros before its first 1 (a row of zeros counts all of them)."""
    return (attention_mask.cumsum(dim=1) == 0).sum(dim=1)


def roll_rows(values: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Row i of the 2-D `values` rolled left by shifts[i] (wrapping around)."""
    length = values.size(1)
    index = (torch.arange(length, device=values.device).unsqueeze(0) + shifts.unsqueeze(1)) % length
    return values.gather(1, index)


def unroll_rows(values: torch.Tensor, shifts: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A per-token output of the rolled rows moved back right by shifts[i], positions not in `keep` zero
    (the masked forward's value there)."""
    length = values.size(1)
    index = torch.arange(length, device=values.device).unsqueeze(0) - shifts.unsqueeze(1)
    return values.gather(1, index.clamp(0, length - 1)).masked_fill(~keep, 0)


def trailing_padding_attention(
    module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
) -> Any:
    """transformers' sdpa attention, without the mask in a call whose rows' padding trails (FLAG); a packed
    row of shared_prefix's (its LAYOUT) attends as its layout says."""
    layout = kwargs.pop(shared_prefix.LAYOUT, None)
    if layout is not None:
        return shared_prefix.packed_attention(module, query, key, value, layout, **kwargs)
    trails = kwargs.pop(FLAG, False)
    window = getattr(module, "sliding_window", None)
    if trails and (window is None or key.shape[-2] <= window):
        attention_mask = None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def shifted_call(
    forward: Any, input_ids: Any, attention_mask: Any, labels: Any, kwargs: dict[str, Any]
) -> Any:
    """TRL's fused forward on the rows with their padding trailing, the outputs put back in place."""
    shifts = leading_padding(attention_mask)
    rolled_ids, rolled_mask = roll_rows(input_ids, shifts), roll_rows(attention_mask, shifts)
    rolled_labels = roll_rows(labels, shifts)
    model = getattr(forward, "__self__", None)
    prefix = (
        shared_prefix.shared_length(rolled_ids, rolled_mask, rolled_labels)
        if model is not None and shared_prefix.usable(model, input_ids.size(0), kwargs)
        else 0
    )
    if prefix:  # the rows' common prompt prefix computed once (shared_prefix.py)
        outputs = shared_prefix.shared_call(forward, rolled_ids, rolled_labels, prefix, PER_TOKEN_OUTPUTS)
    else:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)[None] + shifts[:, None]
        outputs = forward(
            input_ids=rolled_ids,
            attention_mask=rolled_mask,
            labels=rolled_labels,
            position_ids=positions,
            fused_lm_head=True,
            **{FLAG: True},
            **kwargs,
        )
    scored = labels[:, 1:] != -100  # what the fused head scores: each position's next-token label
    for name in PER_TOKEN_OUTPUTS:
        value = getattr(outputs, name, None)
        if value is not None:
            setattr(outputs, name, unroll_rows(value, shifts, scored))
    return outputs


def install(model: Any) -> bool:
    """Route the fused-head training calls of `model` (the model TRL's add_fused_lm_head patched; under peft,
    the base model) through shifted_call, when it runs transformers' "sdpa"; returns whether it did. The new
    forward is, as TRL's, a method bound to the model that calls TRL's function on whatever module it is
    bound to: accelerate's regional compilation copies the model and binds its methods to the copy, whose
    layers are the compiled ones. It keeps `fused_lm_head` in its signature (trl_seam.check_fused_lm_head)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or installed(model):
        return False
    if not isinstance(model.forward, MethodType):  # not TRL's patch as 1.16 makes it (assumption 6): leave it
        return False
    AttentionInterface.register(NAME, trailing_padding_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    trl_forward = model.forward.__func__  # TRL's _fused_forward(self, ...)

    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        fused_forward = MethodType(trl_forward, self)
        # peft passes inputs_embeds=None and the like: a None is an argument not given
        given = {k: v for k, v in kwargs.items() if v is not None}
        if not (fused_lm_head and not args and _HANDLED.issuperset(given) and _NEEDED.issubset(given)):
            return fused_forward(*args, fused_lm_head=fused_lm_head, **kwargs)
        rest = {k: v for k, v in given.items() if k not in _NEEDED}
        return shifted_call(fused_forward, given["input_ids"], given["attention_mask"], given["labels"], rest)

    forward.padding_shift = True  # type: ignore[attr-defined]  # what installed() looks for
    model.forward = MethodType(forward, model)
    return True


def installed(model: Any) -> bool:
    return getattr(vars(model).get("forward"), "padding_shift", False)
