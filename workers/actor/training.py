"""The GRPOTrainer every rank of the actor builds: TRL's arguments from the spec, the model, mortal's
callbacks.

Who calls it: rank 0's loop (mortal.workers.actor.loop) and ranks 1..N-1 (mortal.workers.actor.follower):
each builds the same trainer on the same model, so their collectives match.
What it must not do: talk to the store (ranks other than 0 have none), or reach into TRL outside
mortal.workers.actor.trl_seam.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from mortal.specs.training import TrainingSpec
from mortal.state import paths
from mortal.workers import models
from mortal.workers.actor import padding_shift, sharded, step_profile, trl_seam
from mortal.workers.messages import reward_names

if TYPE_CHECKING:
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

RolloutFunc = Callable[[list[Any], "GRPOTrainer"], dict[str, Any]]  # TRL's rollout_func(prompts, trainer)
STALENESS_CLIP = 2.0  # truncation of the per-token importance ratio for stale samples (TIS)


def actor_device(spec: TrainingSpec) -> str:
    return models.worker_device(spec.actor.gpu, "spec.actor.gpu")


def training_args(spec: TrainingSpec, output_dir: str, device: str, world: int = 1) -> GRPOConfig:
    """TRL's GRPOConfig for the spec: one generation batch per optimizer step, reporting by mortal;
    over `world` ranks each trains batchSize / world of it (TRL adds the ranks' shares up)."""
    from trl import GRPOConfig

    algo, gen = spec.algorithm, spec.generation
    dtype = models.resolve_dtype(spec.model.dtype, device)
    config = GRPOConfig(
        output_dir=output_dir,
        # One generation batch (batchSize completions) per optimizer step, trained in accumulation_steps
        # passes of microBatchSize: TRL splits the batch it got from rollout_func and adds the gradients up.
        per_device_train_batch_size=algo.batch_size // algo.accumulation_steps // world,
        num_generations=algo.num_generations,
        steps_per_generation=algo.accumulation_steps,
        gradient_accumulation_steps=algo.accumulation_steps,
        num_iterations=1,
        max_steps=algo.max_steps,
        learning_rate=algo.learning_rate,
        loss_type=algo.loss_type,
        beta=algo.beta,
        epsilon=algo.epsilon,
        epsilon_high=algo.epsilon_high,
        scale_rewards=algo.scale_rewards,
        max_grad_norm=algo.max_grad_norm,
        seed=algo.seed,
        reward_weights=[r.weight for r in spec.rewards],
        max_completion_length=gen.max_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k or 0,
        **checkpointing_arg(spec.model.gradient_checkpointing),
        torch_compile=spec.actor.compile,
        use_cpu=device == "cpu",
        # one actor's mixedPrecision: the Trainer autocasts to bfloat16 over float32 weights (a sharded
        # actor's is FSDP2's policy instead, set as the model loads)
        bf16=dtype == torch.bfloat16 or (spec.actor.mixed_precision and world == 1),
        fp16=False,
        logging_steps=1,
        # Off, Trainer's check of each step's loss for nan/inf (a host wait on the GPU) is gone, so the host
        # queues the gradient clip and AdamW while the backward still runs, and the GPU no longer idles there
        # (docs/benchmarks.md). A non-finite loss is then reported as such
        # (mortal.workers.actor.metrics leaves it out) instead of being replaced by the previous steps' mean.
        logging_nan_inf_filter=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    if device != "cpu":
        _ = config.device  # resolves the devices, which counts the GPUs this process sees
        # One GPU per actor (spec.actor.gpu): a process that sees several (tests, a worker run by hand)
        # would have Trainer wrap the model in nn.DataParallel, which GRPOTrainer refuses.
        config._n_gpu = 1
    return config


def checkpointing_arg(enabled: bool) -> dict[str, bool]:
    """Activation checkpointing under the name this transformers knows: `activation_checkpointing` since
    5.2x (`gradient_checkpointing` is its deprecated alias there), only `gradient_checkpointing` before
    (5.17, as CUDA images ship it)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing": enabled
    }


def lora_config(spec: TrainingSpec) -> LoraConfig | None:
    if spec.model.lora is None:
        return None
    from peft import LoraConfig

    lora = spec.model.lora
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def make_trainer(
    spec: TrainingSpec,
    run_dir: Path,
    callback: TrainerCallback,
    rollout_func: RolloutFunc,
    world: int,
    rank: int = 0,
) -> GRPOTrainer:
    """The GRPOTrainer of every rank: over `world` > 1 ranks the model is sharded with FSDP2 at load, or with
    actor.strategy ddp loaded whole on the rank's device, which the Trainer (accelerate) wraps in
    DistributedDataParallel as it does for TRL on several GPUs. Its
    steps are profiled where MORTAL_PROFILE_STEPS asks (mortal.workers.actor.step_profile), into run_dir's
    logs."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    device = actor_device(spec)
    tokenizer = models.load_tokenizer(spec.model)
    # ddp: a whole model a rank, wrapped by the Trainer
    fsdp_size = world if spec.actor.strategy == "fsdp" else 1
    model = models.load_model(
        spec.model,
        device,
        for_training=True,
        fsdp_size=fsdp_size,
        mixed_precision=spec.actor.mixed_precision,
        cpu_offload=spec.actor.cpu_offload,
        reshard_after_forward=spec.actor.reshard_after_forward,
    )
    if spec.actor.liger:
        logging.getLogger("mortal.worker").info(
            "Liger's kernels patched into the %s model (rank %d)", models.use_liger_kernels(model), rank
        )
    # TRL's sampler only decides how many prompts a step has; which prompts is mortal.workers.schedule's.
    placeholders = Dataset.from_dict(
        {"prompt": [""] * (spec.algorithm.max_steps * spec.algorithm.prompts_per_step)}
    )
    args = training_args(spec, str(run_dir / "actor"), device, world)
    sharded.replicate_arguments(args, model.config)  # read by the Trainer only when it wraps the model in DDP
    with trl_seam.compile_settings(spec.actor.compile, spec.actor.compile_scope):  # dynamic shapes, the scope
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[trl_seam.PrecomputedReward(name) for name in reward_names(spec.rewards)],
            args=args,
            train_dataset=placeholders,
            processing_class=tokenizer,
            callbacks=[callback, *step_profile.from_environment(run_dir / paths.LOGS, rank)],
            peft_config=lora_config(spec),
            rollout_func=rollout_func,
        )
    trainer.remove_callback(PrinterCallback)
    if world > 1 and spec.actor.strategy == "ddp":
        sharded.bucket_view_gradients(trainer)
    trl_seam.check_fused_lm_head(trainer)  # the loss never holds [tokens x vocab] logits
    if device == "cpu":  # the loss scores the completions only, as TRL's head does on CUDA
        trl_seam.score_labelled_positions_only(trl_seam.patched_model(trainer))
    if device.startswith("cuda") and padding_shift.wanted():  # the loss's attention without a padding mask
        padding_shift.install(trl_seam.patched_model(trainer))
    if spec.algorithm.max_staleness > 0 or spec.sync.every > 1:  # samples may come from older weights
        trl_seam.enable_sampling_correction(trainer, clip_max=STALENESS_CLIP)
        trl_seam.correct_in_loss(trainer)  # the ratio from the loss's forward, not one more forward
    return trainer


def publishes_at(spec: TrainingSpec, step: int) -> bool:
    """Whether the actor publishes weights after optimizer step `step` (every rank asks: a sharded
    publish is a collective)."""
    return step % spec.sync.every == 0 or step >= spec.algorithm.max_steps
