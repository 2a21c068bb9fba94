"""The packed decode attention: for one query token per row, the query heads that share a key/value
head become query positions of that head, so SDPA reads each K and V once instead of transformers
copying them G times (`repeat_kv`). It must give transformers' sdpa results, and leave everything
else (prefills, models that do not run sdpa) to transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import assets_available, make_tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from mortal.workers.engines import decode_attention
from mortal.workers.engines.static_decode import StaticDecoder


def _inputs(batch: int, heads: int, kv_heads: int, q_len: int, length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, 16, generator=generator)
    k, v = (torch.randn(batch, kv_heads, length, 16, generator=generator) for _ in range(2))
    hidden = torch.rand(batch, 1, q_len, length, generator=generator) < 0.3  # each row hides its own columns
    hidden[..., 0] = False  # no row hides everything
    mask = torch.zeros(batch, 1, q_len, length).masked_fill(hidden, torch.finfo(torch.float32).min)
    return q, k, v, mask


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2), (4, 4)])
def test_a_decode_step_gives_transformers_sdpa_result(heads, kv_heads) -> None:
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    q, k, v, mask = _inputs(batch=5, heads=heads, kv_heads=kv_heads, q_len=1, length=23)
    got, _ = decode_attention.packed_decode_attention(module, q, k, v, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == expected.shape == (5, 1, heads, 16)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_more_than_one_query_token_is_transformers_sdpa_unchanged() -> None:
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    q, k, v, mask = _inputs(batch=2, heads=9, kv_heads=3, q_len=7, length=7)
    got, _ = decode_attention.packed_decode_attention(module, q, k, v, mask)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert torch.equal(got, expected)


@pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
def test_an_installed_model_decodes_with_the_logits_of_the_plain_one(tmp_path) -> None:
    """A prefill then single-token steps through a cache: the installed model (its own mask function
    registered) gives the plain sdpa model's logits, and a model on eager attention is left as it is."""
    from transformers import AutoModelForCausalLM, DynamicCache

    folder = make_tiny_model(tmp_path / "model")
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    packed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert decode_attention.install(packed)
    assert packed.config._attn_implementation == decode_attention.NAME
    ids = torch.tensor([[0, 0, 5, 17, 300], [9, 44, 81, 2, 7]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    caches = {name: DynamicCache() for name in ("plain", "packed")}
    with torch.no_grad():
        for _ in range(4):
            logits = {name: model(input_ids=ids, attention_mask=attention, past_key_values=caches[name]).logits
                      for name, model in (("plain", plain), ("packed", packed))}
            torch.testing.assert_close(logits["packed"], logits["plain"], atol=1e-5, rtol=1e-5)
            ids = logits["plain"][:, -1:].argmax(-1)
            attention = torch.cat([attention, torch.ones(2, 1, dtype=torch.long)], 1)
    eager = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    assert not decode_attention.install(eager) and eager.config._attn_implementation == "eager"
    assert StaticDecoder(plain, compile=False).model.config._attn_implementation == decode_attention.NAME


@pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
def test_the_decoders_steps_take_the_packed_path(tmp_path, monkeypatch) -> None:
    """Every decode step's attention runs on the key/value heads (query [rows, kv_heads, G, D]); the
    prefills' run on the query heads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "model"), dtype=torch.float32).eval()
    seen: list[tuple[int, ...]] = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(decode_attention.F, "scaled_dot_product_attention",
                        lambda q, *args, **kwargs: seen.append(tuple(q.shape)) or real_sdpa(q, *args, **kwargs))
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    from mortal.workers.engines.static_decode import Sampling

    ids = torch.tensor([[0, 0, 5, 17], [9, 44, 81, 2]]).repeat_interleave(3, 0)
    decoder.generate(ids, (ids != 0).long(), 5, Sampling(1.0, 0, 1.0), eos_ids=[-1])
    layers, kv_heads, groups = model.config.num_hidden_layers, model.config.num_key_value_heads, 2
    decode_calls = [shape for shape in seen if shape[1:3] == (kv_heads, groups)]
    assert len(decode_calls) == layers * decoder.last_stats.decode_steps > 0
    assert all(shape[1] == model.config.num_attention_heads for shape in seen if shape not in decode_calls)
