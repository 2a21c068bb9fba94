"""Fused projections: a layer's q/k/v and gate/up run as one matmul each, their parameters views of one
tensor. The model must give the same results, be loaded and counted as before, and run fewer matmuls
once compiled; anything that is not a plain nn.Linear is left as it is."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config

from mortal.workers.rollout.engines import fused_projections
from mortal.workers.rollout.engines.fused_projections import FusedLinear

SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
)
CONFIGS = {"qwen2 (q/k/v with bias)": Qwen2Config(**SHAPE), "llama (no bias)": LlamaConfig(**SHAPE)}


def _model(config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _pair(config) -> tuple[nn.Module, nn.Module]:
    plain, fused = _model(config), _model(config)
    assert fused_projections.fuse(fused) == 2 * config.num_hidden_layers
    return plain, fused


@torch.no_grad()
def _decode_logits(model: nn.Module, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """A prefill and a few one-token steps through a cache: the calls a decoder makes."""
    cache, out = DynamicCache(), []
    for _ in range(steps + 1):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        out.append(logits)
        ids = logits[:, -1:].argmax(-1)
    return out


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_fused_model_gives_the_plain_models_logits(config) -> None:
    plain, fused = _pair(config)
    ids = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(1))
    for got, expected in zip(_decode_logits(fused, ids), _decode_logits(plain, ids), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_names_shapes_and_counts_are_unchanged(config) -> None:
    plain, fused = _pair(config)
    assert {k: v.shape for k, v in fused.state_dict().items()} == {
        k: v.shape for k, v in plain.state_dict().items()
    }
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    assert [name for name, _ in fused.named_parameters()] == [name for name, _ in plain.named_parameters()]


def test_new_weights_copied_by_name_reach_the_fused_matmul() -> None:
    """A weight load copies each version into the model's tensors by name (weights.load_published);
    the fused matmul must read what was copied."""
    config = CONFIGS["qwen2 (q/k/v with bias)"]
    fused, newer = _model(config), _model(config, seed=7)
    fused_projections.fuse(fused)
    destinations = fused.state_dict()
    for name, tensor in newer.state_dict().items():
        destinations[name].copy_(tensor)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            fused(input_ids=ids).logits, newer(input_ids=ids).logits, atol=1e-5, rtol=1e-5
        )


def test_members_called_in_another_order_or_twice_still_give_their_own_output() -> None:
    fused = _model(CONFIGS["qwen2 (q/k/v with bias)"])
    fused_projections.fuse(fused)
    attention = fused.model.layers[0].self_attn
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        expected = {
            name: nn.functional.linear(x, getattr(attention, name).weight, getattr(attention, name).bias)
            for name in ("q_proj", "k_proj", "v_proj")
        }
        calls = ["v_proj", "k_proj", "k_proj", "q_proj", "v_proj", "q_proj"]
        for name in calls:
            torch.testing.assert_close(getattr(attention, name)(x), expected[name])
        torch.testing.assert_close(
            attention.k_proj(x + 1),
            nn.functional.linear(x + 1, attention.k_proj.weight, attention.k_proj.bias),
        )


def test_nothing_outlives_a_layer_once_every_member_was_served() -> None:
    fused = _model(CONFIGS["llama (no bias)"])
    fused_projections.fuse(fused)
    with torch.no_grad():
        fused(input_ids=torch.tensor([[1, 2, 3]]))
    shared = [m.shared for m in fused.modules() if isinstance(m, FusedLinear)]
    assert shared and all(s.input is None and not s.outputs for s in shared)


def test_compiled_the_layer_runs_one_matmul_per_group() -> None:
    """Dynamo traces the fused model in one graph (fullgraph) with 4 linears a layer instead of 7."""
    config = CONFIGS["qwen2 (q/k/v with bias)"]
    counts = {}

    def count_linears(name):
        def backend(graph_module, example_inputs):
            counts[name] = sum(1 for node in graph_module.graph.nodes if node.target is torch._C._nn.linear)
            return graph_module

        return backend

    ids = torch.tensor([[1, 2, 3]])
    for name, model in zip(("plain", "fused"), _pair(config), strict=True):
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=count_linears(name), fullgraph=True)(input_ids=ids)
    layers = config.num_hidden_layers
    assert counts == {"plain": 7 * layers + 1, "fused": 4 * layers + 1}  # + the LM head


def test_fusing_twice_fuses_nothing_more() -> None:
    fused = _model(CONFIGS["llama (no bias)"])
    assert fused_projections.fuse(fused) == 4
    assert fused_projections.fuse(fused) == 0


def test_a_group_that_is_not_all_plain_linears_is_left_as_it_is() -> None:
    """A LoRA- or quantization-wrapped projection is a subclass or another module: not fused."""

    class Wrapped(nn.Linear):
        pass

    module = nn.Module()
    module.q_proj, module.k_proj, module.v_proj = Wrapped(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)
    module.gate_proj, module.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16)  # bias on one only
    assert fused_projections.fuse(module) == 0
    assert type(module.k_proj) is nn.Linear and type(module.gate_proj) is nn.Linear
