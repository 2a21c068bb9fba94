"""The actor worker (rank 0): TRL's GRPOTrainer, fed with rollouts that rollout workers generate and score.

Who calls it: mortal.workers.main, as `main(ctx)` in the process a backend launched for the actor slot.
Each step: TRL's rollout_func (`ActorLoop.rollout`) enqueues the tasks of steps s..s+maxStaleness
(actor.feed) and waits for step s's scored groups; TRL trains on them with each reward's precomputed
score, so weighting, advantages, loss variants and logging stay TRL's own; `on_step_end` publishes the
weights (sync.publisher) and queues the next step's tasks at once, so rollouts generate while the step is
logged; `on_log` records metrics and sample completions and checkpoints when due (actor.checkpoint).
At start it resumes from the newest complete checkpoint once actor.resume_check found that this redoes
and skips nothing. With actor.count N > 1 this process is rank 0 of N (actor.sharded, actor.follower).
What it must not do: generate, score, or reach into TRL outside mortal.workers.actor.trl_seam.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from mortal.specs.training import TrainingSpec
from mortal.workers import data, models
from mortal.workers.actor import (
    follower,
    provenance,
    resume_check,
    samples,
    sharded,
    training,
    trl_seam,
)
from mortal.workers.actor.checkpoint import Checkpointer, is_sharded
from mortal.workers.actor.feed import RolloutFeed, StepBatch, StopRequested
from mortal.workers.actor.metrics import MetricsReporter, open_wandb
from mortal.workers.actor.storage import CheckpointStorage, StorageError
from mortal.workers.doorbell import RESULTS, TASKS, Doorbell
from mortal.workers.errors import FatalWorkerError
from mortal.workers.messages import reward_names
from mortal.workers.runtime import (
    EXIT_SUCCEEDED,
    CollectionClock,
    WorkerContext,
    startup_objects_frozen,
)
from mortal.workers.sync.publisher import WeightPublisher

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from trl import GRPOTrainer

    from mortal.state.tables import CheckpointRow

# the run's failure reason when spec.checkpoint.uri cannot be used
STORAGE_UNAVAILABLE = "CheckpointStorageUnavailable"
# the run's failure reason when this worker cannot shard the actor
SHARDING_UNSUPPORTED = "ShardedActorUnsupported"


def main(ctx: WorkerContext) -> int:
    """Train the run to maxSteps (0), or to a stop request (0, after a checkpoint)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    models.set_threads()
    spec = ctx.run.spec
    checkpointer = Checkpointer(
        ctx.store,
        ctx.worker,
        spec.checkpoint.every,
        spec.checkpoint.keep,
        spec.algorithm.seed,
        fence=ctx.check_fence,
        storage=checkpoint_storage(ctx),
    )
    try:
        resume = checkpointer.resume_point()
    # recorded in a storage the spec no longer names (an unreachable one: OSError, retried)
    except StorageError as exc:
        raise FatalWorkerError(STORAGE_UNAVAILABLE, str(exc)) from exc
    start = resume.step if resume else 0
    ctx.report(step=start)
    if start >= spec.algorithm.max_steps:
        ctx.log.info("checkpoint at step %d already reaches maxSteps: nothing to train", start)
        return EXIT_SUCCEEDED
    rows = data.load_rows(spec.dataset)
    made_by = current_provenance(ctx, rows)
    if resume is not None:
        verify_resume(ctx, resume, made_by.at(start, spec.algorithm.prompts_per_step, spec.algorithm.seed))
    record = functools.partial(_provenance_at, made_by, spec)
    checkpointer.provenance = record
    feed = RolloutFeed(
        ctx.store,
        ctx.worker,
        rows,
        spec.algorithm.seed,
        spec.algorithm.prompts_per_step,
        spec.algorithm.num_generations,
        spec.algorithm.max_staleness,
        spec.algorithm.max_steps,
        reward_names(spec.rewards),
        ctx.stopping,
        prompts_per_task=spec.rollout.task_size(spec.algorithm.prompts_per_step),
        # a GPU step is short enough that a wait for rollouts is latency worth cutting
        poll_seconds=0.05 if spec.actor.gpu == "none" else 0.02,
        doorbell=Doorbell.for_worker(ctx.run_dir, listens_for=RESULTS),
    )
    feed.forget_from(start)
    publisher = WeightPublisher(
        ctx.store,
        ctx.worker,
        keep=spec.sync.keep_versions,
        method=spec.sync_method(),
        provenance=record,
        collective_seconds=spec.deadlines.collective(),
    )
    publisher.clear_partial()
    if queues_ahead(spec):
        feed.enqueue(start, publisher.next_version())
        ctx.log.info(
            "step %d's tasks queued before the trainer is built: GPU rollouts prepare their decode step "
            "meanwhile",
            start,
        )
    wandb_run = open_wandb(
        spec.logging.wandb, ctx.run.name, ctx.run.metadata.uid, ctx.run_dir, ctx.run.spec_dict()
    )
    loop = ActorLoop(
        ctx, spec, feed, publisher, checkpointer, MetricsReporter(ctx.store, ctx.worker, wandb_run)
    )
    ranks, finished = None, False
    if spec.actor.count > 1 and (why := sharded.unsupported()):
        raise FatalWorkerError(SHARDING_UNSUPPORTED, why)
    try:
        if spec.actor.count > 1:
            ranks = sharded.start(ctx.run, spec.actor.count, training.actor_device(spec), follower.follow)
            ranks.watch(functools.partial(_rank_lost, ctx))
            loop.ranks = ranks
        # The Trainer resumes its own checkpoints in an unsharded actor. It refuses a model sharded at load,
        # and cannot read a sharded checkpoint: the loop restores those in on_train_begin, whatever the count.
        trainer_resumes = resume is not None and ranks is None and not is_sharded(resume.path)
        loop.resume_from = resume.path if resume is not None and not trainer_resumes else None
        trainer = build_trainer(ctx, spec, loop)
        ctx.log.info(
            "training from step %d to %d%s%s",
            start,
            spec.algorithm.max_steps,
            f" (resuming from {resume.path})" if resume else "",
            f" on {spec.actor.count} ranks ({spec.actor.strategy.upper()})" if ranks else "",
        )
        with startup_objects_frozen(), CollectionClock() as loop.collections:
            trainer.train(resume_from_checkpoint=resume.path if trainer_resumes else None)
        finished = True
    except StopRequested as exc:
        ctx.log.info("%s", exc)
        finished = True
    except RuntimeError as exc:  # gloo or NCCL saw a peer go before the watcher did: name the rank
        lost = ranks.lost() if ranks is not None else None
        if lost is None:
            raise
        ctx.log.error("a collective failed as %s: %s", lost, exc)
        _rank_lost(ctx, lost)  # reported as the watcher reports it: the lost rank's exit code and message
    finally:
        loop.reporter.close()
        publisher.close()
        if ranks is not None:  # after a crash the other ranks wait in a collective that never comes: end them
            ranks.close(timeout=60.0 if finished else 0.0)
    return EXIT_SUCCEEDED


