"""Tripwire for mortal.workers.actor.trl_seam: every TRL behaviour mortal relies on, checked on TRL itself.

A failure here after a TRL upgrade means the seam must be revisited before the pin in
pyproject.toml (`trl>=1.16,<1.17`) moves.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from actor_helpers import assert_same_gradients, randomize_lora_b, tensors_sha256
from rollout_helpers import assets_available, make_tiny_model

from mortal.workers.actor import trl_seam
from mortal.workers.actor.training import checkpointing_arg

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")
G, BATCH, LENGTH = 4, 8, 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return make_tiny_model(tmp_path_factory.mktemp("seam") / "model")


class FakeRollouts:
    """A rollout_func whose output depends only on the step: random tokens, their true logprobs
    under the current policy minus `offset` as "sampling" logprobs, fixed rewards."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset
        self.calls: list[list[Any]] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        self.calls.append(list(prompts))
        step = trainer.state.global_step
        gen = torch.Generator().manual_seed(1000 + step)
        prompt = torch.randint(3, 500, (6,), generator=gen).tolist()
        completions = torch.randint(3, 500, (len(prompts), LENGTH), generator=gen)
        with torch.no_grad():
            ids = torch.cat([torch.tensor([prompt] * len(prompts)), completions], dim=1)
            logits = trainer.model(ids).logits[:, len(prompt) - 1 : -1] / trainer.temperature
            true = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        rewards = [{"a": float((i + step) % 2), "b": None if i == 0 else 2.0} for i in range(len(prompts))]
        return trl_seam.rollout_output(
            [prompt] * len(prompts),
            completions.tolist(),
            (true - self.offset).tolist(),
            rewards,
            [step] * len(prompts),
        )


class Logs:
    def __init__(self) -> None:
        from transformers import TrainerCallback

        outer = self
        self.steps: list[dict[str, float]] = []

        class Callback(TrainerCallback):
            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
                if logs and "loss" in logs:
                    outer.steps.append(dict(logs))

        self.callback = Callback()


def _trainer(
    tiny_dir: Path,
    out: Path,
    rollouts: FakeRollouts,
    logs: Logs | None = None,
    max_steps: int = 2,
    **config: Any,
) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        **(
            dict(
                output_dir=str(out),
                per_device_train_batch_size=BATCH,
                num_generations=G,
                steps_per_generation=1,
                max_steps=max_steps,
                learning_rate=1e-2,
                logging_steps=1,
                report_to="none",
                save_strategy="no",
                use_cpu=True,
                bf16=False,
                disable_tqdm=True,
                seed=0,
                **checkpointing_arg(False),
                max_completion_length=LENGTH,
                reward_weights=[1.0, 0.5],
            )
            | config
        )
    )  # config's settings win
    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(max_steps * BATCH // G)]})
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(tiny_dir),
        reward_funcs=[trl_seam.PrecomputedReward("a"), trl_seam.PrecomputedReward("b")],
        args=args,
        train_dataset=dataset,
        rollout_func=rollouts,
        callbacks=[logs.callback] if logs else [],
    )


def test_trl_is_the_tested_version_and_pyproject_pins_that_range() -> None:
    assert trl_seam.trl_version_tested(), f"TRL {trl_seam.trl_version()} is outside {trl_seam.TESTED_TRL}"
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["optional-dependencies"]["train"] if d.startswith("trl")]
    assert pins == [f"trl{trl_seam.TESTED_TRL}"]


