"""Where mortal keeps files: $MORTAL_HOME (default ~/.mortal) and the per-run folders on the volume.

Used by the store (default SQLite path), the backends (log files) and workers (weights,
checkpoints). Pure path arithmetic: nothing here creates a file.

    $MORTAL_HOME/state.db                         SQLite store (unless MORTAL_STATE_URL)
    $MORTAL_HOME/controller.log                   a background controller's output
    $MORTAL_HOME/runs/<run>/logs/<role>-<replica>-<incarnation>.log
    $MORTAL_HOME/runs/<run>/weights/v<version>/   published weights (sync: volume)
    $MORTAL_HOME/runs/<run>/checkpoints/step-<step>/
    $MORTAL_HOME/runs/<run>/code/<sha256>/         the user code a run was applied with
                                                   (controller/snapshot.py)
    $MORTAL_HOME/deleted/<run>-<uid>/             a deleted run's folder, kept (delete without --purge)
    $MORTAL_HOME/compile-cache/{inductor,triton}/     torch.compile's on-disk caches, shared by runs
                                                      (backends/base.py)
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def mortal_home() -> Path:
    return Path(os.environ.get("MORTAL_HOME") or Path.home() / ".mortal").expanduser()


STATE_URL_ENV = "MORTAL_STATE_URL"


def default_state_url() -> str:
    return os.environ.get(STATE_URL_ENV) or f"sqlite:///{mortal_home() / 'state.db'}"


def shown_url(url: str) -> str:
    """A state URL as it may be printed or logged: a password in it (postgresql://user:pw@host/db,
    https://user:pw@host) replaced by ***. urllib rather than SQLAlchemy's URL: the HTTP store's URLs too."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def runs_dir(home: str | Path | None = None) -> Path:
    """The folder of every run's folder: what a run's folder must lie inside (mortal.state.containment)."""
    return (Path(home) if home is not None else mortal_home()) / "runs"


def run_dir(run: str, home: str | Path | None = None) -> Path:
    """The run's folder under `home` (default: this process's $MORTAL_HOME; a Modal container's differs)."""
    return runs_dir(home) / run


def kept_runs_dir(home: str | Path | None = None) -> Path:
    """The folder of deleted runs' kept folders (what a kept folder must lie inside)."""
    return (Path(home) if home is not None else mortal_home()) / "deleted"


def kept_run_dir(run: str, uid: str, home: str | Path | None = None) -> Path:
    """Where a deleted run's folder is kept (delete without --purge): named by its uid, out of the way of a
    run applied again under the name, which starts from an empty folder and never reads the old run's
    files."""
    return kept_runs_dir(home) / f"{run}-{uid}"


LOGS = "logs"  # a run's folder of worker logs, inside its run_dir


def logs_dir(run: str) -> Path:
    return run_dir(run) / LOGS


def worker_log(run: str, role: str, replica: int, incarnation: int) -> Path:
    return logs_dir(run) / f"{role}-{replica}-{incarnation}.log"


def weights_dir(run: str) -> Path:
    return run_dir(run) / "weights"


def checkpoints_dir(run: str) -> Path:
    return run_dir(run) / "checkpoints"


CODE_SNAPSHOT_ENV = "MORTAL_CODE_SNAPSHOT"  # a worker's variable naming its run's code snapshot (a digest)


def code_dir(run: str, digest: str, home: str | Path | None = None) -> Path:
    """The run's snapshot of the applying user's code whose content hash is `digest`."""
    return run_dir(run, home) / "code" / digest


def compile_cache_dir(home: str | Path | None = None) -> Path:
    """torch.compile's caches, shared by every run's workers under this home: a relaunched worker, and a
    later run of the same model and shapes, loads what an earlier process compiled."""
    return (Path(home) if home is not None else mortal_home()) / "compile-cache"