def queues_ahead(spec: TrainingSpec) -> bool:
    """Whether the first step's tasks are queued before the trainer is built rather than when TRL first asks.

    A GPU rollout's first task pays the decode step's compile and graph capture, long enough that it is
    worth overlapping with the actor building GRPOTrainer. The tasks ask for the version the actor publishes
    first, which a fresh run's rollouts hold already (version 0). Not for CPU rollouts: nothing is compiled,
    and a test's rollout thread in the actor's process would reseed the RNG the trainer draws from."""
    return spec.rollout.gpu != "none"


def warms_up(spec: TrainingSpec, world: int) -> bool:
    """Whether the actor runs one placeholder forward and backward (trl_seam.warm_up_training) while it waits
    for its first rollouts: on one GPU, where the first step's kernel compiles and allocations are otherwise
    paid after the rollouts are in. Not on several ranks (DDP's and FSDP2's hooks expect every backward to be
    a real step's), not with actor.compile (the placeholder's shape would be compiled too), not on a CPU
    (nothing to compile, and a test's rollout thread shares the RNG)."""
    return spec.actor.gpu != "none" and world == 1 and not spec.actor.compile


def checkpoint_storage(ctx: WorkerContext) -> CheckpointStorage | None:
    """The run's checkpoint storage (spec.checkpoint.uri), probed with a write before anything is trained, so
    a URL this node cannot write (unknown protocol, its package missing here, no permission) fails the run at
    once, naming the field, rather than at the first checkpoint with steps trained for nothing."""
    uri = ctx.run.spec.checkpoint.uri
    if uri is None:
        return None
    try:
        storage = CheckpointStorage(uri, ctx.run.name)
        storage.probe()
    except StorageError as exc:
        raise FatalWorkerError(STORAGE_UNAVAILABLE, str(exc)) from exc
    return storage


