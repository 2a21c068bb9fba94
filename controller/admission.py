"""Admission: what can be checked before a run exists is checked when it is applied; a failure writes nothing.

Who calls it: `mortalctl apply` (and --dry-run, which prints the checks), MortalTrainer.train and the
watched folder (mortal.controller.watchdir). For each run it builds the code snapshot
(mortal.controller.snapshot), then runs the probe (`python -m mortal.workers.probe`) in it, in a child
process: rewards, tools and environments import and have the shapes TRL calls, the model is here
(or in the Hugging Face cache), the dataset file exists. A failed check is a SpecIssue naming the
file and the spec field, raised as AdmissionRefused before anything reaches the store; what only the
remote side can tell (backend modal or ray: the model there, its GPUs) comes back as `deferred` and is
printed, never skipped silently. On success the snapshot is installed in the run's folder and its
digest written into the run's annotations.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mortal.controller.backends.base import inheritable
from mortal.controller.snapshot import CODE_ANNOTATION, Snapshot, SnapshotRefused, build
from mortal.specs import SpecError, SpecIssue
from mortal.specs.diagnostics import line_of, undotted
from mortal.specs.loader import field_lines
from mortal.state import NotFound, paths

if TYPE_CHECKING:
    from mortal.specs import TrainingRun
    from mortal.state import Store

PROBE_MODULE = "mortal.workers.probe"
PROBE_TIMEOUT_ENV = "MORTAL_ADMISSION_TIMEOUT"
DEFAULT_PROBE_TIMEOUT = 120.0
SIMULATED = ("mortal.dev/workload", "simulated")
REMOTE_BACKENDS = ("modal", "ray")


class AdmissionRefused(SpecError):
    """A run failed admission: each issue names the file and spec field; nothing was written."""


@dataclass(frozen=True)
class Check:
    """One admission check: `state` is ok, failed or deferred (made by the backend, later)."""

    field: str
    state: str
    message: str

    def line(self, run: str) -> str:
        return f"trainingrun/{run}: {self.field}: {self.state}: {self.message}"


@dataclass
class Admission:
    """A run that passed: its checks and its snapshot (installed by `admit_runs` unless a dry run)."""

    run: TrainingRun
    source: str
    checks: list[Check] = field(default_factory=list)
    snapshot: Snapshot | None = None
    created: Path | None = None  # the outermost folder `install` made (see withdraw)

    @property
    def deferred(self) -> list[Check]:
        return [c for c in self.checks if c.state == "deferred"]

    def install(self) -> None:
        """Install the snapshot in the run's folder, noting what this made for `withdraw`."""
        if self.snapshot is None or self.snapshot.digest is None:
            return
        final = paths.code_dir(self.run.name, self.snapshot.digest)
        missing = [f for f in (paths.run_dir(self.run.name), final.parent, final) if not f.exists()]
        self.snapshot.install(self.run.name)
        self.created = missing[0] if missing else None

    def withdraw(self, store: Store) -> None:
        """After the store refused the run: remove what `install` made, unless the store holds a run of that
        name (created meanwhile, or one that was there), so a run never created leaves nothing under its
        name (a later run of that name would find another's files)."""
        if self.created is None:
            return
        try:
            store.get_run(self.run.name)
        except NotFound:
            shutil.rmtree(self.created, ignore_errors=True)
        self.created = None


