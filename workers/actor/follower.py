"""Ranks 1..N-1 of a sharded actor: the trainer rank 0 has, trained on this rank's slice of each batch.

Who calls it: mortal.workers.actor.sharded.follower_main, in each child rank rank 0 spawned (rank 0 hands
it `follow`). Each rank does what rank 0 tells it over the ranks' channel (a batch slice, a checkpoint, go
or stop) and joins rank 0's collectives in rank 0's order.
What it must not do: talk to the store, or decide anything rank 0 decides.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from mortal.specs.run import TrainingRun
from mortal.specs.training import TrainingSpec
from mortal.state import paths
from mortal.workers.actor import sharded, trl_seam
from mortal.workers.actor.feed import StopRequested
from mortal.workers.actor.training import make_trainer, publishes_at
from mortal.workers.runtime import startup_objects_frozen
from mortal.workers.sync import transport_for

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from trl import GRPOTrainer


def follow(run: TrainingRun, ranks: sharded.Ranks) -> None:
    """Ranks 1..N-1 of a sharded actor (mortal.workers.actor.sharded.follower_main): the same trainer as rank
    0, trained on this rank's slice of each batch, in step with rank 0's collectives. No store."""
    spec = run.spec
    follower = Follower(spec, ranks)
    follower.trainer = make_trainer(
        spec, paths.run_dir(run.name), follower, follower.rollout, ranks.world, ranks.rank
    )
    with contextlib.suppress(StopRequested), startup_objects_frozen():
        # StopRequested: rank 0 stopped while waiting for rollouts, checkpointed first
        follower.trainer.train()


class Follower(TrainerCallback):
    """What a rank other than 0 does around each TRL step: what rank 0 tells it, and the collectives."""

    def __init__(self, spec: TrainingSpec, ranks: sharded.Ranks) -> None:
        self.spec, self.ranks = spec, ranks
        self.trainer: GRPOTrainer | None = None
        self._rng_from: Path | None = None
        self._joins = not sharded.publishes_alone(spec)  # whether rank 0's publish has collectives to join
        # how rank 0 publishes: which collectives to join
        self._ring = transport_for(spec.sync_method()).in_ring
        self._dtype = sharded.publish_dtype(spec)  # and in which dtype their buffers are

    def _serve(self, until: str) -> Any:
        """Do rank 0's checkpoints until its message of kind `until` (or "stop") comes; its payload."""
        while True:
            kind, payload = self.ranks.channel.recv()
            if kind == "checkpoint":
                sharded.save_sharded(self.trainer, Path(payload), self.ranks.rank)
            elif kind == "stop":
                raise StopRequested("rank 0 stopped")
            elif kind == until:
                return payload
            else:
                raise sharded.ShardedError(
                    f"rank {self.ranks.rank} expected {until!r} from rank 0, got {kind!r}"
                )

    def rollout(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        return self._serve("batch")  # this rank's slice (Channel.send_each)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        resume_from = self._serve("begin")
        if resume_from is not None:
            state.global_step = sharded.restore_checkpoint(self.trainer, Path(resume_from))
            self._rng_from = sharded.rng_source(Path(resume_from), self.ranks.world)
        trl_seam.set_learning_rate(self.trainer, self.spec.algorithm.learning_rate)
        self._join_publish()  # rank 0 publishes the weights it starts from

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._rng_from is not None:
            sharded.restore_rng(self._rng_from, self.ranks.rank)
            self._rng_from = None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if publishes_at(self.spec, state.global_step):
            self._join_publish()

    def _join_publish(self) -> None:
        if self._joins:
            sharded.join_publish(self.trainer.model, self._ring, self._dtype)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs or "loss" not in logs:
            return
        if self._serve("go"):
            control.should_training_stop = True