def test_rollout_func_gets_each_prompt_repeated_and_its_extra_keys_reach_the_rewards(
    tiny_dir, tmp_path
) -> None:
    rollouts, logs = FakeRollouts(), Logs()
    _trainer(tiny_dir, tmp_path, rollouts, logs).train()
    assert [len(c) for c in rollouts.calls] == [BATCH, BATCH]  # once per step, the whole generation batch
    for prompts in rollouts.calls:
        groups = [prompts[i : i + G] for i in range(0, BATCH, G)]
        assert all(len(set(group)) == 1 for group in groups) and len({g[0] for g in groups}) == BATCH // G
    first = logs.steps[0]
    assert first["rewards/a/mean"] == pytest.approx(0.5)
    assert first["rewards/b/mean"] == pytest.approx(2.0)  # None -> NaN, left out of the mean
    # reward = weighted nansum per completion: a + 0.5 * b, the None row counting b as 0
    expected = [(i % 2) + (0.0 if i == 0 else 1.0) for i in range(BATCH)]
    assert first["reward"] == pytest.approx(sum(expected) / BATCH)
    assert "sampling/importance_sampling_ratio/mean" not in first  # off unless enabled


class MaskedRollouts(FakeRollouts):
    """FakeRollouts whose output carries an env_mask: tokens 1..2 of every odd completion are a tool's."""

    masks = [[1, 0, 0, 1, 1] if i % 2 else [1] * LENGTH for i in range(BATCH)]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        out = super().__call__(prompts, trainer)
        return trl_seam.rollout_output(
            out["prompt_ids"],
            out["completion_ids"],
            out["logprobs"],
            out[trl_seam.REWARDS_KEY],
            out[trl_seam.VERSION_KEY],
            env_masks=self.masks,
        )


def test_env_mask_becomes_trls_tool_mask_and_leaves_the_loss_and_the_lengths(tiny_dir, tmp_path) -> None:
    """Assumption 7: rollout_func's env_mask is TRL's tool_mask (loss mask = completion mask x it)."""
    trainer = _trainer(tiny_dir, tmp_path, MaskedRollouts())
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": "p0"}] * BATCH)
    assert batch["tool_mask"].tolist() == MaskedRollouts.masks
    assert "env_mask" not in batch
    model_tokens = sum(map(sum, MaskedRollouts.masks)) / BATCH
    assert trainer._metrics["train"]["completions/mean_length"][-1] == pytest.approx(model_tokens)
    with pytest.raises(ValueError, match="one mask entry per completion token"):
        trl_seam.rollout_output([[1]], [[5, 6]], [[0.0, 0.0]], [{}], [0], env_masks=[[1]])


def test_precomputed_reward_fails_loudly_without_its_column() -> None:
    with pytest.raises(trl_seam.TrlSeamError):
        trl_seam.PrecomputedReward("a")(completions=["x"], prompts=["p"])
    with pytest.raises(trl_seam.TrlSeamError):
        trl_seam.check_rollout_call(["p"] * 3, BATCH)


def test_the_sampling_correction_weights_the_loss_by_the_rollout_logprobs(tiny_dir, tmp_path) -> None:
    rollouts, logs = FakeRollouts(offset=0.25), Logs()
    trainer = _trainer(tiny_dir, tmp_path, rollouts, logs, max_steps=1)
    trl_seam.enable_sampling_correction(trainer, clip_max=2.0)
    trainer.train()
    ratio = logs.steps[0]["sampling/importance_sampling_ratio/mean"]
    assert ratio == pytest.approx(math.exp(0.25), rel=1e-4)  # exp(current - sampling), per token
    assert logs.steps[0]["sampling/importance_sampling_ratio/max"] <= 2.0


