"""The actor's side of weight sync: publish a version through the run's transport, record it, keep the
newest few.

Who calls it: the actor (`WeightPublisher.publish` after optimizer steps, `ensure_held` while it waits for
rollouts, `prune`). The transport is spec.sync's method (mortal.workers.sync.transport_for); the store's row
records the method with the version, so a rollout loads it the way it was published.
What it must not do: decide when to publish (the actor does) or touch the task queue.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mortal.specs.deadlines import DEFAULT_COLLECTIVE_SECONDS
from mortal.state import paths
from mortal.state.containment import PathOutside, inside, report_refused
from mortal.state.store import Store, WorkerRef
from mortal.workers.atomic import remove_stale_tmp, sweep
from mortal.workers.sync import transport_for
from mortal.workers.sync.base import KEEP_VERSIONS, Gather

log = logging.getLogger("mortal.weights")


def version_dir(run: str, version: int, incarnation: int) -> Path:
    """A version's directory, named for the actor incarnation that writes it: a fenced actor still
    writing cannot replace its successor's files (it can only leave a directory no row points to,
    which `prune` sweeps), so a publish needs no fence check of its own before it writes."""
    return paths.weights_dir(run) / f"v{version}-i{incarnation}"


@dataclass
class WeightPublisher:
    """Write or share a version, record it, keep the newest few."""

    store: Store
    worker: WorkerRef
    keep: int = KEEP_VERSIONS
    method: str = "volume"  # or "ray", "ipc", "nccl" (spec.sync_method())
    steps: dict[int, int] = field(default_factory=dict)  # version -> the step its weights are from
    provenance: Callable[[int], dict[str, Any]] | None = None  # what made a step's weights (actor.provenance)
    # spec.deadlines.collectiveSeconds (nccl transfers)
    collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS

    def __post_init__(self) -> None:
        self.transport = transport_for(self.method)(self.keep, self.collective_seconds)
        self._last_version: int | None = None  # the last version this publisher recorded

    def close(self) -> None:
        """Stop serving versions (nccl's threads); the actor calls it as it exits."""
        self.transport.close()

    @property
    def run(self) -> str:
        return self.worker.run

    def next_version(self) -> int:
        """One more than any version ever recorded for the run (versions never go backwards). Asked of
        the store once: after that only this publisher records versions (another incarnation would
        have fenced it, and its record would fail)."""
        if self._last_version is not None:
            return self._last_version + 1
        latest = self.store.latest_weights(self.run)
        return 0 if latest is None else latest.version + 1

    def clear_partial(self) -> None:
        """Remove temporary directories left by an actor that died mid-write (call at start)."""
        remove_stale_tmp(paths.weights_dir(self.run))

    def publish(
        self,
        model: torch.nn.Module,
        step: int,
        version: int | None = None,
        prune: bool = True,
        state: dict[str, torch.Tensor] | None = None,
        gather: Gather | None = None,
        device: torch.device | None = None,
        cast: torch.dtype | None = None,
    ) -> int:
        """Write (or share), record and (unless `prune` is False: the actor prunes while it waits for
        rollouts, off the path a new version takes to them) prune; returns the version published.
        `state`, `gather`, `device`, `cast`: a sharded actor's, as WeightTransport.publish takes them
        (mortal.workers.actor.sharded.publish_state says which)."""
        version = self.next_version() if version is None else version
        dest = version_dir(self.run, version, self.worker.incarnation)
        where = self.transport.publish(
            model,
            dest,
            version,
            step,
            self.worker.incarnation,
            state=state,
            gather=gather,
            device=device,
            cast=cast,
        )
        made_by = self.provenance(step) if self.provenance is not None else None
        self.store.publish_weights(self.worker, version, step, where, method=self.method, provenance=made_by)
        self._last_version = version
        self.steps[version] = step
        if prune:
            self.prune()
        return version

    def ensure_held(self) -> None:
        """While the actor waits for rollouts: the transport keeps the versions reachable (sync ray puts back
        what its hub lost)."""
        self.transport.keep_alive(self.worker.incarnation)

    def step_of(self, version: int) -> int:
        """The optimizer step whose result `version` is (asked of the store for older versions)."""
        if version not in self.steps:
            for row in self.store.list_weights(self.run):
                self.steps.setdefault(row.version, row.step)
        return self.steps[version]

    def prune(self) -> None:
        """Delete all but the newest `keep` versions: row first (rollouts stop choosing it), then files.

        A queued task needs a version >= its min_weight_version, which the newest always satisfies,
        so no task needs an older one; `keep` > 1 leaves time for a rollout loading one just replaced.
        """
        rows = sorted(self.store.list_weights(self.run), key=lambda row: row.version)
        retired = rows[: max(0, len(rows) - self.keep)]
        for row in retired:
            self.store.delete_weights(self.worker, row.version)
            if not transport_for(row.method).version_folders:  # ray's hub drops its own (sync.ray.KEEP)
                continue
            try:
                shutil.rmtree(inside(paths.weights_dir(self.run), row.path), ignore_errors=True)
            except PathOutside as exc:  # a row pointing outside the run's weights: never followed
                log.warning("not removing weight version %d: %s", row.version, exc)
                report_refused(self.store, self.run, f"pruning weight version {row.version}", exc)
        if self.transport.version_folders:  # (with ray, the folder holds what rollouts of this node received)
            sweep(paths.weights_dir(self.run), {row.path for row in rows[len(retired) :]})
