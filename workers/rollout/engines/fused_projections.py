"""Projections that read the same input, run as one matmul: a layer's q, k and v, its MLP's gate and up.

Who uses it: StaticDecoder (mortal.workers.rollout.engines.static_decode) calls `fuse(model)` on the
rollout's model; the actor trains the model as transformers wrote it.
Why: a decode step's matmuls are too small to be bound by the weights they read, so each costs about a
kernel's fixed time, and fewer kernels make a shorter step (bench/decode_speed.py --profile).
How: a group's weights are copied into one tensor and each projection's parameter becomes a view of its
rows, so whatever reads or writes the parameters by name (state_dict, weight loads, a captured CUDA graph)
sees the fused tensor. The group's first member called computes every member's output; a member called
next with the same input returns its slice, one called with another input computes its own, so results
never depend on the call order; the last member drops what was kept.
What it must not do: change results beyond floating-point summation order, register the fused tensor as
a parameter or buffer, or fuse a projection that is not a plain nn.Linear (LoRA, quantized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Attribute names of the projections that read one input, per kind of module that holds them; every
# transformers decoder of the Llama family (Llama, Qwen2, Qwen3, Mistral, SmolLM2) names them so.
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Shared:
    """One group's matmul over the fused weight, and what its last call produced (input, output)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]) -> None:
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.input: torch.Tensor | None = None
        self.outputs: Sequence[torch.Tensor] = ()
        self.taken = 0

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `member`'s slice of the fused output for `x`, computing it when `x` is new; None when
        this member was already served for this input (a second call: the caller computes its own)."""
        if self.input is not x:
            self.outputs = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
            self.input, self.taken = x, 0
        if self.taken & (1 << member):
            return None
        self.taken |= 1 << member
        out = self.outputs[member]
        if self.taken == (1 << len(self.sizes)) - 1:  # every member served: keep nothing alive
            self.input, self.outputs = None, ()
        return out


class FusedLinear(nn.Linear):
    """An nn.Linear whose weight and bias are views of its group's fused tensors (module docstring)."""

    shared: _Shared
    member: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared.output(self.member, x)
        return F.linear(x, self.weight, self.bias) if out is None else out


def fuse(model: nn.Module) -> int:
    """Fuse every group of GROUPS found in `model`'s modules; returns how many groups were fused.
    Idempotent: a group fused before is a group of FusedLinear, not of plain nn.Linear, and is skipped."""
    fused = 0
    for module in model.modules():
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if _fusable(members):
                _fuse_group(members)
                fused += 1
    return fused


def _fusable(members: list[Any]) -> bool:
    """Plain nn.Linear layers (not a subclass: LoRA's, quantized ones, or ours) over one input, one
    dtype and device, all with a bias or none with one."""
    if not all(type(m) is nn.Linear for m in members):
        return False
    first = members[0].weight
    return (
        len({m.in_features for m in members}) == 1
        and all(m.weight.dtype == first.dtype and m.weight.device == first.device for m in members)
        and len({m.bias is None for m in members}) == 1
    )


@torch.no_grad()
def _fuse_group(members: list[nn.Linear]) -> None:
    sizes = [m.out_features for m in members]
    weight = torch.cat([m.weight for m in members])
    bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
    shared = _Shared(weight, bias, sizes)
    start = 0
    for index, member in enumerate(members):
        rows = slice(start, start + sizes[index])
        member.weight = nn.Parameter(weight[rows], requires_grad=member.weight.requires_grad)
        if bias is not None:
            member.bias = nn.Parameter(bias[rows], requires_grad=member.bias.requires_grad)
        member.__class__ = FusedLinear
        member.shared, member.member = shared, index
        start += sizes[index]
