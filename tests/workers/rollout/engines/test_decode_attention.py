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

from mortal.workers.rollout.engines import decode_attention, decode_attention_kernel
from mortal.workers.rollout.engines.static_decode import StaticDecoder


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
    plain = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    packed = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    assert decode_attention.install(packed)
    assert packed.config._attn_implementation == decode_attention.NAME
    ids = torch.tensor([[0, 0, 5, 17, 300], [9, 44, 81, 2, 7]])
    attention = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    caches = {name: DynamicCache() for name in ("plain", "packed")}
    with torch.no_grad():
        for _ in range(4):
            logits = {
                name: model(input_ids=ids, attention_mask=attention, past_key_values=caches[name]).logits
                for name, model in (("plain", plain), ("packed", packed))
            }
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

    model = AutoModelForCausalLM.from_pretrained(
        make_tiny_model(tmp_path / "model"), dtype=torch.float32
    ).eval()
    seen: list[tuple[int, ...]] = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        decode_attention.F,
        "scaled_dot_product_attention",
        lambda q, *args, **kwargs: seen.append(tuple(q.shape)) or real_sdpa(q, *args, **kwargs),
    )
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    from mortal.workers.rollout.engines.static_decode import Sampling

    ids = torch.tensor([[0, 0, 5, 17], [9, 44, 81, 2]]).repeat_interleave(3, 0)
    decoder.generate(ids, (ids != 0).long(), 5, Sampling(1.0, 0, 1.0), eos_ids=[-1])
    layers, kv_heads, groups = model.config.num_hidden_layers, model.config.num_key_value_heads, 2
    decode_calls = [shape for shape in seen if shape[1:3] == (kv_heads, groups)]
    assert len(decode_calls) == layers * decoder.last_stats.decode_steps > 0
    assert all(shape[1] == model.config.num_attention_heads for shape in seen if shape not in decode_calls)


@pytest.mark.parametrize(
    "pairs,columns,processors,expected",
    [
        (128, 512, 132, 3),  # 64 rows x 2 heads on an H100: three slices make two programs a processor
        (4, 96, 132, 2),  # few rows: as many slices as blocks of columns, no more
        (512, 512, 132, 1),  # many rows fill the GPU unsplit
        (1, 10, 132, 1),  # a short cache is one block
    ],
)
def test_the_kernel_splits_columns_until_every_processor_has_two_programs(
    pairs, columns, processors, expected
) -> None:
    assert decode_attention_kernel.slices_for(pairs, columns, processors) == expected


def test_the_kernel_is_not_used_off_a_gpu() -> None:
    q, k, v, _ = _inputs(batch=2, heads=6, kv_heads=2, q_len=1, length=8)
    assert not decode_attention_kernel.supports(q.reshape(2, 2, 3, 16), k, v)


needs_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or decode_attention_kernel.triton is None,
    reason="needs a CUDA GPU and Triton",
)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows,heads,kv_heads,length", [(64, 14, 2, 512), (5, 9, 3, 70), (2, 8, 1, 1030)])
def test_the_kernel_gives_sdpas_attention(dtype, tolerance, rows, heads, kv_heads, length) -> None:
    """Against SDPA on the same packed query, with rows whose padding, unreached columns and scattered
    hidden columns are masked, and an idle row that sees nothing (zeros from the kernel: it is junk)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    groups = heads // kv_heads
    q = torch.randn(rows, kv_heads, groups, 64, device="cuda", generator=generator, dtype=dtype)
    k, v = (
        torch.randn(rows, kv_heads, length, 64, device="cuda", generator=generator, dtype=dtype)
        for _ in range(2)
    )
    hidden = torch.rand(rows, length, device="cuda", generator=generator) < 0.2
    hidden[:, length // 2 :] = True  # columns no row has reached
    hidden[0, : length // 3] = True  # a long left padding
    hidden[:, length // 2 - 1] = False
    hidden[-1] = True  # idle
    mask = torch.zeros(rows, length, device="cuda", dtype=dtype).masked_fill(hidden, torch.finfo(dtype).min)
    got = torch.ops.mortal.decode_attention(q, k, v, mask, 0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None], scale=0.125
    )
    torch.testing.assert_close(got[:-1], expected[:-1], atol=tolerance, rtol=tolerance)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


@pytest.mark.gpu
@needs_kernel
def test_the_packed_path_takes_the_kernel_on_a_gpu_compiled_and_graphed() -> None:
    """Inside torch.compile and a CUDA graph, as the decode step runs it: the same output as SDPA's path."""
    module = SimpleNamespace(num_key_value_groups=7, is_causal=True, training=False)
    q, k, v, mask = (
        t.cuda().to(torch.bfloat16) for t in _inputs(batch=8, heads=14, kv_heads=2, q_len=1, length=300)
    )
    q, k, v = (torch.nn.functional.pad(t, (0, 48)) for t in (q, k, v))  # head size 64
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
    compiled = torch.compile(
        lambda *a: decode_attention.packed_decode_attention(module, *a, scaling=0.125)[0]
    )
    compiled(q, k, v, mask)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(q, k, v, mask)
    graph.replay()
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