def _probe(run: TrainingRun, folder: Path) -> list[Check]:
    """The probe's checks, run with `folder` (the snapshot) as working folder and first on sys.path."""
    simulated = run.metadata.annotations.get(SIMULATED[0]) == SIMULATED[1]
    request = json.dumps({"spec": run.spec_dict(), "simulated": simulated})
    search = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    # what a worker gets of this environment (a watched folder's probe runs in the controller: no admin token)
    env = {k: v for k, v in os.environ.items() if inheritable(k) or k in run.spec.secrets}
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=search)
    timeout = _probe_timeout()
    try:
        done = subprocess.run(
            [sys.executable, "-m", PROBE_MODULE],
            input=request,
            capture_output=True,
            text=True,
            cwd=folder,
            env=env,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        why = f"checking the run's code took over {timeout:.0f}s ({PROBE_TIMEOUT_ENV})"
        return [Check("spec", "failed", f"{why}; does importing a reward, tool or environment module hang?")]
    lines = done.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except json.JSONDecodeError:
        found = None
    if not isinstance(found, list):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [Check("spec", "failed", f"the admission probe failed (exit {done.returncode}): {tail}")]
    return [Check(str(c["field"]), str(c["state"]), str(c["message"])) for c in found]


def _probe_timeout() -> float:
    raw = os.environ.get(PROBE_TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_PROBE_TIMEOUT
    except ValueError:
        raise AdmissionRefused(
            [SpecIssue("<environment>", None, PROBE_TIMEOUT_ENV, f"{raw!r} is not a number of seconds")]
        ) from None


def _remote_checks(run: TrainingRun) -> list[Check]:
    """What only a remote backend can tell, said out loud."""
    spec = run.spec
    if spec.backend not in REMOTE_BACKENDS:
        return []
    gpus = sorted({spec.actor.gpu, spec.rollout.gpu} - {"none"})
    what = f"GPUs {', '.join(gpus)} are" if gpus else "CPU capacity is"
    return [
        Check(
            "spec.backend",
            "deferred",
            f"{spec.backend}: {what} checked by the backend when it places the workers",
        )
    ]


def prepare(
    run: TrainingRun, folders: Sequence[Path], source: str, keep_from: str | None = None
) -> Admission:
    """Snapshot and check one run; AdmissionRefused on a failed check (its temporary snapshot removed).
    When `folders` hold none of its code, the run keeps the snapshot its annotation names, installed for
    run `keep_from` (its own by default; a fork's parent)."""
    try:
        snapshot = build(run.spec, [Path(f) for f in folders])
    except SnapshotRefused as exc:
        line = line_of(undotted(exc.field), field_lines(source, run.name))
        raise AdmissionRefused([SpecIssue(source, line, exc.field, str(exc))]) from None
    carried = run.metadata.annotations.get(CODE_ANNOTATION)
    owner = keep_from or run.name
    if snapshot.digest is None and carried and (kept := Snapshot.kept(owner, carried)) is not None:
        snapshot.close()
        snapshot = kept  # this folder has none of the run's code: the run keeps the snapshot it has
    checks = _probe(run, snapshot.folder) + _remote_checks(run)
    failed = [c for c in checks if c.state == "failed"]
    if failed:
        snapshot.close()
        lines = field_lines(source, run.name)  # the file read again: the checks name fields, not lines
        raise AdmissionRefused(
            [SpecIssue(source, line_of(undotted(c.field), lines), c.field, c.message) for c in failed]
        )
    if snapshot.digest is not None:
        what = ", ".join(p.rel for p in snapshot.parts) or "kept: this folder has none of the run's code"
        checks.append(
            Check("metadata.annotations", "ok", f"{CODE_ANNOTATION}: {snapshot.digest[:12]} ({what})")
        )
    return Admission(run, source, checks, snapshot)


@contextlib.contextmanager
def admit_runs(
    runs: Sequence[tuple[TrainingRun, str]],
    folders: Sequence[Path],
    dry_run: bool = False,
    keep_from: str | None = None,
) -> Iterator[list[Admission]]:
    """Admit every (run, source file) or none: all refusals raised together; then, unless `dry_run`,
    install each snapshot and set the run's code annotation (dropping one the document carried).
    A caller whose store then refuses a run calls that admission's `withdraw`."""
    admitted: list[Admission] = []
    issues: list[SpecIssue] = []
    try:
        for run, source in runs:
            try:
                admitted.append(prepare(run, folders, source, keep_from))
            except AdmissionRefused as exc:
                issues += exc.issues
        if issues:
            raise AdmissionRefused(issues)
        for admission in admitted:
            annotations = admission.run.metadata.annotations
            annotations.pop(CODE_ANNOTATION, None)
            snapshot = admission.snapshot
            if snapshot is not None and snapshot.digest is not None:
                annotations[CODE_ANNOTATION] = snapshot.digest
                if not dry_run:
                    admission.install()
        yield admitted
    finally:
        for admission in admitted:
            if admission.snapshot is not None:
                admission.snapshot.close()
