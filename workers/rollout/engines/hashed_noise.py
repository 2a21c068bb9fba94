"""Sampling noise that is a pure function of (a conversation's key, its token index, the token id).

Who uses it: turn_decode (its decode step, inside a CUDA graph) and turn_append (the token sampled after
appended tokens). Why not torch's generator: a conversation's tokens must depend on its key, the weights and
its tool results only, never on when its tools answered or which row it ran in, and a generator's stream
is shared by every row of a step. A counter-based hash gives each row its own noise inside one kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mortal.workers.rollout.engines.static_decode import Sampling, compiled_model, processed_logprobs

MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2**32). Why hand-written:
    the step must draw noise per row from (key, position) inside a CUDA graph, which torch's generators
    cannot do per row. A product past 2**63 wraps, and the mask keeps its low 32 bits, which are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_noise(keys: torch.Tensor, t: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """[R, V] exponential noise for the exponential race, a pure function of each row's key, its token index
    t and the token id (vocab_hash: mix32 of the ids). Uniforms u of 24 bits (the float32 mantissa), noise
    -log(1 - u), written as -log1p(-u). Why log1p: a token whose noise is near 0 wins the race whatever its
    probability, as it should at exactly that rate, so the noise must be exact to rounding where it is
    small, and Inductor lowers log1p to libdevice's on CUDA (log to Triton's own). With -log(u) the compiled
    step once drew rollouts that called fewer tools, for a cause not established (docs/benchmarks.md)."""
    step = mix32((keys + t * 0x9E3779B9) & MASK32)
    bits = mix32(step[:, None] ^ vocab_hash[None, :]) >> 8
    uniform = (bits.float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log1p(-uniform)


def hashed_sample(
    logits: torch.Tensor, sampling: Sampling, keys: torch.Tensor, t: torch.Tensor, vocab_hash: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the processed distribution, the race run on row_noise."""
    logprobs = processed_logprobs(logits, sampling)
    tokens = (logprobs.exp() / row_noise(keys, t, vocab_hash)).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def conversation_key(seed: int) -> int:
    """A conversation's 32-bit noise key from its seed (any int)."""
    folded = torch.tensor([(seed & MASK32) ^ ((seed >> 32) & MASK32)], dtype=torch.long)
    return int(mix32(mix32(folded) ^ 0x5BD1E995)[0])


def compiled_sample(
    logits: torch.Tensor, sampling: Sampling, keys: torch.Tensor, t: torch.Tensor, vocab_hash: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """hashed_sample compiled as a decode step's forward is (static_decode.compiled_model: fixed shapes, one
    compilation per rows x vocab and sampling), for a compiled decode step. Why: run as written, the noise
    is a chain of elementwise kernels over [rows, vocab] int64 tensors, each reading and writing the whole
    of one, every decode step; compiled, a few fused kernels read the logits once. The hash is exact either
    way and the noise's log1p exact to rounding; the softmax's exp and log may round differently, so a near
    tie may go to another token."""
    return _compiled_sample()(logits=logits, sampling=sampling, keys=keys, t=t, vocab_hash=vocab_hash)


@functools.cache
def _compiled_sample() -> Any:
    return compiled_model(hashed_sample)
