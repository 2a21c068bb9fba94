"""The actor worker: TRL's GRPOTrainer, fed with rollouts that rollout workers generate and score.

Who calls it: mortal.workers.main, as `main(ctx)` in the process a backend launched for the
run's actor slot. One step, in order:
1. TRL asks for a generation batch: `ActorLoop.rollout` enqueues the tasks of steps s..s+k
   (mortal.workers.feed) and waits for step s's scored groups; TRL gets prompt/completion ids,
   sampling logprobs, and each reward's precomputed score through PrecomputedReward functions, so
   TRL's weighting, advantages, loss variants, KL and per-reward logging are TRL's own.
2. TRL computes the loss and takes the optimizer step.
3. `on_step_end`: publish the new weights (mortal.workers.weights), report step and version.
4. `on_log`: record the step's metrics and a sample of its completions with the advantages TRL
   trained on (mortal.workers.samples); every checkpoint.every steps, at the last step and when
   asked to stop, write a complete checkpoint (mortal.workers.checkpoint).
On start it resumes from the newest complete checkpoint (`train(resume_from_checkpoint=...)`
restores weights, optimizer, scheduler, RNG and step), forgets queued tasks from that step on, and
publishes the weights it starts from (a version above every earlier one) before the first rollout.
What it must not do: generate, score, or reach into TRL outside mortal.workers.trl_seam.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
from transformers import TrainerCallback

from mortal.specs.training import TrainingSpec
from mortal.workers import data, models, samples, trl_seam
from mortal.workers.checkpoint import Checkpointer
from mortal.workers.feed import RolloutFeed, StepBatch, StopRequested
from mortal.workers.messages import reward_names
from mortal.workers.metrics import MetricsReporter, open_wandb
from mortal.workers.runtime import EXIT_SUCCEEDED, WorkerContext
from mortal.workers.weights import WeightPublisher

STALENESS_CLIP = 2.0  # truncation of the per-token importance ratio for stale samples (TIS)


def main(ctx: WorkerContext) -> int:
    """Train the run to maxSteps (0), or to a stop request (0, after a checkpoint)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    models.set_threads()
    spec = ctx.run.spec
    checkpointer = Checkpointer(
        ctx.store, ctx.worker, spec.checkpoint.every, spec.checkpoint.keep, spec.algorithm.seed, fence=ctx.check_fence
    )
    resume = checkpointer.resume_point()
    start = resume.step if resume else 0
    ctx.report(step=start)
    if start >= spec.algorithm.max_steps:
        ctx.log.info("checkpoint at step %d already reaches maxSteps: nothing to train", start)
        return EXIT_SUCCEEDED
    rows = data.load_rows(spec.dataset)
    feed = RolloutFeed(
        ctx.store, ctx.worker, rows, spec.algorithm.seed, spec.algorithm.prompts_per_step,
        spec.algorithm.num_generations, spec.algorithm.max_staleness, spec.algorithm.max_steps,
        reward_names(spec.rewards), ctx.stopping,
        prompts_per_task=spec.rollout.task_size(spec.algorithm.prompts_per_step),
        poll_seconds=0.05 if spec.actor.gpu == "none" else 0.02,  # a GPU step is ~1 s: waits there are latency
    )
    feed.forget_from(start)
    publisher = WeightPublisher(ctx.store, ctx.worker, method=spec.sync_method())
    publisher.clear_partial()
    wandb_run = open_wandb(
        spec.logging.wandb, ctx.run.name, ctx.run.metadata.uid, ctx.run_dir, ctx.run.spec_dict()
    )
    loop = ActorLoop(ctx, spec, feed, publisher, checkpointer, MetricsReporter(ctx.store, ctx.worker, wandb_run))
    try:
        trainer = build_trainer(ctx, spec, loop)
        ctx.log.info("training from step %d to %d%s", start, spec.algorithm.max_steps,
                     f" (resuming from {resume.path})" if resume else "")
        trainer.train(resume_from_checkpoint=resume.path if resume else None)
    except StopRequested as exc:
        ctx.log.info("%s", exc)
    finally:
        loop.reporter.close()
        publisher.close()
    return EXIT_SUCCEEDED


def actor_device(spec: TrainingSpec) -> str:
    return models.worker_device(spec.actor.gpu, "spec.actor.gpu")


def training_args(spec: TrainingSpec, output_dir: str, device: str) -> Any:
    """TRL's GRPOConfig for the spec: one generation batch per optimizer step, reporting by mortal."""
    from trl import GRPOConfig

    algo, gen = spec.algorithm, spec.generation
    dtype = models.resolve_dtype(spec.model.dtype, device)
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=algo.batch_size,
        num_generations=algo.num_generations,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
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
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        fp16=False,
        logging_steps=1,
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
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": enabled}


def lora_config(spec: TrainingSpec) -> Any:
    if spec.model.lora is None:
        return None
    from peft import LoraConfig

    lora = spec.model.lora
    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )


