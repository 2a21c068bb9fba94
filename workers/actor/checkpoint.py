"""The actor's checkpoints: complete, atomic, recorded in the store, pruned to `checkpoint.keep`.

Called by mortal.workers.actor.loop (`Checkpointer.write` every `checkpoint.every` steps, at the last
step and when asked to stop; `Checkpointer.resume_point` when it starts).

    $MORTAL_HOME/runs/<run>/checkpoints/step-<N>/
        model.safetensors | adapter_model.safetensors (+ config, tokenizer)
        optimizer.pt  scheduler.pt  rng_state.pth  trainer_state.json   (the Trainer's own files)
      or, from a sharded actor (actor.count > 1, mortal.workers.actor.sharded):
        dcp/  model and optimizer shards (torch.distributed.checkpoint)
        scheduler.pt  rng_state_<rank>.pth  trainer_state.json
        mortal.json   {"step", "weight_version", "seed", "run", "provenance"} (actor.provenance)

A checkpoint exists for readers only once its directory was renamed into place (after fsync) and
its row recorded, in that order; a crash at any point leaves either no visible checkpoint or a
complete one. Pruning deletes the row first, then the files. It must not decide when to write.

With spec.checkpoint.uri (mortal.workers.actor.storage) the folder is written here as above, then uploaded to
`<uri>/<run>/step-<N>/` (the marker last), and the row records that URL: every node can resume from it.
`resume_point` downloads the newest one into this node's MORTAL_HOME when its copy is not here, and
returns the row with the local folder as its path, so what reads the checkpoint after it (resume_check,
the Trainer) reads a folder on this machine as always.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.state import paths
from mortal.state.containment import PathOutside, inside, report_refused, tree_inside
from mortal.state.store import Store, WorkerRef
from mortal.state.tables import CheckpointRow
from mortal.workers.actor import trl_seam
from mortal.workers.actor.storage import MARKER, CheckpointStorage, StorageError, is_url
from mortal.workers.atomic import atomic_dir, remove_stale_tmp

if TYPE_CHECKING:
    from trl import GRPOTrainer

MORTAL_FILE = MARKER  # also the completion marker of an uploaded checkpoint (uploaded last)
DCP_DIR = "dcp"  # torch.distributed.checkpoint's folder inside a checkpoint of a sharded actor
log = logging.getLogger("mortal.checkpoint")


def checkpoint_dir(run: str, step: int) -> Path:
    return paths.checkpoints_dir(run) / f"step-{step}"


def read_marker(path: str | Path) -> dict[str, Any]:
    """mortal.json of a checkpoint: what mortal itself needs to resume (step, weight_version, seed)."""
    return json.loads((Path(path) / MORTAL_FILE).read_text())


def is_sharded(path: str | Path) -> bool:
    """A sharded actor's checkpoint (torch.distributed.checkpoint, mortal.workers.actor.sharded), not the
    Trainer's."""
    return (Path(path) / DCP_DIR).is_dir()


def sharded_files(rank_count: int) -> list[str]:
    """The files a sharded checkpoint must hold to resume (mortal.workers.actor.trl_seam.checkpoint_files'
    twin). Here, with the layout, and not in mortal.workers.actor.sharded: readers of checkpoints (the CLI's
    fork and cp, resume_check) must not import torch.distributed to know what a complete checkpoint is."""
    return [
        f"{DCP_DIR}/.metadata",
        "scheduler.pt",
        "trainer_state.json",
        *(f"rng_state_{r}.pth" for r in range(rank_count)),
    ]


def checkpoint_files(path: str | Path) -> list[str]:
    path = Path(path)
    if is_sharded(path):
        return sharded_files(int(read_marker(path).get("ranks", 1)))
    return trl_seam.checkpoint_files(path)


def is_complete(path: str | Path) -> bool:
    """Every file a resume needs is there (a checkpoint deleted by hand, or a foreign folder, is not)."""
    path = Path(path)
    return (path / MORTAL_FILE).is_file() and all((path / f).is_file() for f in checkpoint_files(path))