def _rank_lost(ctx: WorkerContext, lost: sharded.RankLost) -> None:
    """A rank of a sharded actor ended under it: the others would wait in a collective forever, so the
    worker reports it and exits: retryable (the controller relaunches the actor, which resumes), or, when
    the rank ran out of GPU memory, as the actor's own out-of-memory (the controller diagnoses it)."""
    ctx.log.error("%s: exiting with code %d", lost, lost.exit_code)
    ctx.close()
    try:
        ctx.store.report_exit(ctx.worker, "Failed", lost.exit_code, lost.report())
    finally:
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(lost.exit_code)


def current_provenance(ctx: WorkerContext, rows: list[dict[str, Any]]) -> provenance.Provenance:
    """What this actor trains with: its spec's generation, its rewards' code and the rows it read."""
    spec = ctx.run.spec
    entries = [r.model_dump(by_alias=True, mode="json", exclude_none=True) for r in spec.rewards]
    return provenance.Provenance.of(
        ctx.run.metadata.generation,
        provenance.reward_hashes(entries, reward_names(spec.rewards)),
        provenance.dataset_fingerprint(
            spec.dataset.model_dump(by_alias=True, mode="json", exclude_none=True), rows
        ),
    )


def _provenance_at(made_by: provenance.Provenance, spec: TrainingSpec, step: int) -> dict[str, Any]:
    return made_by.at(step, spec.algorithm.prompts_per_step, spec.algorithm.seed).dump()


def verify_resume(ctx: WorkerContext, resume: CheckpointRow, now: provenance.Provenance) -> None:
    """Refuse (FatalWorkerError) a resume that would silently redo or skip work; record a Warning event for
    each deliberate change it goes on through (mortal.workers.actor.resume_check)."""
    spec = ctx.run.spec
    findings = resume_check.verify(
        resume.path,
        resume.step,
        resume.provenance,
        now,
        spec.algorithm.num_epochs,
        spec.algorithm.max_steps,
        spec.actor.count,
    )
    refused = resume_check.refusal_message(findings)
    if refused:
        raise FatalWorkerError(resume_check.REFUSED, refused)
    for finding in findings:
        ctx.log.warning("resuming from step %d: %s", resume.step, finding.message)
        ctx.store.add_event(ctx.run.name, "Warning", finding.reason, finding.message)


def build_trainer(ctx: WorkerContext, spec: TrainingSpec, loop: ActorLoop) -> GRPOTrainer:
    """The GRPOTrainer, wired to the loop: rollouts in through rollout_func, results out by callback."""
    world = loop.ranks.world if loop.ranks is not None else 1
    loop.trainer = training.make_trainer(spec, ctx.run_dir, loop, loop.rollout, world)
    trl_seam.time_loss_start(loop.trainer, loop.loss_begins)
    if world == 1:  # a sharded actor's ranks train slices of the batch, which TRL decodes itself
        loop.hand_texts = trl_seam.reuse_rollout_texts(loop.trainer)
    if world > 1:
        held, total = sharded.local_share(loop.trainer.model)
        ctx.log.info(
            "rank 0 of %d holds %d of the model's %d weights (%s)",
            world,
            held,
            total,
            "FSDP2" if spec.actor.strategy == "fsdp" else "DDP",
        )
    return loop.trainer


