"""mortal.workers.actor.padding_shift: the loss's forward with each row's padding
trailing, its attention unmasked.

What it promises: the log-probabilities, entropies and gradients TRL reads equal the masked forward's, every
attention call of the loss runs causal without a mask, and every other call is the model's own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import assert_same_gradients, randomize_lora_b
from rollout_helpers import assets_available, make_tiny_model

from mortal.workers.actor import padding_shift, trl_seam

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")
PROMPT, COMPLETION = 7, 6
LEFT_PADDING = [3, 0, 5, 1]  # each row's prompt padding
COMPLETIONS = [6, 2, 6, 1]  # each row's completion tokens, the rest right padding


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return make_tiny_model(tmp_path_factory.mktemp("padding_shift") / "model")


def _trainer(tiny_dir: Path, out: Path, lora: bool, **config: Any) -> Any:
    """A GRPOTrainer as the actor builds one (TRL patches its fused LM head in __init__)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers.actor.training import checkpointing_arg

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        temperature=0.7,
        max_completion_length=COMPLETION,
        **checkpointing_arg(False),
        **config,
    )
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if lora
        else None
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(tiny_dir),
        reward_funcs=[trl_seam.PrecomputedReward("a")],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * 4}),
        rollout_func=lambda *a: {},
        peft_config=peft_config,
    )
    if lora:
        randomize_lora_b(trainer.model)
    return trainer