@dataclass
class Checkpointer:
    """Writes, lists and prunes one run's checkpoints on behalf of its (single) actor."""

    store: Store
    worker: WorkerRef
    every: int
    keep: int
    seed: int
    fence: Callable[[], None] = lambda: None  # heartbeat-now before writing files (a zombie exits there)
    # what made the state at a step (workers.provenance)
    provenance: Callable[[int], dict[str, Any]] | None = None
    storage: CheckpointStorage | None = None  # spec.checkpoint.uri: where every checkpoint is uploaded
    _uploaded: set[int] = field(default_factory=set, init=False, repr=False)  # steps this process uploaded

    @property
    def run(self) -> str:
        return self.worker.run

    def due(self, step: int, max_steps: int) -> bool:
        return step > 0 and (step % self.every == 0 or step >= max_steps)

    def has(self, step: int) -> bool:
        return any(row.step == step for row in self.store.list_checkpoints(self.run))

    def write(
        self,
        trainer: GRPOTrainer,
        step: int,
        weight_version: int,
        save: Callable[[Any, Path], None] | None = None,
        ranks: int = 1,
    ) -> Path:
        """Write the trainer's state at `step` atomically, record it, prune; returns its directory.
        `save` writes the state into the temporary directory (default: the Trainer's own writer; a
        sharded actor's writes its `ranks` ranks' shards, mortal.workers.actor.sharded.save_sharded)."""
        self.fence()
        final = checkpoint_dir(self.run, step)
        made_by = self.provenance(step) if self.provenance is not None else None
        with atomic_dir(final) as tmp:
            (save or trl_seam.save_checkpoint)(trainer, tmp)
            marker = {"run": self.run, "step": step, "weight_version": weight_version, "seed": self.seed}
            if ranks > 1:
                marker["ranks"] = ranks
            if made_by is not None:  # also in the row; here so the folder alone says what made it (fork, cp)
                marker["provenance"] = made_by
            (tmp / MORTAL_FILE).write_text(json.dumps(marker, indent=1) + "\n")
        where = str(final) if self.storage is None else self.storage.upload(final, step)
        if self.storage is not None:
            self._uploaded.add(step)
        self.store.record_checkpoint(self.worker, step, where, weight_version, provenance=made_by)
        log.info("checkpoint step %d (weights v%d) at %s", step, weight_version, where)
        self.prune()
        return final

    def prune(self) -> None:
        """Keep the newest `keep` checkpoints: forget each older row, then delete its files, if they are the
        run's own (mortal.state.containment: a row pointing elsewhere gets a Warning event, its path is
        left)."""
        rows = self.store.list_checkpoints(self.run)
        for row in rows[: max(0, len(rows) - self.keep)]:
            self.store.delete_checkpoint(self.worker, row.step)
            try:
                if is_url(row.path):
                    self._storage(row.path).remove(row.path)
                    shutil.rmtree(checkpoint_dir(self.run, row.step), ignore_errors=True)  # this node's copy
                else:
                    shutil.rmtree(inside(paths.checkpoints_dir(self.run), row.path), ignore_errors=True)
            except PathOutside as exc:
                log.warning("not removing checkpoint step %d: %s", row.step, exc)
                report_refused(self.store, self.run, f"pruning checkpoint step-{row.step}", exc)

    def resume_point(self) -> CheckpointRow | None:
        """The newest recorded checkpoint whose files are complete; newer broken ones are forgotten.
        One in storage (a URL) is downloaded into this node's MORTAL_HOME, unless this process uploaded it
        from there: a folder of that step found here may be another incarnation's unrecorded write, or a
        deleted run's of the same name, never to be trusted for the recorded one. The row returned then
        has the local folder as its path (the store's row keeps the URL).

        Also clears temporary directories of a writer that died mid-checkpoint. A storage that cannot be
        read raises StorageError rather than forgetting checkpoints it could not see.
        """
        remove_stale_tmp(paths.checkpoints_dir(self.run))
        for row in reversed(self.store.list_checkpoints(self.run)):
            try:
                self._owned(row)
            except PathOutside as exc:  # never loaded: forgotten like an incomplete one, with an event
                log.warning("checkpoint step %d: %s", row.step, exc)
                report_refused(self.store, self.run, f"resuming from checkpoint step-{row.step}", exc)
                self.store.delete_checkpoint(self.worker, row.step)
                continue
            if not is_url(row.path):
                if is_complete(row.path):
                    return row
            elif self._storage(row.path).complete(row.path):
                local = checkpoint_dir(self.run, row.step)
                if row.step not in self._uploaded or not is_complete(local):
                    log.info("downloading checkpoint step %d from %s", row.step, row.path)
                    self._storage(row.path).download(row.path, local)
                if is_complete(local):
                    return row.model_copy(update={"path": str(local)})
            log.warning("checkpoint step %d at %s is incomplete; forgetting it", row.step, row.path)
            self.store.delete_checkpoint(self.worker, row.step)
        return None

    def _owned(self, row: CheckpointRow) -> Path | str:
        """The row's folder resolved, when it and every symlink below it lie in the run's checkpoints folder,
        or its URL when under spec.checkpoint.uri's <run>/ (PathOutside otherwise): what resume may load."""
        if is_url(row.path):
            return self._storage(row.path).owns(row.path)
        return tree_inside(paths.checkpoints_dir(self.run), row.path)

    def _storage(self, url: str) -> CheckpointStorage:
        """The storage a recorded URL is in: the spec's (a row written under another checkpoint.uri is refused
        by CheckpointStorage, naming the field, rather than read from a storage the spec no longer names)."""
        if self.storage is None:
            raise StorageError(
                f"checkpoint {url} is in storage, but this run's spec.checkpoint.uri is not set: set it "
                "back to the storage the checkpoints were written to"
            )
        return self.storage
