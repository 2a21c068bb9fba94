"""`mortalctl fork RUN[:step-N] NEW` and `mortalctl rollback RUN --to step-N`: start again from a checkpoint.

Called by the CLI (the verbs below) and by `MortalTrainer.train(resume_from_checkpoint=...)` (`fork_run`).
Neither has a resume path of its own: the actor resumes from the newest *recorded* complete checkpoint
(`Checkpointer.resume_point`) as after a preemption, so
- a fork copies (hard-links where the filesystem allows: checkpoint files are never written in place)
  the parent's checkpoint of step N into NEW's folder, then creates NEW and records that checkpoint as
  NEW's in one store transaction (`Store.fork_run`): NEW's first step is N+1, with the parent's weights,
  optimizer, scheduler, RNG and data position (the step);
- a rollback suspends the run (the controller stops its workers; the actor checkpoints on its way out),
  then forgets every step after N in the store (`Store.rollback_run`: later checkpoint rows, metrics,
  completions, tasks), moves the later checkpoints' files out of `checkpoints/` (to
  `rolled-back/<time>/`, or deletes them with --drop-later), records a RolledBack event and resumes the
  run if it was running. No row points at a later checkpoint any more, so none can be picked as newest.
What it must not do: import torch, or start and stop workers itself (the controller does, on spec.suspend).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mortal.controller.cli.context import TERMINAL_PHASES, CliError, ensure_controller, state, wake_controller
from mortal.controller.cli.text import plain

if TYPE_CHECKING:
    from mortal.specs import TrainingRun
    from mortal.state import CheckpointRow, Store

SOURCE = re.compile(r"^(?P<run>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(:step-(?P<step>\d+))?$")
ROLLED_BACK = "rolled-back"


class ForkError(CliError):
    """A fork or rollback refused; the message names the run and step."""


class CheckpointNotFound(ForkError):
    """The run has no recorded complete checkpoint of that step (or none at all)."""


class CheckpointIncomplete(ForkError):
    """The checkpoint is recorded but some of its files are gone from disk."""


class CheckpointInStorage(ForkError):
    """The checkpoint is in remote storage (spec.checkpoint.uri: s3://, gs://, ...), not on this machine."""


class RunExists(ForkError):
    """NEW is the name of an existing run."""


class CannotCarryOver(ForkError):
    """The overrides change something the checkpoint cannot carry over (specs/fork.py lists what)."""


class RollbackRefused(ForkError):
    """The run cannot be rolled back now (finished, being deleted, on Modal, workers did not stop)."""


class CheckpointOutside(ForkError):
    """The checkpoint row points outside the run's own checkpoints (mortal.state.containment): refused."""


def parse_source(source: str) -> tuple[str, int | None]:
    """RUN or RUN:step-N -> (run, step or None)."""
    match = SOURCE.match(source.strip())
    if match is None:
        raise CliError(f"{source!r}: expected RUN or RUN:step-N (e.g. quickstart:step-20)")
    step = match.group("step")
    return match.group("run"), int(step) if step is not None else None


def complete_checkpoint(store: Store, run: str, step: int | None) -> CheckpointRow:
    """The run's recorded checkpoint of `step` (the newest with None), its files checked on disk."""
    from mortal.workers.actor.checkpoint import is_complete
    from mortal.workers.main import WORKLOAD_ANNOTATION

    owner = store.get_run(run)
    other_workload = bool(owner.annotations.get(WORKLOAD_ANNOTATION))  # e.g. simulated: own files
    uri = owner.spec.get("checkpoint", {}).get("uri")

    def whole(row: CheckpointRow) -> bool:
        folder = owned_folder(store, run, row, uri)
        return folder.is_dir() if other_workload else is_complete(folder)

    rows = store.list_checkpoints(run)
    if step is None:
        complete = [row for row in rows if whole(row)]
        if not complete:
            raise CheckpointNotFound(f"trainingrun {run!r} has no complete checkpoint yet")
        return complete[-1]
    row = next((r for r in rows if r.step == step), None)
    if row is None:
        kept = ", ".join(f"step-{r.step}" for r in rows) or "none"
        raise CheckpointNotFound(f"trainingrun {run!r} has no complete checkpoint of step {step} (it keeps {kept})")
    if not whole(row):
        raise CheckpointIncomplete(f"checkpoint step-{step} of trainingrun {run!r} at {row.path} is incomplete "
                                   "on disk (files missing)")
    return row


# Backends whose checkpoints are files under this machine's MORTAL_HOME: local, and ray, whose nodes share
# MORTAL_HOME with the controller (docs/ray.md). Modal's lie on its volume, out of this machine's reach.
FILES_HERE = ("local", "ray")


def _refuse_files_elsewhere(run: str, backend: str, doing: str, error: type[ForkError] = ForkError) -> None:
    if backend not in FILES_HERE:
        raise error(f"trainingrun {run!r} runs on backend {backend!r}, whose checkpoints are not on this machine; "
                    f"{doing} checkpoint files under MORTAL_HOME and is built for backends "
                    f"{' and '.join(FILES_HERE)}")


def checkpoint_folder(run: str, row: CheckpointRow) -> Path:
    """The folder on this machine of a recorded checkpoint: its path, or a file:// URL's (spec.checkpoint.uri
    on a mounted filesystem). CheckpointInStorage for remote storage, which fork reads nothing from."""
    from mortal.workers.actor.storage import local_path

    folder = local_path(row.path)
    if folder is None:
        raise CheckpointInStorage(
            f"checkpoint step-{row.step} of trainingrun {run!r} is in the storage of spec.checkpoint.uri ({row.path}); "
            f"fork reads checkpoints on this machine only: download it with `mortalctl cp {run}:step-{row.step} DIR`")
    return folder


def owned_folder(store: Store, run: str, row: CheckpointRow, uri: str | None, doing: str = "reading") -> Path:
    """checkpoint_folder, checked to lie inside what the run owns, symlinks inside it included
    (mortal.state.containment); a row pointing elsewhere gets a Warning event and CheckpointOutside."""
    from mortal.state.containment import PathOutside, owned_checkpoint, report_refused, tree_inside
    from mortal.workers.actor.storage import local_path

    folder = checkpoint_folder(run, row)
    try:
        owned = local_path(owned_checkpoint(run, row.path, uri))  # the folder checked (a relative row: the run's)
        real = Path(os.path.realpath(owned or folder))
        return tree_inside(real.parent, real)  # what a copy or load would follow below it
    except PathOutside as exc:
        report_refused(store, run, f"{doing} checkpoint step-{row.step}", exc)
        raise CheckpointOutside(f"checkpoint step-{row.step} of trainingrun {run!r}: {exc}") from None


# -- fork --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Forked:
    run: TrainingRun
    parent: str
    step: int
    path: Path
    linked: bool  # hard links (no bytes copied) rather than a copy


def fork_run(
    store: Store,
    source: str,
    step: int | None,
    name: str,
    *,
    document: TrainingRun | None = None,
    fragment: dict[str, Any] | None = None,
    fragment_source: str = "<overrides>",
    fragment_lines: dict[tuple, int] | None = None,
    sets: list[str] | None = None,
) -> Forked:
    """Create run `name` from `source`'s checkpoint of `step` (newest when None). Its spec is `document`'s
    when given (MortalTrainer), else the parent's with `fragment` and `sets` merged over it."""
    from mortal.controller.snapshot import carry_snapshot
    from mortal.specs.fork import carry_over_problems, forked_document
    from mortal.state import Conflict, NotFound, paths

    parent = store.get_run(source)  # NotFound: "trainingrun 'x' not found"
    parent_doc = parent.document()
    _refuse_files_elsewhere(source, parent_doc.spec.backend, "forking copies")
    checkpoint = complete_checkpoint(store, source, step)
    try:
        store.get_run(name)
        raise RunExists(f"trainingrun {name!r} already exists; pick another name for the fork")
    except NotFound:
        pass
    if document is None:
        child = forked_document(parent_doc.to_dict(include_status=False), name, fragment, sets,
                                fragment_source, fragment_lines)
    else:
        child = document
    problems = carry_over_problems(parent_doc.spec, child.spec, checkpoint.step)
    if problems:
        listed = "\n  ".join(problems)
        raise CannotCarryOver(f"cannot fork {source}:step-{checkpoint.step} into {name!r}: the checkpoint cannot "
                              f"carry over\n  {listed}")
    dest = paths.checkpoints_dir(name) / f"step-{checkpoint.step}"
    if dest.exists():
        raise RunExists(f"{dest} already exists (left by an earlier run named {name!r}); remove it or pick "
                        "another name")
    linked = _copy_checkpoint(owned_folder(store, source, checkpoint, parent.spec.get("checkpoint", {}).get("uri"),
                                           "forking"), dest, name)
    recorded = _upload_for_nodes(child, dest, checkpoint.step)
    meta = child.metadata
    carry_snapshot(meta.annotations, source, name)  # the workers import the parent's code from their own folder
    try:
        row = store.fork_run(name, child.spec_dict(), meta.labels, meta.annotations, source, checkpoint.step,
                             recorded, checkpoint.weight_version, provenance=checkpoint.provenance)
    except Conflict:
        shutil.rmtree(dest, ignore_errors=True)
        raise RunExists(f"trainingrun {name!r} already exists; pick another name for the fork") from None
    how = "hard-linked" if linked else "copied"
    store.add_event(name, "Normal", "Forked", f"forked from {source} at step {checkpoint.step} (checkpoint {how} "
                                              f"to {recorded}); the first step trained is {checkpoint.step + 1}")
    store.add_event(source, "Normal", "ForkCreated", f"trainingrun {name} forked from step {checkpoint.step}")
    wake_controller(name)
    return Forked(row.document(), source, checkpoint.step, dest, linked)


def _upload_for_nodes(child: TrainingRun, dest: Path, step: int) -> str:
    """What NEW's checkpoint row records: the copy here, or, for a Ray run whose nodes do not see this
    machine's MORTAL_HOME (ray.sharedFilesystem false), that copy uploaded to NEW's spec.checkpoint.uri
    (mortal.workers.storage: the marker last, before the row), where its relaunched actor looks."""
    spec = child.spec
    if spec.backend != "ray" or spec.ray.shared_filesystem:
        return str(dest)
    from mortal.workers.actor.storage import CheckpointStorage, StorageError

    try:
        return CheckpointStorage(spec.checkpoint.uri, child.metadata.name).upload(dest, step)
    except StorageError as exc:
        shutil.rmtree(dest, ignore_errors=True)
        raise ForkError(f"cannot upload the fork's checkpoint: {exc}") from exc


def _copy_checkpoint(source: Path, dest: Path, run: str) -> bool:
    """Hard-link (else copy) every file into a hidden sibling, then rename it to `dest`; the marker is
    written anew (not linked) with NEW's name. True when every file was linked."""
    from mortal.workers.actor.checkpoint import MORTAL_FILE

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-fork-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    copied: list[str] = []

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
            copied.append(src)

    try:
        shutil.copytree(source, tmp, copy_function=link_or_copy)
        if (source / MORTAL_FILE).is_file():  # the actor's marker (a simulated workload writes none)
            marker = json.loads((source / MORTAL_FILE).read_text())
            (tmp / MORTAL_FILE).unlink()
            (tmp / MORTAL_FILE).write_text(json.dumps({**marker, "run": run}, indent=1) + "\n")
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return not copied


# -- rollback ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolledBack:
    run: str
    step: int
    later: list[int]
    kept_in: Path | None  # where the later checkpoints went (None: dropped, or there were none)
    resumed: bool


def rollback_run(store: Store, run: str, step: int, drop_later: bool = False, *, stop_timeout: float = 120.0,
                 on_suspend: Callable[[], None] = lambda: None, poll_seconds: float = 0.5) -> RolledBack:
    """Roll `run` back to its checkpoint of `step` (the module's docstring says how); `on_suspend` runs once
    the run was suspended by this call (the CLI makes sure a controller runs there, to stop the workers)."""
    from mortal.state import NotFound, paths

    row = store.get_run(run)
    if row.deleted_at is not None:
        raise RollbackRefused(f"trainingrun {run!r} is being deleted")
    if row.phase in TERMINAL_PHASES:
        raise RollbackRefused(f"trainingrun {run!r} is {row.phase}; a finished run cannot be rolled back: fork it "
                              f"instead (mortalctl fork {run}:step-{step} NEW)")
    _refuse_files_elsewhere(run, row.spec.get("backend", "local"), "rolling back moves", RollbackRefused)
    complete_checkpoint(store, run, step)
    was_suspended = bool(row.spec.get("suspend"))
    if not was_suspended:
        _set_suspend(store, run, True)
        on_suspend()
    _wait_stopped(store, run, stop_timeout, poll_seconds)
    try:
        later = store.rollback_run(run, step)
    except NotFound as exc:
        raise RollbackRefused(f"{exc} any more (pruned while the run stopped?); trainingrun {run!r} stays "
                              "suspended") from None
    kept_in = None
    if later and not drop_later:
        kept_in = paths.run_dir(run) / ROLLED_BACK / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
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
    what = ("no later checkpoints" if not later else
            f"later checkpoints {', '.join(f'step-{s}' for s in steps)} "
            + (f"kept in {kept_in}" if kept_in else "removed"))
    store.add_event(run, "Normal", "RolledBack", f"rolled back to step {step} ({what}); training resumes from "
                                                 f"the checkpoint of step {step}")
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
        if expires is None or (expires if expires.tzinfo else expires.replace(tzinfo=UTC)) <= datetime.now(UTC):
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
            raise RollbackRefused(f"trainingrun {run!r}: workers still running after {timeout:g}s ({names}); it "
                                  "stays suspended, nothing was rolled back (is a controller running?)")
        time.sleep(poll_seconds)


# -- the verbs ---------------------------------------------------------------------------------------
FORK_HELP = """Create run NEW from RUN's checkpoint of step N (default: its newest complete one).

NEW's spec is RUN's with the overrides merged over it: -f FILE is a YAML fragment rooted at the
document (spec: ... and/or metadata: {labels, annotations}; null removes a key), --set PATH=VALUE sets
one key by its dotted camelCase path. NEW resumes from the checkpoint as a preempted run would:
weights, optimizer, scheduler, RNG and data position; its first step is N+1, and its learning rate
is NEW's spec's. The model, LoRA on/off, rank, alpha and target modules, and the backend cannot change
(the checkpoint's weights would not fit). `describe run NEW` shows where it came from.

\b
Examples:
  mortalctl fork quickstart:step-20 quickstart-lr --set spec.algorithm.learningRate=1e-6
  mortalctl fork quickstart quickstart-long --set spec.algorithm.maxSteps=60 -f more-rewards.yaml
"""

ROLLBACK_HELP = """Roll RUN back to its checkpoint of step N and train on from there.

A running run is suspended first (its workers stop), then every step after N is forgotten: later
checkpoints, metrics and sampled completions. The later checkpoints' folders are kept under
$MORTAL_HOME/runs/RUN/rolled-back/ (removed with --drop-later) and are no longer the run's, so the
resume starts from N. The run resumes if it was running; a suspended one stays suspended.
A finished run cannot be rolled back: fork it instead.

\b
Examples:
  mortalctl rollback quickstart --to step-20
  mortalctl rollback quickstart --to step-20 --drop-later
"""


def fork_command(
    ctx: typer.Context,
    source: str = typer.Argument(..., metavar="RUN[:step-N]", help="The run, and optionally the checkpoint's step."),
    name: str = typer.Argument(..., metavar="NEW", help="The new run's name."),
    filename: Path | None = typer.Option(None, "-f", "--filename", metavar="FILE",
                                         help="YAML overrides rooted at the document (spec: ..., metadata: ...)."),
    sets: list[str] = typer.Option(None, "--set", metavar="PATH=VALUE",
                                   help="Override one key, e.g. spec.algorithm.learningRate=1e-6 (repeatable)."),
    no_controller: bool = typer.Option(False, "--no-controller", help="Do not start a background controller."),
) -> None:
    from mortal.specs import is_dns1123_label

    cli = state(ctx)
    run, step = parse_source(source)
    if not is_dns1123_label(name):
        raise CliError(f"{name!r}: NEW must be a DNS-1123 label (lowercase letters, digits and '-')")
    fragment, lines = _read_fragment(filename) if filename is not None else (None, None)
    forked = fork_run(cli.store, run, step, name, fragment=fragment, fragment_source=str(filename or "<overrides>"),
                      fragment_lines=lines, sets=list(sets or []))
    typer.echo(plain(f"trainingrun/{name} created, forked from {run} at step {forked.step} (first step {forked.step + 1})"))
    ensure_controller(cli, no_controller)


def _read_fragment(path: Path) -> tuple[dict[str, Any] | None, dict[tuple, int]]:
    from mortal.specs import SpecError, SpecIssue
    from mortal.specs.fork import load_fragment

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([SpecIssue(str(path), None, "", f"cannot read: {exc}")]) from None
    return load_fragment(text, str(path))


def rollback_command(
    ctx: typer.Context,
    run: str = typer.Argument(..., metavar="RUN", help="The run to roll back."),
    to: str = typer.Option(..., "--to", metavar="step-N", help="The checkpoint to go back to, e.g. step-20."),
    drop_later: bool = typer.Option(False, "--drop-later", help="Remove the later checkpoints instead of keeping them."),
    timeout: float = typer.Option(120.0, "--timeout", metavar="SECONDS", help="How long to wait for workers to stop."),
    no_controller: bool = typer.Option(False, "--no-controller", help="Do not start a background controller."),
) -> None:
    match = re.fullmatch(r"(?:step-)?(\d+)", to.strip())
    if match is None:
        raise typer.BadParameter(f"{to!r} is not step-N (e.g. step-20)", param_hint="'--to'")
    cli = state(ctx)
    done = rollback_run(cli.store, run, int(match.group(1)), drop_later, stop_timeout=timeout,
                        on_suspend=lambda: ensure_controller(cli, no_controller))
    later = ", ".join(f"step-{s}" for s in done.later) or "none"
    where = f" (kept in {done.kept_in})" if done.kept_in else (" (removed)" if done.later else "")
    then = "resumed" if done.resumed else "still suspended (mortalctl resume run to continue)"
    typer.echo(plain(f"trainingrun/{run} rolled back to step {done.step}; later checkpoints: {later}{where}; {then}"))
    if done.resumed:
        ensure_controller(cli, no_controller)


def register(app: typer.Typer) -> None:
    app.command("fork", help=FORK_HELP, short_help="Start a new run from a run's checkpoint",
                no_args_is_help=True)(fork_command)
    app.command("rollback", help=ROLLBACK_HELP, short_help="Roll a run back to an earlier checkpoint",
                no_args_is_help=True)(rollback_command)