def _batch(prompt: int = PROMPT, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as TRL builds them (trl_seam assumption 10): prompts padded left, completions padded right;
    each real prompt's first `shared` tokens the same in every row."""
    ids = torch.randint(3, 40000, (4, prompt + COMPLETION), generator=torch.Generator().manual_seed(5))
    mask = torch.zeros_like(ids)
    common = ids[0, :shared].clone()
    for row, (left, kept) in enumerate(zip(LEFT_PADDING, COMPLETIONS, strict=True)):
        mask[row, left : prompt + kept] = 1
        ids[row, left : left + shared] = common
    return ids.masked_fill(mask == 0, 2), mask


def _loss_values(
    trainer: Any, batch: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's logprobs and entropies of the completions, and each trainable weight's
    gradient of a weighted sum."""
    ids, mask = batch or _batch()
    model = trainer.model
    model.zero_grad(set_to_none=True)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model, ids, mask, COMPLETION, compute_entropy=True
    )
    gen = torch.Generator().manual_seed(9)
    kept = mask[:, -COMPLETION:].bool()
    (
        (logps * torch.randn(logps.shape, generator=gen))[kept].sum()
        + (entropies * torch.randn(entropies.shape, generator=gen))[kept].sum()
    ).backward()
    return (
        logps.detach(),
        entropies.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad},
    )


def _attention_masks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, bool]]:
    """Every SDPA call's (attn_mask, is_causal) from now on."""
    calls: list[tuple[Any, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def _plain_and_regionally_compiled(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A plain trainer; one as the actor builds it with actor.compile (scope layer, the shift installed); and
    the copy of its model whose layers accelerate compiled (aot_eager: no code generated, the same graphs)."""
    for name in (trl_seam.DYNAMIC_SHAPES_ENV, trl_seam.REGIONAL_ENV):
        monkeypatch.delenv(name, raising=False)
    plain = _trainer(tiny_dir, tmp_path / "plain", lora=False)
    with trl_seam.compile_settings(True, "layer"):
        trainer = _trainer(
            tiny_dir, tmp_path / "compiled", lora=False, torch_compile=True, torch_compile_backend="aot_eager"
        )
    padding_shift.install(trl_seam.patched_model(trainer))
    return plain, trainer, trainer.accelerator.prepare_model(trainer.model)


@pytest.mark.parametrize("lora", [False, True])
def test_the_loss_values_and_gradients_equal_the_masked_forwards(tiny_dir, tmp_path, lora) -> None:
    plain, shifted = (
        _trainer(tiny_dir, tmp_path / "plain", lora),
        _trainer(tiny_dir, tmp_path / "shifted", lora),
    )
    assert padding_shift.install(trl_seam.patched_model(shifted))
    trl_seam.check_fused_lm_head(shifted)  # the loss still goes through TRL's fused head
    want_logps, want_entropies, want_grads = _loss_values(plain)
    logps, entropies, grads = _loss_values(shifted)
    torch.testing.assert_close(logps, want_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, want_entropies, rtol=1e-5, atol=1e-5)
    assert (logps[~_batch()[1][:, -COMPLETION:].bool()] == 0).all()  # padding scores 0, as TRL's own
    assert_same_gradients(grads, want_grads)


@pytest.mark.parametrize(("lora", "checkpointing"), [(False, False), (True, False), (False, True)])
def test_a_prompt_prefix_every_row_shares_is_computed_once_with_the_masked_forwards_values(
    tiny_dir, tmp_path, monkeypatch, lora, checkpointing
) -> None:
    """Prompts of 48 tokens whose first 40 are the same in every row (a system prompt and tool schemas),
    each padded differently: the prefix runs once, in one row with every row's other 14 tokens after it,
    and the logprobs, entropies and gradients are the masked forward's (rotary positions: each row
    numbered from 0 instead of from its padding); with activation checkpointing too, whose layers run
    again in backward."""
    batch = _batch(prompt=48, shared=40)
    plain, shifted = (
        _trainer(tiny_dir, tmp_path / "plain", lora),
        _trainer(tiny_dir, tmp_path / "shifted", lora),
    )
    if checkpointing:  # as the Trainer turns it on when training begins
        for trainer in (plain, shifted):
            trl_seam.patched_model(trainer).gradient_checkpointing_enable({"use_reentrant": False})
            trainer.model.train()
    assert padding_shift.install(trl_seam.patched_model(shifted))
    backbone_rows: list[int] = []
    backbone = trl_seam.patched_model(shifted).get_decoder()
    monkeypatch.setattr(
        backbone,
        "forward",
        _recording(backbone.forward, lambda kw: backbone_rows.append(kw["input_ids"].shape)),
    )
    want_logps, want_entropies, want_grads = _loss_values(plain, batch)
    logps, entropies, grads = _loss_values(shifted, batch)
    assert backbone_rows == [torch.Size([1, 40 + 4 * (48 + COMPLETION - 40)])]
    torch.testing.assert_close(logps, want_logps, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropies, want_entropies, rtol=1e-4, atol=1e-4)
    assert_same_gradients(grads, want_grads, tolerance=1e-3)


def test_the_shared_prefix_is_cut_before_a_scored_token_and_left_out_when_short() -> None:
    from mortal.workers.actor import shared_prefix

    ids = torch.arange(50).repeat(3, 1)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :41] = -100  # position 40 is the first scored one (its label is token 41)
    assert shared_prefix.shared_length(ids, mask, labels) == 40
    ids[1, 35] = 0
    assert shared_prefix.shared_length(ids, mask, labels) == 35
    ids[2, 10] = 0
    assert shared_prefix.shared_length(ids, mask, labels) == 0, "fewer than MIN_SHARED_PREFIX tokens"


def _recording(forward: Any, record: Any) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        record(kwargs)
        return forward(*args, **kwargs)

    return recorded


@pytest.mark.parametrize("lora", [False, True])
def test_every_attention_call_of_the_loss_is_causal_without_a_mask(
    tiny_dir, tmp_path, monkeypatch, lora
) -> None:
    trainer = _trainer(tiny_dir, tmp_path, lora)
    padding_shift.install(trl_seam.patched_model(trainer))
    calls = _attention_masks(monkeypatch)
    _loss_values(trainer)
    assert len(calls) == trainer.model.config.num_hidden_layers
    assert all(mask is None and causal for mask, causal in calls)


def test_a_forward_outside_the_loss_is_the_models_own(tiny_dir, tmp_path, monkeypatch) -> None:
    plain, shifted = (
        _trainer(tiny_dir, tmp_path / "plain", False),
        _trainer(tiny_dir, tmp_path / "shifted", False),
    )
    padding_shift.install(trl_seam.patched_model(shifted))
    ids, mask = _batch()
    calls = _attention_masks(monkeypatch)
    with torch.no_grad():
        logits = shifted.model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, plain.model(input_ids=ids, attention_mask=mask).logits)
    assert calls and all(mask is not None for mask, _ in calls)  # padding is masked as before


def test_a_loss_call_with_inputs_it_does_not_roll_is_the_models_own(tiny_dir, tmp_path, monkeypatch) -> None:
    """Pre-shifted labels (TRL's context parallelism) or embeddings instead of ids: TRL's forward, masked."""
    trainer = _trainer(tiny_dir, tmp_path, lora=False)
    model = trl_seam.patched_model(trainer)
    padding_shift.install(model)
    ids, mask = _batch()
    labels = ids.masked_fill(mask == 0, -100)
    calls = _attention_masks(monkeypatch)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, shift_labels=labels, fused_lm_head=True)
        model(
            inputs_embeds=model.get_input_embeddings()(ids),
            attention_mask=mask,
            labels=labels,
            fused_lm_head=True,
        )
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert all(mask is not None for mask, _ in calls)


def test_under_regional_compilation_the_shifted_loss_runs_the_compiled_layers(
    tiny_dir, tmp_path, monkeypatch
) -> None:
    """accelerate's regional compilation (actor.compileScope layer) compiles the layers on a copy of the model
    and binds its methods to the copy: the shifted forward must reach the copy's compiled layers, and give
    the uncompiled model's values."""
    from torch._dynamo.utils import counters

    plain, trainer, compiled = _plain_and_regionally_compiled(tiny_dir, tmp_path, monkeypatch)
    assert compiled is not trainer.model  # the copy whose layers are compiled
    torch._dynamo.reset()
    counters.clear()
    ids, mask = _batch()
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(compiled, ids, mask, COMPLETION)
        want, _, _ = plain._get_per_token_logps_and_entropies(plain.model, ids, mask, COMPLETION)
    assert counters["frames"]["ok"] > 0, dict(counters["frames"])
    torch.testing.assert_close(logps, want, rtol=1e-5, atol=1e-5)


def test_under_regional_compilation_a_shared_prefix_compiles_each_layer_once(
    tiny_dir, tmp_path, monkeypatch
) -> None:
    """The shared-prefix path under accelerate's regional compilation: every layer runs the one compiled
    code with its values (a path whose inputs differ per layer would recompile per layer until torch's
    limit and run the rest eager), and the loss's values and gradients are the plain model's."""
    plain, trainer, compiled = _plain_and_regionally_compiled(tiny_dir, tmp_path, monkeypatch)
    torch._dynamo.reset()
    batch = _batch(prompt=48, shared=40)
    want_logps, _, want_grads = _loss_values(plain, batch)
    trainer.model = compiled
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        logps, _, grads = _loss_values(trainer, batch)
    torch.testing.assert_close(logps, want_logps, rtol=1e-4, atol=1e-4)
    # a compiled layer's weights are named under its wrapper's _orig_mod
    assert_same_gradients(
        {n.replace("._orig_mod", ""): g for n, g in grads.items()}, want_grads, tolerance=1e-3
    )


def test_a_sliding_window_layer_keeps_its_mask() -> None:
    class Layer(torch.nn.Module):
        is_causal, sliding_window, num_key_value_groups, training = True, 3, 1, False

    query = key = value = torch.randn(1, 2, 5, 4)
    mask = torch.ones(5, 5, dtype=torch.bool).tril().triu(-2).view(1, 1, 5, 5)  # causal, three columns wide
    windowed, _ = padding_shift.trailing_padding_attention(
        Layer(), query, key, value, mask, **{padding_shift.FLAG: True}
    )
    unmasked, _ = padding_shift.trailing_padding_attention(Layer(), query, key, value, None)
    assert not torch.allclose(windowed, unmasked)  # the window still cuts what a row sees
    Layer.sliding_window = 8  # a window longer than the rows cuts nothing: the mask goes
    dropped, _ = padding_shift.trailing_padding_attention(
        Layer(), query, key, value, mask, **{padding_shift.FLAG: True}
    )
    torch.testing.assert_close(dropped, unmasked)


def test_a_model_that_does_not_run_sdpa_is_left_as_it_is(tiny_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager")
    forward = model.forward
    assert not padding_shift.install(model)
    assert model.forward == forward and model.config._attn_implementation == "eager"


@pytest.mark.parametrize(("value", "wanted"), [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_the_shift_is_wanted_unless_its_environment_variable_is_zero(value, wanted) -> None:
    environ = {} if value is None else {padding_shift.ENV: value}
    assert padding_shift.wanted(environ) is wanted


def test_installing_twice_wraps_once_and_nothing_of_it_is_saved(tiny_dir, tmp_path) -> None:
    trainer = _trainer(tiny_dir, tmp_path, lora=False)
    model = trl_seam.patched_model(trainer)
    assert padding_shift.install(model) and padding_shift.installed(model)
    assert not padding_shift.install(model)
    model.save_pretrained(tmp_path / "saved")
    assert padding_shift.NAME not in (tmp_path / "saved" / "config.json").read_text()


@pytest.mark.parametrize(
    ("mask", "shifts"),
    [
        ([[1, 1, 1]], [0]),
        ([[0, 0, 1, 1, 0]], [2]),
        ([[0, 1, 0], [1, 0, 0], [0, 0, 0]], [1, 0, 3]),
    ],
)
def test_leading_padding_counts_the_zeros_before_the_first_one(mask, shifts) -> None:
    assert padding_shift.leading_padding(torch.tensor(mask)).tolist() == shifts


def test_rows_rolled_left_and_back_are_where_they_were_with_the_dropped_positions_zero() -> None:
    values = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 0]])
    shifts = torch.tensor([2, 0])
    rolled = padding_shift.roll_rows(values, shifts)
    assert rolled.tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 0]]
    keep = values != 0
    assert padding_shift.unroll_rows(rolled, shifts, keep).tolist() == values.tolist()


def _attention_kernel(kernel: str) -> bool:
    """Any attention kernel of a profile, by name (so a failure lists those and not every kernel)."""
    return any(word in kernel.lower() for word in ("attention", "fmha", "flash", "sdpa"))


def _memory_efficient(kernel: str) -> bool:
    """SDPA's memory-efficient attention kernels (xformers' CUTLASS ones), by their names in a profile."""
    return "fmha_cutlass" in kernel or "efficient_attention" in kernel


def _cuda_loss(
    model: Any, prompt: int = PROMPT, shared: int = 0
) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """The fused head's logprobs of the batch on CUDA, the kernels its forward and backward ran, and one
    weight's gradient."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = (t.cuda() for t in _batch(prompt, shared))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.loss.backward()
        torch.cuda.synchronize()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.float()
    return out.log_probs.detach().float(), [event.key for event in prof.key_averages()], grad


def _cuda_model(tiny_dir: Path, shift: bool) -> Any:
    """The tiny model in bf16 on CUDA with TRL's fused head, the padding shift installed when `shift`."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    add_fused_lm_head(model)
    assert not shift or padding_shift.install(model)
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_shifted_loss_runs_a_flash_kernel_and_equals_the_masked_forward_in_bf16(tiny_dir) -> None:
    """The reason for the module: without a mask SDPA is free to take a flash kernel (its own or cuDNN's) and
    never the memory-efficient one; the values agree with the masked forward's to bf16's rounding. Which
    kernel the masked forward takes is PyTorch's choice: in eager mode on an H200 cuDNN's, under torch.compile
    (the profiled bench step, docs/benchmarks.md) the memory-efficient one, so the test does not assert it."""
    results = [_cuda_loss(_cuda_model(tiny_dir, shift)) for shift in (False, True)]
    (plain_logps, _, plain_grad), (logps, kernels, grad) = results
    attention = [k for k in kernels if _attention_kernel(k)]
    assert not any(_memory_efficient(k) for k in attention), attention
    assert any("flash" in k or ("cudnn" in k and "sdpa" in k) for k in attention), attention
    torch.testing.assert_close(logps, plain_logps, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, plain_grad, rtol=5e-2, atol=5e-2 * plain_grad.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_shared_prompt_prefix_equals_the_masked_forward_in_bf16(tiny_dir) -> None:
    """The shared-prefix path (shared_prefix.py) on CUDA in bf16: the same logprobs and gradient as the masked
    forward, to bf16's rounding."""
    results = [_cuda_loss(_cuda_model(tiny_dir, shift), prompt=48, shared=40) for shift in (False, True)]
    (plain_logps, _, plain_grad), (logps, _, grad) = results
    torch.testing.assert_close(logps, plain_logps, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, plain_grad, rtol=5e-2, atol=5e-2 * plain_grad.abs().max().item())
