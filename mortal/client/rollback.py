"""Rollback: a run taken back to its checkpoint of an earlier step (`mortalctl rollback RUN --to step-N`).

The run is suspended (the controller stops its workers; the actor checkpoints on its way out), every
step after N is forgotten in the store (`Store.rollback_run`: later checkpoint rows, metrics,
completions, tasks), the later checkpoints' files are moved to `rolled-back/<time>/` (or deleted), and
the run resumes if it was running. No row points at a later checkpoint any more, so the actor resumes
from N as after a preemption.
What it must not do: import torch, or start and stop workers itself (the controller does, on spec.suspend).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from mortal.client.fork import (
    CheckpointOutside,
    ForkError,
    complete_checkpoint,
    owned_folder,
    refuse_files_elsewhere,
)
from mortal.client.local_controller import wake_controller
from mortal.specs.status import TERMINAL_PHASES

if TYPE_CHECKING:
    from mortal.state import Store

ROLLED_BACK = "rolled-back"


class RollbackRefused(ForkError):
    """The run cannot be rolled back now (finished, being deleted, on Modal, workers did not stop)."""


@dataclass(frozen=True)
class RolledBack:
    run: str
    step: int
    later: list[int]
    kept_in: Path | None  # where the later checkpoints went (None: dropped, or there were none)
    resumed: bool


def _kept_in(run: str) -> Path:
    """The folder the later checkpoints are moved to, checked to lie in the run's folder once resolved: a
    `rolled-back` that is a link elsewhere (a worker writes the run's folder) is refused, before anything
    changed, rather than followed."""
    from mortal.state import paths
    from mortal.state.containment import PathOutside, inside

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    try:
        return inside(paths.run_dir(run), Path(ROLLED_BACK) / stamp)
    except PathOutside as exc:
        raise RollbackRefused(f"cannot keep the later checkpoints: {exc}; nothing was changed") from None


def rollback_run(
    store: Store,
    run: str,
    step: int,
    drop_later: bool = False,
    *,
    stop_timeout: float = 120.0,
    on_suspend: Callable[[], None] = lambda: None,
    poll_seconds: float = 0.5,
) -> RolledBack:
    """Roll `run` back to its checkpoint of `step` (the module's docstring says how); `on_suspend` runs once
    the run was suspended by this call (the CLI makes sure a controller runs there, to stop the workers)."""
    from mortal.state import NotFound

    row = store.get_run(run)
    if row.deleted_at is not None:
        raise RollbackRefused(f"trainingrun {run!r} is being deleted")
    if row.phase in TERMINAL_PHASES:
        raise RollbackRefused(
            f"trainingrun {run!r} is {row.phase}; a finished run cannot be rolled back: fork it "
            f"instead (mortalctl fork {run}:step-{step} NEW)"
        )
    refuse_files_elsewhere(run, row.spec.get("backend", "local"), "rolling back moves", RollbackRefused)
    complete_checkpoint(store, run, step)
    kept_in = None if drop_later else _kept_in(run)
    was_suspended = bool(row.spec.get("suspend"))
    if not was_suspended:
        _set_suspend(store, run, True)
        on_suspend()
    _wait_stopped(store, run, stop_timeout, poll_seconds)
    try:
        later = store.rollback_run(run, step)
    except NotFound as exc:  # a checkpoint written before the workers stopped pruned it (checkpoint.keep)
        if not was_suspended:  # nothing was rolled back: the run goes on as before the command
            _set_suspend(store, run, False)
        state = "stays suspended" if was_suspended else "was resumed as it was"
        raise RollbackRefused(
            f"{exc} any more: a checkpoint the run wrote before its workers stopped pruned it "
            "(spec.checkpoint.keep keeps the newest); "
            f"nothing was rolled back and trainingrun {run!r} {state}"
        ) from None
    if not later:
        kept_in = None
    elif kept_in is not None:
        kept_in.mkdir(parents=True, exist_ok=True)
    uri = row.spec.get("checkpoint", {}).get("uri")
    for ckpt in later:
        if "://" in ckpt.path:  # in storage (spec.checkpoint.uri): its files stay there, as they always did
            continue
        try:
            folder = owned_folder(store, run, ckpt, uri, "rolling back")
        except CheckpointOutside:  # refused, never followed (owned_folder wrote the Warning event)
            continue
        if kept_in is not None and folder.is_dir():
            os.rename(folder, kept_in / folder.name)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    steps = [c.step for c in later]
    what = (
        "no later checkpoints"
        if not later
        else f"later checkpoints {', '.join(f'step-{s}' for s in steps)} "
        + (f"kept in {kept_in}" if kept_in else "removed")
    )
    store.add_event(
        run,
        "Normal",
        "RolledBack",
        f"rolled back to step {step} ({what}); training resumes from the checkpoint of step {step}",
    )
    if not was_suspended:
        _wait_status_step(store, run, step, min(stop_timeout, 15.0), poll_seconds)
        _set_suspend(store, run, False)
    wake_controller(run)
    return RolledBack(run, step, steps, kept_in, not was_suspended)


def _set_suspend(store: Store, run: str, value: bool, retries: int = 5) -> None:
    """spec.suspend = value, compare-and-swap on resource_version (retried on a concurrent write)."""
    from mortal.state import Conflict

    for attempt in range(retries):
        row = store.get_run(run)
        if bool(row.spec.get("suspend")) == value:
            break
        try:
            store.update_spec(run, {**row.spec, "suspend": value}, row.resource_version)
            break
        except Conflict:
            if attempt == retries - 1:
                raise
    wake_controller(run)


def _wait_status_step(store: Store, run: str, step: int, timeout: float, poll_seconds: float) -> None:
    """Give a running controller the pass that rebuilds the suspended run's status at `step` before it is
    resumed, so that the steps trained again count as progress (Progressing) from there, not from the
    step the run had reached. Without a leader (no controller runs) there is nothing to wait for."""
    from mortal.controller.leader import LEASE_NAME

    wake_controller(run)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lease = store.get_lease(LEASE_NAME)
        expires = lease.expires_at if lease is not None else None
        if expires is None or (expires if expires.tzinfo else expires.replace(tzinfo=UTC)) <= datetime.now(
            UTC
        ):
            return
        if store.get_run(run).status.get("step") == step:
            return
        time.sleep(poll_seconds)


def _wait_stopped(store: Store, run: str, timeout: float, poll_seconds: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        live = store.list_workers(run, live_only=True)
        if not live:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"{w.role}-{w.replica}" for w in live)
            raise RollbackRefused(
                f"trainingrun {run!r}: workers still running after {timeout:g}s ({names}); it "
                "stays suspended, nothing was rolled back (is a controller running?)"
            )
        time.sleep(poll_seconds)