class _Forwards:
    """Counts the model's forward passes (rollout_func's scoring, TRL's preparation, the loss's)."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        model.register_forward_pre_hook(self._seen)

    def _seen(self, *_: Any) -> None:
        self.count += 1


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one-micro-batch", "two-accumulated"])
def test_the_ratio_computed_in_the_loss_trains_as_trls_correction_with_no_forward_of_its_own(
    tiny_dir, tmp_path, micro_batches
) -> None:
    """Assumption 14: correct_in_loss takes the ratio from the loss's own forward; the weights, the loss and
    the ratio's metrics are TRL's, and TRL's preparation runs no forward of its own."""
    config = dict(
        per_device_train_batch_size=BATCH // micro_batches,
        steps_per_generation=micro_batches,
        gradient_accumulation_steps=micro_batches,
    )
    runs = {}
    for name, in_loss in (("trl", False), ("in_loss", True)):
        logs = Logs()
        trainer = _trainer(tiny_dir, tmp_path / name, FakeRollouts(offset=0.25), logs, max_steps=2, **config)
        trl_seam.enable_sampling_correction(trainer, clip_max=2.0)
        if in_loss:
            trl_seam.correct_in_loss(trainer)
        forwards = _Forwards(trainer.model)
        trainer.train()
        runs[name] = (trainer.model.state_dict(), logs.steps, forwards.count)
    (trl_weights, trl_logs, trl_forwards), (weights, steps, count) = runs["trl"], runs["in_loss"]
    # TRL's preparation scores the batch a micro-batch at a time: that many forwards a step fewer
    assert count == trl_forwards - 2 * micro_batches, "TRL's preparation ran no forward"
    assert_same_gradients(weights, trl_weights, tolerance=1e-5)
    for ours, theirs in zip(steps, trl_logs, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
        for metric in ("mean", "min", "max"):
            key = f"sampling/importance_sampling_ratio/{metric}"
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
        assert ours["sampling/sampling_logp_difference/mean"] == pytest.approx(0.25, rel=1e-3)
    assert steps[0]["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(0.25), rel=1e-4)


def test_the_ratio_is_not_moved_into_the_loss_where_the_weights_change_between_its_micro_batches(
    tiny_dir, tmp_path
) -> None:
    trainer = _trainer(tiny_dir, tmp_path, FakeRollouts(), num_iterations=2)
    trl_seam.enable_sampling_correction(trainer, clip_max=2.0)
    with pytest.raises(trl_seam.TrlSeamError, match="num_iterations 2"):
        trl_seam.correct_in_loss(trainer)


def test_the_correction_flag_is_read_only_where_correct_in_loss_expects() -> None:
    """Assumption 14: the flag gates TRL's preparation and the loss, nothing else after __init__; the loss
    computes the policy's log-probabilities once, before it reads the ratio."""
    from trl import GRPOTrainer

    tree = ast.parse(inspect.getsource(GRPOTrainer).lstrip())
    functions = {fn.name: fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)}
    readers = {
        name
        for name, fn in functions.items()
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute)
        and node.attr == "vllm_importance_sampling_correction"
        and isinstance(node.ctx, ast.Load)
    }
    assert readers == {"__init__", "_generate_and_score_completions", "_compute_loss"}
    calls = [
        node
        for node in ast.walk(functions["_compute_loss"])
        if isinstance(node, ast.Attribute) and node.attr == "_get_per_token_logps_and_entropies"
    ]
    assert len(calls) == 1


def test_use_vllm_is_read_only_where_the_seam_expects() -> None:
    """enable_sampling_correction sets `use_vllm` after __init__; it must gate nothing else."""
    from trl import GRPOTrainer

    tree = ast.parse(inspect.getsource(GRPOTrainer).lstrip())
    readers = {
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute) and node.attr == "use_vllm" and isinstance(node.ctx, ast.Load)
    }
    # __init__ (engine set-up, before the seam runs), _generate_single_turn (not used with rollout_func),
    # _tool_call_loop (no tools), _generate (a weight sync: a no-op engine), and the correction itself.
    assert readers == {
        "__init__",
        "_generate_single_turn",
        "_tool_call_loop",
        "_generate",
        "_generate_and_score_completions",
        "_compute_loss",
    }


