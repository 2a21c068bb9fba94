"""The one interface every weight transport implements: how a version travels from the actor to rollouts.

Who calls it: the actor through WeightPublisher (`publish`, `keep_alive`, `close`), rollout workers and
their engine (`locate`, `load`, `loaded_whole`). Transports: volume (files in the run's folder), ray (those
files through Ray's object store), ipc and nccl (a slot of a ring of snapshots on the actor's GPU);
mortal.workers.sync.transport_for picks one by method (spec.sync's, or a version row's).
What a transport must not do: record versions in the store or decide when to publish (the publisher does).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

import torch

from mortal.specs.deadlines import DEFAULT_COLLECTIVE_SECONDS
from mortal.state import paths
from mortal.state.containment import inside

KEEP_VERSIONS = 3  # versions a publisher keeps recorded (spec.sync.keepVersions); a ring has as many slots
# shards -> each tensor whole, in order (collectives: mortal.workers.actor.sharded.wholes)
Gather = Callable[[list[torch.Tensor]], Iterable[torch.Tensor]]


class WeightsError(RuntimeError):
    """Published weights do not fit the model that loads them (or a model cannot be published)."""


class WeightTransport(abc.ABC):
    """How weight versions travel: one instance per publisher, and per method in a rollout."""

    method: ClassVar[str]  # spec.sync's method, as the store records it with each version
    in_ring: ClassVar[bool] = False  # a version is a slot of the actor's GPU snapshot ring (ipc, nccl)
    # Each version is a folder of the run's weights folder, removed when it is retired; not with ray, whose
    # versions live in the object store (that folder holds what the node's rollouts received).
    version_folders: ClassVar[bool] = True

    def __init__(
        self, keep: int = KEEP_VERSIONS, collective_seconds: float = DEFAULT_COLLECTIVE_SECONDS
    ) -> None:
        self.keep = keep
        self.collective_seconds = collective_seconds  # spec.deadlines.collectiveSeconds: nccl's transfers

    # -- the actor's side ------------------------------------------------------------------------
    @abc.abstractmethod
    def publish(
        self,
        model: torch.nn.Module,
        dest: Path,
        version: int,
        step: int,
        incarnation: int,
        state: dict[str, torch.Tensor] | None = None,
        gather: Gather | None = None,
        device: torch.device | None = None,
        cast: torch.dtype | None = None,
    ) -> str:
        """Write or share `version` of `model` as the folder `dest`; returns the path the store records.
        `state`: a sharded actor's weights instead of the model's: full CPU tensors for files, or its shards
        for a ring, with the `gather` that makes each whole, the ring's `device` and the dtype `cast`."""

    def keep_alive(self, incarnation: int) -> None:
        """While the actor waits for rollouts: keep the versions they will ask for reachable."""
        return None

    def close(self) -> None:
        """Stop serving versions (the actor is exiting)."""
        return None

    # -- the rollout's side ----------------------------------------------------------------------
    def locate(self, path: str, run: str, uid: str) -> Path:
        """The folder on this node to load the version recorded at `path` from. PathOutside unless it lies in
        the run's weights folder: a row from the store is never followed elsewhere."""
        return inside(paths.weights_dir(run), path)

    @abc.abstractmethod
    def load(self, model: torch.nn.Module, path: str | Path) -> None:
        """Copy the version at `path` into `model` in place; WeightsError unless it fits. FileNotFoundError
        when the version is gone (a newer one exists, or will): the rollout reads the store again."""

    def loaded_whole(self, path: str | Path, newest_recorded: Callable[[], int | None]) -> bool:
        """Whether the version just loaded from `path` was read whole (a ring's slot may have been reused);
        `newest_recorded` asks the store, only where that decides it."""
        return True