def build_trainer(ctx: WorkerContext, spec: TrainingSpec, loop: ActorLoop) -> Any:
    """The GRPOTrainer, wired to the loop: rollouts in through rollout_func, results out by callback."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    device = actor_device(spec)
    tokenizer = models.load_tokenizer(spec.model)
    model = models.load_model(spec.model, device, for_training=True)
    # TRL's sampler only decides how many prompts a step has; which prompts is mortal.workers.schedule's.
    placeholders = Dataset.from_dict({"prompt": [""] * (spec.algorithm.max_steps * spec.algorithm.prompts_per_step)})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_seam.PrecomputedReward(name) for name in reward_names(spec.rewards)],
        args=training_args(spec, str(ctx.run_dir / "actor"), device),
        train_dataset=placeholders,
        processing_class=tokenizer,
        callbacks=[loop],
        peft_config=lora_config(spec),
        rollout_func=loop.rollout,
    )
    trainer.remove_callback(PrinterCallback)
    trl_seam.check_fused_lm_head(trainer)  # the loss never holds [tokens x vocab] logits
    if spec.algorithm.max_staleness > 0 or spec.sync.every > 1:  # samples may come from older weights
        trl_seam.enable_sampling_correction(trainer, clip_max=STALENESS_CLIP)
    loop.trainer = trainer
    return trainer


class ActorLoop(TrainerCallback):
    """What mortal does around each TRL step: feed rollouts in, publish, report, checkpoint."""

    def __init__(self, ctx: WorkerContext, spec: TrainingSpec, feed: RolloutFeed, publisher: WeightPublisher,
                 checkpointer: Checkpointer, reporter: MetricsReporter) -> None:
        self.ctx, self.spec, self.feed = ctx, spec, feed
        self.publisher, self.checkpointer, self.reporter = publisher, checkpointer, reporter
        self.trainer: Any = None
        self.version = -1
        self._step_started = time.perf_counter()
        self._rollout_metrics: dict[str, float] = {}
        self._batch: StepBatch | None = None  # the step's rollouts, until its completions are recorded
        self._reward_weights = dict(zip(reward_names(spec.rewards), (r.weight for r in spec.rewards), strict=True))

    # -- TRL's rollout_func --------------------------------------------------------------------
    def rollout(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        trl_seam.check_rollout_call(prompts, self.spec.algorithm.batch_size)
        step = trainer.state.global_step
        self.feed.enqueue(step, self.version)
        self.publisher.prune()  # old versions go while the rollouts load the new one and generate
        started = time.perf_counter()
        batch = self.feed.collect(step, self.version, on_stop=lambda: self._checkpoint_once(step))
        self._rollout_metrics = batch.metrics(step, self.publisher.step_of)
        self._rollout_metrics["actor/wait_seconds"] = time.perf_counter() - started
        self._batch = batch
        return trl_seam.rollout_output(
            batch.prompt_ids, batch.completion_ids, batch.logprobs, batch.rewards, batch.weight_versions,
            env_masks=batch.env_masks(),
        )

    # -- Trainer callbacks -----------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Weights, optimizer and scheduler are loaded (fresh or from the checkpoint): the spec's learning
        rate replaces a resumed checkpoint's (a fork or an apply may have changed it), then the weights
        are published before the first rollout."""
        if trl_seam.set_learning_rate(self.trainer, self.spec.algorithm.learning_rate):
            self.ctx.log.info("learning rate set to the spec's %g (the checkpoint's differed)",
                              self.spec.algorithm.learning_rate)
        self._publish(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.publisher.prune()  # the last version's publish left one more than `keep`

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if torch.cuda.is_available():  # queued GPU work of the step is training time
            torch.cuda.synchronize()
        trained = time.perf_counter() - self._step_started - self._rollout_metrics.get("actor/wait_seconds", 0.0)
        self._rollout_metrics["actor/train_seconds"] = trained  # TRL's loss, backward and optimizer step
        self._rollout_metrics["weights/publish_seconds"] = 0.0
        if step % self.spec.sync.every == 0 or step >= self.spec.algorithm.max_steps:
            self._publish(step)
        else:
            self.ctx.report(step=step)
        self._rollout_metrics["step_seconds"] = time.perf_counter() - self._step_started

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or "loss" not in logs:  # the end-of-training summary, not a step
            return
        step = state.global_step
        extra = dict(self._rollout_metrics)
        seconds = extra.get("step_seconds", 0.0)
        if seconds > 0:
            extra["tokens_per_second"] = extra.get("completion_tokens", 0.0) / seconds
        self.reporter.report(step, {**logs, **extra, "weight_version": self.version})
        self._record_completions(step)
        stopping = self.ctx.stopping.is_set()
        if self.checkpointer.due(step, self.spec.algorithm.max_steps) or stopping:
            self._checkpoint_once(step)
        if stopping:
            control.should_training_stop = True

    # -- helpers ---------------------------------------------------------------------------------
    def _publish(self, step: int) -> None:
        if torch.cuda.is_available():  # the step's queued GPU work counts as training, not as publishing
            torch.cuda.synchronize()
        started = time.perf_counter()  # no fence check first: version directories are per incarnation
        self.version = self.publisher.publish(self.trainer.model, step, prune=False)
        self._rollout_metrics["weights/publish_seconds"] = time.perf_counter() - started
        self.ctx.report(step=step, weight_version=self.version)

    def _record_completions(self, step: int) -> None:
        """The first logging.completionsPerStep completions of the step just trained, with its advantages."""
        batch, self._batch = self._batch, None
        limit = self.spec.logging.completions_per_step
        if batch is None or limit == 0:
            return
        advantages = trl_seam.step_advantages(self.trainer, len(batch.completion_ids))
        self.reporter.report_completions(step, samples.step_completions(batch, advantages, self._reward_weights, limit))

    def _checkpoint_once(self, step: int) -> None:
        """Checkpoint at a step boundary unless this step has one (e.g. the one just resumed from);
        step 0 needs none (a restart from nothing is the same run)."""
        if step > 0 and not self.checkpointer.has(step):
            self.checkpointer.write(self.trainer, step, self.version)