class ActorLoop(TrainerCallback):
    """What mortal does around each TRL step: feed rollouts in, publish, report, checkpoint."""

    def __init__(
        self,
        ctx: WorkerContext,
        spec: TrainingSpec,
        feed: RolloutFeed,
        publisher: WeightPublisher,
        checkpointer: Checkpointer,
        reporter: MetricsReporter,
    ) -> None:
        self.ctx, self.spec, self.feed = ctx, spec, feed
        self.publisher, self.checkpointer, self.reporter = publisher, checkpointer, reporter
        self.trainer: GRPOTrainer | None = None
        self.ranks: sharded.Ranks | None = None  # rank 0 of a sharded actor: the other ranks follow it
        # a checkpoint the Trainer cannot resume, restored in on_train_begin
        self.resume_from: str | None = None
        self._rng_from: Path | None = None  # ... whose RNG states are restored as the first step begins
        self.collections: CollectionClock | None = None  # the garbage collector's time, step by step
        self.version = -1
        self._step_started = time.perf_counter()
        self._rollout_metrics: dict[str, float] = {}
        self._rollout_returned: float | None = None  # when rollout_func handed TRL this step's batch
        self._loss_began: float | None = None  # when TRL's loss began on it (trl_seam.time_loss_start)
        # trl_seam.reuse_rollout_texts: the rollouts' texts, not a second decode
        self.hand_texts: trl_seam.HandTexts | None = None
        self._batch: StepBatch | None = None  # the step's rollouts, until its completions are recorded
        self._warmed_up = False  # warm_up_training runs at most once a process
        self._in_step = contextlib.ExitStack()  # the step's activity, reported in the heartbeat
        self._reward_weights = dict(
            zip(reward_names(spec.rewards), (r.weight for r in spec.rewards), strict=True)
        )

    # -- TRL's rollout_func --------------------------------------------------------------------
    def rollout(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        world = self.ranks.world if self.ranks is not None else 1
        trl_seam.check_rollout_call(prompts, self.spec.algorithm.batch_size // world)
        step = trainer.state.global_step
        entered = time.perf_counter()
        self.feed.enqueue(step, self.version)
        self.publisher.prune()  # old versions go while the rollouts load the new one and generate
        started = time.perf_counter()
        if not self._warmed_up and warms_up(self.spec, world):
            # while the rollouts generate the first step (counted as waiting)
            trl_seam.warm_up_training(trainer)
            self._warmed_up = True
        try:
            batch = self.feed.collect(
                step,
                self.version,
                on_stop=lambda: self._checkpoint_once(step),
                while_waiting=self.publisher.ensure_held,
            )
        except StopRequested:
            if self.ranks is not None:
                self.ranks.channel.send("stop")
            raise
        self._rollout_metrics = batch.metrics(step, self.publisher.step_of)
        self._rollout_metrics["actor/wait_seconds"] = time.perf_counter() - started
        # the store's tasks and versions
        self._rollout_metrics["actor/bookkeeping_seconds"] = started - entered
        self._batch = batch
        self._loss_began = None
        output = trl_seam.rollout_output(
            batch.prompt_ids,
            batch.completion_ids,
            batch.logprobs,
            batch.rewards,
            batch.weight_versions,
            env_masks=batch.env_masks(),
        )
        if self.ranks is None:
            texts = batch.decoded_texts()
            if self.hand_texts is not None and texts is not None:
                self.hand_texts(output["completion_ids"], texts)
            self._rollout_returned = time.perf_counter()
            return output
        # TRL gathers the rewards
        slices = [sharded.output_slice(output, rank, world) for rank in range(world)]
        self.ranks.channel.send_each("batch", slices)
        self._rollout_returned = time.perf_counter()
        return slices[0]

    def loss_begins(self) -> None:
        """TRL's loss begins on a micro-batch: the first of a step ends TRL's preparation of the batch."""
        if self._loss_began is None:
            self._loss_began = time.perf_counter()

    # -- Trainer callbacks -----------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Weights, optimizer and scheduler are loaded (fresh or from the checkpoint): the spec's learning
        rate replaces a resumed checkpoint's (a fork or an apply may have changed it), then the weights
        are published before the first rollout. A checkpoint the Trainer does not resume (a sharded
        actor's, or one written by another actor count) is restored here, on every rank at once (rank 0
        names it to the others)."""
        world = self.ranks.world if self.ranks is not None else 1
        if self.ranks is not None:
            self.ranks.channel.send("begin", self.resume_from)
            # wrapped by now: what DDP was given
            replication = sharded.replication(self.trainer.model_wrapped)
            if replication is not None:
                self.ctx.log.info("%s", replication)
        if self.resume_from is not None:
            state.global_step = sharded.restore_checkpoint(self.trainer, Path(self.resume_from))
            self._rng_from = sharded.rng_source(Path(self.resume_from), world)
            if self._rng_from is None:
                self.ctx.log.info(
                    "resumed on %d rank(s) from a checkpoint of %d: model and optimizer resharded, "
                    "RNG states not restored",
                    world,
                    sharded.written_by(Path(self.resume_from)),
                )
        if trl_seam.set_learning_rate(self.trainer, self.spec.algorithm.learning_rate):
            self.ctx.log.info(
                "learning rate set to the spec's %g (the checkpoint's differed)",
                self.spec.algorithm.learning_rate,
            )
        self._publish(state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.publisher.prune()  # the last version's publish left one more than `keep`

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._step_started = time.perf_counter()
        self._in_step.close()
        self._in_step.enter_context(self.ctx.activity(f"step {state.global_step + 1}"))  # its deadline: the
        # controller relaunches an actor whose step (waiting for rollouts included) outlasts stepSeconds
        if self._rng_from is not None:  # a sharded actor's resume: the RNG goes back as the step starts
            sharded.restore_rng(self._rng_from, 0)
            self._rng_from = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step
        if torch.cuda.is_available():  # queued GPU work of the step is training time
            torch.cuda.synchronize()
        elsewhere = sum(
            self._rollout_metrics.get(f"actor/{part}_seconds", 0.0) for part in ("wait", "bookkeeping")
        )
        # TRL's loss, backward and optimizer step: not the store's work before the wait, which the model
        # FLOPs utilization must leave out
        ended = time.perf_counter()
        self._rollout_metrics["actor/train_seconds"] = ended - self._step_started - elsewhere
        if self._rollout_returned is not None and self._loss_began is not None:
            # train = TRL's step before rollout_func + its preparation of the batch (prepare: padding, texts,
            # rewards, advantages, metrics; with beta > 0 the reference model's forward pass) + the update
            # (forward, loss with the importance ratio where samples may be stale (trl_seam.correct_in_loss),
            # backward, clipping, optimizer step). Host clocks, the GPU's queue drained only at the end: on a
            # host-bound step, where the host is.
            self._rollout_metrics["actor/prepare_seconds"] = self._loss_began - self._rollout_returned
            self._rollout_metrics["actor/update_seconds"] = ended - self._loss_began
        self._rollout_metrics["weights/publish_seconds"] = 0.0
        if self.collections is not None:
            self._rollout_metrics["actor/gc_seconds"] = self.collections.take()
        if training.publishes_at(self.spec, step):
            self._publish(step)
            if not (self.ctx.stopping.is_set() or self.checkpointer.due(step, self.spec.algorithm.max_steps)):
                # The next step's tasks now, not when TRL next asks for rollouts: they are generated while
                # this step's metrics and completions are written (rollout() finds them queued). Not before a
                # checkpoint: a stop would leave them unused, and a rollout running in this process (the
                # tests') would swap in its seeded RNG state (fork_rng) while the checkpoint records the RNG.
                self.feed.enqueue(step, self.version)
        else:
            self.ctx.report(step=step)
        self._rollout_metrics["step_seconds"] = time.perf_counter() - self._step_started
        self._in_step.close()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
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
        if self.ranks is not None:
            self.ranks.channel.send("go", stopping)
        if stopping:
            control.should_training_stop = True

    # -- helpers ---------------------------------------------------------------------------------
    def _publish(self, step: int) -> None:
        if torch.cuda.is_available():  # the step's queued GPU work counts as training, not as publishing
            torch.cuda.synchronize()
        started = time.perf_counter()  # no fence check first: version directories are per incarnation
        model = self.trainer.model
        if self.ranks is None or sharded.publishes_alone(self.spec):
            self.version = self.publisher.publish(model, step, prune=False)
        else:  # every rank takes part (sharded.join_publish); the ring, if any, is on rank 0's device
            ring, dtype = self.publisher.transport.in_ring, sharded.publish_dtype(self.spec)
            self.version = self.publisher.publish(
                model,
                step,
                prune=False,
                state=sharded.publish_state(model, ring, dtype),
                gather=functools.partial(sharded.wholes, dtype=dtype) if ring else None,
                device=sharded.rank_device(self.ranks.device, 0),
                cast=dtype,
            )
        self._rollout_metrics["weights/publish_seconds"] = time.perf_counter() - started
        # rollouts waiting for these weights (maxStaleness > 0: their tasks are queued)
        self.feed.doorbell.ring(TASKS)
        self.ctx.report(step=step, weight_version=self.version)

    def _record_completions(self, step: int) -> None:
        """The first logging.completionsPerStep completions of the step just trained, with its advantages."""
        batch, self._batch = self._batch, None
        limit = self.spec.logging.completions_per_step
        if batch is None or limit == 0:
            return
        advantages = trl_seam.step_advantages(self.trainer, len(batch.completion_ids))
        self.reporter.report_completions(
            step, samples.step_completions(batch, advantages, self._reward_weights, limit)
        )

    def _checkpoint_once(self, step: int) -> None:
        """Checkpoint at a step boundary unless this step has one (e.g. the one just resumed from);
        step 0 needs none (a restart from nothing is the same run)."""
        if step > 0 and not self.checkpointer.has(step):
            if self.ranks is None:
                self.checkpointer.write(self.trainer, step, self.version)
            else:
                self.checkpointer.write(
                    self.trainer, step, self.version, save=self._save_sharded, ranks=self.ranks.world
                )

    def _save_sharded(self, trainer: GRPOTrainer, dest: Path) -> None:
        assert self.ranks is not None
        self.ranks.channel.send("checkpoint", str(dest))  # every rank writes its shards into dest
        sharded.save_sharded(trainer, dest, 0)
