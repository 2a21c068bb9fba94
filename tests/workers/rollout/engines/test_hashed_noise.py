"""hashed_noise: sampling noise that is a pure function of (conversation key, token index, token id).

The hash is checked against the same arithmetic on Python's integers (exact on every device, though
a product of two 32-bit values passes 2**63 for some inputs); the noise is exact to rounding where it is
smallest (those tokens win the race whatever their probability), compiled or not; the race on it draws
tokens with their probabilities at every token index, unlikely tokens almost never. The GPU tests run the
same on CUDA, where the decode step samples, compiled as the decode step compiles it."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from mortal.workers.rollout.engines.hashed_noise import (
    MASK32,
    compiled_sample,
    conversation_key,
    hashed_sample,
    mix32,
    row_noise,
)
from mortal.workers.rollout.engines.static_decode import Sampling

PLAIN = Sampling(temperature=1.0, top_k=0, top_p=1.0)
VOCAB = 2048
LIKELY = [7, 1000, 1500, VOCAB - 1]
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = pytest.param("cuda", marks=ON_CUDA)


def mix32_reference(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def hash_inputs() -> list[int]:
    """Values over [0, 2**32), with the top of the range (where the second product passes 2**63) dense."""
    rng = random.Random(0)
    return [rng.randrange(1 << 32) for _ in range(5000)] + [
        (1 << 32) - 1 - rng.randrange(1 << 27) for _ in range(5000)
    ]


def skewed_logits(rows: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, VOCAB] logits with four likely tokens and the rest of the mass spread thin, and the four's
    probabilities."""
    logits = torch.full((VOCAB,), -30.0)
    likely = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits[LIKELY] = likely.log()
    return logits.to(device).repeat(rows, 1), likely


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_mix32_is_the_32_bit_hash_it_says_on_every_device(device: str) -> None:
    inputs = hash_inputs()
    expected = torch.tensor([mix32_reference(x) for x in inputs])
    got = mix32(torch.tensor(inputs, device=device)).cpu()
    wrong = (got != expected).sum().item()
    assert wrong == 0, f"{wrong} of {len(inputs)} hashes differ from Python's integers"


def test_row_noise_is_a_function_of_key_index_and_token_and_looks_exponential() -> None:
    vocab_hash = mix32(torch.arange(50000))
    keys, t = torch.tensor([1, 2, 1]), torch.tensor([0, 0, 5])
    noise = row_noise(keys, t, vocab_hash)
    assert torch.equal(noise, row_noise(keys, t, vocab_hash))
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert (noise > 0).all()
    assert abs(noise.mean().item() - 1.0) < 0.02 and abs(noise.std().item() - 1.0) < 0.03


def smallest_noises(noise_of: Any, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(noise, its float64 value from the same uniforms) at the 500 smallest of 256 rows x 49,152 tokens
    (uniforms down to a few of the 2**-24 grid): the noises that let a token win the race whatever its
    probability."""
    rows, vocab = 256, 49152
    keys = torch.tensor([conversation_key(i) for i in range(rows)], device=device)
    t = torch.zeros(rows, dtype=torch.long, device=device)
    vocab_hash = mix32(torch.arange(vocab, device=device))
    noise = noise_of(keys, t, vocab_hash)
    smallest, where = noise.flatten().topk(500, largest=False)
    step = mix32((keys + t * 0x9E3779B9) & MASK32)
    bits = (mix32(step[:, None] ^ vocab_hash[None, :]) >> 8).flatten()[where]
    uniform = (bits.double() + 0.5) / (1 << 24)
    return smallest.double(), -torch.log1p(-uniform)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_smallest_noises_are_exact_to_rounding(device: str) -> None:
    noise, exact = smallest_noises(row_noise, device)
    assert (noise > 0).all()
    torch.testing.assert_close(noise, exact, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_on_cuda_the_smallest_noises_are_exact_to_rounding_too() -> None:
    """What the compiled decode step draws, where a log less exact than rounding would hand unlikely
    tokens the race."""
    noise, exact = smallest_noises(torch.compile(row_noise, dynamic=False), "cuda")
    assert (noise > 0).all()
    torch.testing.assert_close(noise, exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("device", "sample"),
    [
        pytest.param("cpu", hashed_sample, id="cpu"),
        pytest.param("cuda", hashed_sample, marks=ON_CUDA, id="cuda"),
        pytest.param("cuda", compiled_sample, marks=ON_CUDA, id="cuda-compiled"),
    ],
)
def test_hashed_sampling_draws_tokens_with_their_probabilities_at_every_index(
    device: str, sample: Any
) -> None:
    """10,000 conversations' draws at token indices 0 to 3: the four likely tokens come with their
    probabilities, the others almost never (their mass is under 1e-9)."""
    rows = 10000
    logits, likely = skewed_logits(rows, device)
    keys = torch.tensor([conversation_key(i) for i in range(rows)], device=device)
    vocab_hash = mix32(torch.arange(VOCAB, device=device))
    for index in range(4):
        t = torch.full((rows,), index, dtype=torch.long, device=device)
        tokens, logprobs = sample(logits, PLAIN, keys, t, vocab_hash)
        counts = torch.bincount(tokens.cpu(), minlength=VOCAB).float() / rows
        assert counts.sum() - counts[LIKELY].sum() < 1e-3, f"unlikely tokens at {index}"
        torch.testing.assert_close(counts[LIKELY], likely, atol=0.02, rtol=0)
        torch.testing.assert_close(logprobs.cpu(), logits[0].log_softmax(-1).cpu()[tokens.cpu()])