def test_checkpoint_then_resume_equals_the_uninterrupted_run_bit_for_bit(tiny_dir, tmp_path) -> None:
    straight = _trainer(tiny_dir, tmp_path / "a", FakeRollouts(), max_steps=3)
    straight.train()
    expected = tensors_sha256(straight.model.state_dict())

    first = _trainer(tiny_dir, tmp_path / "b", FakeRollouts(), max_steps=3)
    first.add_callback(_StopAt(1))
    first.train()
    assert first.state.global_step == 1
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    trl_seam.save_checkpoint(first, ckpt)
    assert all((ckpt / name).is_file() for name in trl_seam.checkpoint_files(ckpt))
    assert not (ckpt / "checkpoint-1").exists() and tensors_sha256(first.model.state_dict()) != expected

    resumed = _trainer(tiny_dir, tmp_path / "c", FakeRollouts(), max_steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 3
    assert tensors_sha256(resumed.model.state_dict()) == expected


class _StopAt:
    """A callback that ends training after `step` optimizer steps (like a kill after a checkpoint)."""

    def __new__(cls, step: int) -> Any:
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step >= step:
                    control.should_training_stop = True

        return Stop()


# -- assumption 6: the loss's logprobs and entropies come from TRL's fused LM head, never full logits --
ROWS, SEQ, KEEP = 3, 12, 5  # TRL scores every position off the GPU: 3 x 11 = 33 tokens


def _loss_trainer(tiny_dir: Path, out: Path, tied: bool, lora: bool, temperature: float) -> Any:
    """A GRPOTrainer as the actor builds one (TRL patches the head in __init__), on a tiny model whose
    lm_head is tied to the embeddings or its own (random) matrix, with or without LoRA adapters."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, tie_word_embeddings=tied)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        num_generations=G,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        temperature=temperature,
        max_completion_length=KEEP,
        **checkpointing_arg(False),
    )
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if lora
        else None
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(tiny_dir),
        reward_funcs=[trl_seam.PrecomputedReward("a")],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * BATCH}),
        rollout_func=FakeRollouts(),
        peft_config=peft_config,
    )
    if lora:
        randomize_lora_b(trainer.model)
    return trainer


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 40000, (ROWS, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # a completion that ended early: right padding
    return ids, mask


def _full_logits(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain path: every completion position's logits over the whole vocabulary, then log-softmax."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -KEEP - 1 : -1] / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, ids[:, -KEEP:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _values_and_grads(model: Any, compute: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """logprobs, entropies and every trainable parameter's gradient of a weighted sum of both (random
    cotangents stand for whatever GRPO's loss makes of them), on the unpadded positions."""
    ids, mask = _batch()
    valid = mask[:, -KEEP:].bool()
    gen = torch.Generator().manual_seed(11)
    d_logps, d_entropies = torch.randn(ROWS, KEEP, generator=gen), torch.randn(ROWS, KEEP, generator=gen)
    model.zero_grad(set_to_none=True)
    logps, entropies = compute(ids, mask)
    ((logps * d_logps)[valid].sum() + (entropies * d_entropies)[valid].sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logps.detach() * valid, entropies.detach() * valid, grads


@pytest.mark.parametrize(
    ("tied", "lora", "temperature", "tiles"),
    [
        (True, False, 0.7, None),  # TRL's tiles: one of tokens, vocabulary 32768 + 16384 (not a divisor)
        (True, False, 0.7, (7, 5000)),  # tiles that divide neither 33 tokens nor 49152 columns
        (True, False, 1.0, (11, 16384)),  # tiles that divide both
        (False, False, 0.7, (7, 5000)),
        (True, True, 0.7, (7, 5000)),
        (False, True, 1.3, None),
    ],
)
def test_the_loss_logprobs_entropies_and_gradients_equal_full_logits(
    tiny_dir, tmp_path, monkeypatch, tied, lora, temperature, tiles
) -> None:
    import trl.kernels.chunked_logprob
    import trl.trainer.utils

    if tiles is not None:  # both read at call time; setattr fails if TRL renamed them
        monkeypatch.setattr(trl.kernels.chunked_logprob, "TOKEN_CHUNK_SIZE", tiles[0])
        monkeypatch.setattr(trl.trainer.utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", tiles[1])
    trainer = _loss_trainer(tiny_dir, tmp_path, tied, lora, temperature)
    model = trainer.model
    trl_seam.check_fused_lm_head(trainer)

    def fused(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, KEEP, compute_entropy=True
        )
        return logps, entropies

    logps, entropies, grads = _values_and_grads(model, fused)
    want_logps, want_entropies, want_grads = _values_and_grads(
        model, lambda i, m: _full_logits(model, i, m, temperature)
    )
    torch.testing.assert_close(logps, want_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, want_entropies, rtol=1e-5, atol=1e-5)
    assert not lora or all("lora_" in name for name in grads)
    assert_same_gradients(grads, want_grads)


def _vocab_wide_saved(model: Any, compute: Any) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves for backward that span the vocabulary and are not a
    parameter (or a view of one, as the plain head's weight.t())."""
    vocab = model.config.get_text_config().vocab_size
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if vocab in tensor.shape and tensor.untyped_storage().data_ptr() not in weights:
            found.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute(*_batch())
    return found


@pytest.mark.parametrize(("tied", "lora"), [(True, False), (False, False), (True, True)])
def test_the_loss_saves_nothing_of_vocabulary_width_for_backward(tiny_dir, tmp_path, tied, lora) -> None:
    trainer = _loss_trainer(tiny_dir, tmp_path, tied, lora, 0.7)
    model = trainer.model
    fused = _vocab_wide_saved(
        model,
        lambda i, m: trainer._get_per_token_logps_and_entropies(model, i, m, KEEP, compute_entropy=True),
    )
    assert fused == []
    plain = _vocab_wide_saved(model, lambda i, m: _full_logits(model, i, m, 0.7))
    assert (ROWS, KEEP, model.config.vocab_size) in plain  # the check sees logits where they are saved


# -- assumption 13: on the CPU TRL's head scores every position; the actor's scores the labelled ones only --
@pytest.mark.parametrize("lora", [False, True])
def test_a_model_scoring_labelled_positions_only_scores_the_completions_with_the_same_results(
    tiny_dir, tmp_path, monkeypatch, lora
) -> None:
    import trl.trainer.utils

    trainer = _loss_trainer(tiny_dir, tmp_path, tied=True, lora=lora, temperature=0.7)
    model = trainer.model
    scored: list[int] = []
    kernel = trl.trainer.utils._ChunkedLogProbFunction  # read at call time; setattr fails if TRL renamed it

    def recording(hidden: torch.Tensor, *args: Any) -> Any:
        scored.append(hidden.shape[0])
        return kernel.apply(hidden, *args)

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", SimpleNamespace(apply=recording))

    def fused(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, KEEP, compute_entropy=True
        )
        return logps, entropies

    every_logps, every_entropies, every_grads = _values_and_grads(model, fused)
    base = trl_seam.patched_model(trainer)
    assert trl_seam.score_labelled_positions_only(base)
    assert not trl_seam.score_labelled_positions_only(base)  # once
    trl_seam.check_fused_lm_head(trainer)
    logps, entropies, grads = _values_and_grads(model, fused)
    labelled = int(_batch()[1][:, -KEEP:].sum())
    assert scored == [ROWS * (SEQ - 1), labelled] and labelled < ROWS * KEEP
    assert not trl.trainer.utils._use_triton(torch.device("cpu"))  # TRL's answer outside those calls
    torch.testing.assert_close(logps, every_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, every_entropies, rtol=1e-5, atol=1e-5)
    assert_same_gradients(grads, every_grads)


@pytest.mark.parametrize("lora", [False, True])
def test_the_warm_up_runs_the_fused_head_forward_and_backward_and_leaves_no_trace(
    tiny_dir, tmp_path, lora
) -> None:
    """warm_up_training: gradients reach the weights through TRL's fused head, yet afterwards the weights, the
    gradients (None) and the RNG are as before, and it works where autograd was off (TRL's rollout_func)."""
    trainer = _loss_trainer(tiny_dir, tmp_path, tied=False, lora=lora, temperature=1.0)
    model = trainer.model
    trained = [p for p in model.parameters() if p.requires_grad]
    reached: list[int] = []
    hooks = [p.register_hook(lambda grad, i=i: reached.append(i)) for i, p in enumerate(trained)]
    fused: list[bool] = []
    base = model.get_base_model() if lora else model
    forward = base.forward
    base.forward = lambda *a, **kw: fused.append(kw.get("fused_lm_head", False)) or forward(*a, **kw)
    weights, rng = tensors_sha256(dict(model.state_dict())), torch.get_rng_state()
    with torch.no_grad():
        trl_seam.warm_up_training(trainer)
    for hook in hooks:
        hook.remove()
    assert fused == [True] and sorted(set(reached)) == list(range(len(trained)))
    assert all(p.grad is None for p in trained)
    assert tensors_sha256(dict(model.state_dict())) == weights and torch.equal(torch.get_rng_state(), rng)


def test_check_fused_lm_head_refuses_a_model_whose_forward_is_its_own(tiny_dir, tmp_path) -> None:
    trainer = _loss_trainer(tiny_dir, tmp_path, True, True, 1.0)
    trl_seam.check_fused_lm_head(trainer)
    del trainer.model.get_base_model().forward  # the class's forward again: full logits
    with pytest.raises(trl_seam.TrlSeamError, match="fused LM head"):
        trl_seam.check_fused_lm_head(trainer)


def test_trl_refuses_a_lora_adapter_on_lm_head(tiny_dir, tmp_path) -> None:
    """The fused head reads lm_head.weight, so an adapter there would never train; TRL says so."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        num_generations=G,
        use_cpu=True,
        bf16=False,
        report_to="none",
    )
    with pytest.raises(ValueError, match="lm_head"):
        GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_dir),
            processing_class=AutoTokenizer.from_pretrained(tiny_dir),
            reward_funcs=[trl_seam.PrecomputedReward("a")],
            args=args,
            rollout_func=FakeRollouts(),
            train_dataset=Dataset.from_dict({"prompt": ["p"] * BATCH}),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"),
        )


def test_the_loss_begins_once_per_micro_batch_after_rollout_func_returned(tiny_dir, tmp_path) -> None:
    """Assumption 8: the first compute_loss of a step marks the end of TRL's preparation of the batch."""
    events: list[str] = []

    class Recorded(FakeRollouts):
        def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
            out = super().__call__(prompts, trainer)
            events.append("rollout returned")
            return out

    trainer = _trainer(
        tiny_dir,
        tmp_path,
        Recorded(),
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        per_device_train_batch_size=BATCH // 2,
    )
    trl_seam.time_loss_start(trainer, lambda: events.append("loss"))
    trainer.train()
    assert events == ["rollout returned", "loss", "loss"] * 2


def test_trl_decodes_rollout_funcs_completion_ids_list_itself_so_the_rollouts_texts_can_stand_in(
    tiny_dir, tmp_path
) -> None:
    """Assumption 9: the texts handed for the list rollout_func returned are what the reward functions get
    (texts unlike any decode here, so a second decode would show); the decode is real for every other list."""
    seen: list[list[Any]] = []

    class Seen(trl_seam.PrecomputedReward):
        def __call__(self, completions: list[Any], **kwargs: Any) -> list[float | None]:
            seen.append(list(completions))
            return super().__call__(completions, **kwargs)

    trainer = _trainer(tiny_dir, tmp_path, FakeRollouts(), max_steps=1)
    hand = trl_seam.reuse_rollout_texts(trainer)
    rollout_func = trainer.rollout_func

    def handing(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        output = rollout_func(prompts, trainer)
        hand(output["completion_ids"], [f"text {i}" for i in range(len(output["completion_ids"]))])
        return output

    trainer.rollout_func = handing
    trainer.reward_funcs = [Seen("a"), trl_seam.PrecomputedReward("b")]
    trainer.train()
    assert seen == [[f"text {i}" for i in range(BATCH)]]
    ids = [[5, 6, 7]]
    assert trainer.processing_class.batch_decode(ids, skip_special_tokens=True) == [
        trainer.processing_class.decode([5, 6, 7], skip_special_tokens=True)
    ]


def test_texts_handed_for_a_different_number_of_completions_are_refused(tiny_dir, tmp_path) -> None:
    hand = trl_seam.reuse_rollout_texts(_trainer(tiny_dir, tmp_path, FakeRollouts(), max_steps=1))
    with pytest.raises(ValueError, match="2 texts handed for 3 completions"):
        hand([[1], [2], [3]], ["a", "b"])


class RaggedRollouts(FakeRollouts):
    """Prompts of 2 to 7 tokens and completions of 1 to LENGTH tokens, so TRL must pad both."""

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(2000 + trainer.state.global_step)
        n = len(prompts)
        prompt_ids = [torch.randint(3, 500, (2 + i % 6,), generator=gen).tolist() for i in range(n)]
        completion_ids = [torch.randint(3, 500, (1 + i % LENGTH,), generator=gen).tolist() for i in range(n)]
        logprobs = [[-1.0] * len(c) for c in completion_ids]
        rewards = [{"a": float(i % 2), "b": 1.0} for i in range(n)]
        self.calls.append([prompt_ids, completion_ids])
        return trl_seam.rollout_output(prompt_ids, completion_ids, logprobs, rewards, [0] * n)


def test_the_loss_forward_gets_left_padded_prompts_beside_right_padded_completions(
    tiny_dir, tmp_path
) -> None:
    """Assumption 10: in every row of the loss's attention mask the ones are one unbroken run, with zeros
    before it where the prompt is shorter than the longest and after it where the completion is; the model is
    called with input_ids, attention_mask, labels and fused_lm_head only."""
    rollouts = RaggedRollouts()
    trainer = _trainer(tiny_dir, tmp_path, rollouts, max_steps=1)
    model = trl_seam.patched_model(trainer)
    forward = model.forward
    calls: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        assert not args
        calls.append(kwargs)
        return forward(**kwargs)

    model.forward = recording
    trainer.train()
    assert calls and all(set(c) == {"input_ids", "attention_mask", "labels", "fused_lm_head"} for c in calls)
    mask = calls[0]["attention_mask"]
    expected = [
        [0] * (7 - len(p)) + [1] * (len(p) + len(c)) + [0] * (LENGTH - len(c))
        for p, c in zip(*rollouts.calls[0], strict=True)
    ]
    assert sorted(mask.tolist()) == sorted(expected)  # TRL shuffles the rows


def test_a_compiling_trainer_takes_dynamic_shapes_and_the_scope_from_the_settings(
    tiny_dir, tmp_path, monkeypatch
) -> None:
    """Assumptions 11 and 12: the Trainer's dynamo plugin takes `dynamic` and regional compilation from the
    environment when built; compile_settings sets both for the construction only, and yields to values set."""
    for name in (trl_seam.DYNAMIC_SHAPES_ENV, trl_seam.REGIONAL_ENV):
        monkeypatch.delenv(name, raising=False)

    def plugin(*settings: Any) -> Any:
        with trl_seam.compile_settings(*settings):
            trainer = _trainer(
                tiny_dir, tmp_path, FakeRollouts(), torch_compile=True, torch_compile_backend="aot_eager"
            )
        dynamo = trainer.accelerator.state.dynamo_plugin
        return dynamo.to_kwargs().get("dynamic"), dynamo.use_regional_compilation

    assert plugin(True, "model") == (True, False)
    assert plugin(True, "layer") == (True, True)
    assert (
        trl_seam.DYNAMIC_SHAPES_ENV not in os.environ and trl_seam.REGIONAL_ENV not in os.environ
    )  # put back
    assert plugin(False, "layer") in ((None, False), (False, False))
    monkeypatch.setenv(trl_seam.DYNAMIC_SHAPES_ENV, "0")
    assert plugin(True, "layer") == (False, True)  # a value already set wins
