"""`mortalctl logs | controller | schema | version`: the verbs that are not about desired state.

`logs` reads worker log files through mortal.controller.logs, from this machine or, for a run on
Modal, from the app's data volume (and, with -f, stops when the run finishes); `controller` runs mortal.controller.manager.run_controller in the foreground; `schema`
prints the TrainingRun JSON Schema; `version` the package version. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from mortal.controller.cli.context import TERMINAL_PHASES, CliError, state
from mortal.controller.cli.text import plain

LOGS_HELP = """Print the logs of a run's workers (the newest incarnation of each).

\b
Examples:
  # Every worker of quickstart, each line prefixed with its slot
  mortalctl logs quickstart
\b
  # Follow the actor's log until the run finishes (or Ctrl-C)
  mortalctl logs quickstart --role actor -f
\b
  # The last 20 lines of rollout replica 1
  mortalctl logs quickstart --role rollout --replica 1 --tail 20

A run on Modal (backend: modal) has its logs on the app's data volume, read with your Modal
token; they lag the workers by up to 10 seconds (how often the workers commit them).
"""

CONTROLLER_HELP = """Run the controller in the foreground (apply starts one in the background when none runs).

The controller reconciles every run in the state store: it starts, scales, relaunches and stops
workers and writes status. Only one controller acts at a time (a leader lease); a second one waits.

\b
Examples:
  mortalctl controller
\b
  # GitOps: make the *.yaml files of a folder the desired state
  mortalctl controller --watch runs/
"""


def _stop_when_finished(store, name: str, stop: threading.Event, every: float = 2.0, linger: float = 2.0) -> None:
    """Set `stop` once the run is Succeeded/Failed or gone, so `logs -f` ends like kubectl's."""
    from mortal.state import NotFound

    while not stop.wait(every):
        try:
            if store.get_run(name).phase in TERMINAL_PHASES:
                stop.wait(linger)  # let the workers' last lines reach the files (on Modal: the volume)
                stop.set()
        except NotFound:
            stop.set()


def logs_command(
    ctx: typer.Context,
    name: str = typer.Argument(..., metavar="NAME", help="The run."),
    role: str | None = typer.Option(None, "--role", metavar="ROLE", help="actor or rollout; all roles when omitted."),
    replica: int | None = typer.Option(None, "--replica", min=0, metavar="I", help="Only this replica of the role."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines until the run finishes."),
    tail: int | None = typer.Option(None, "--tail", min=0, metavar="N", help="Only the last N lines of each log."),
) -> None:
    from mortal.controller.logs import VOLUME_POLL_SECONDS, read_logs, worker_logs
    from mortal.state import NotFound

    if role is not None and role not in ("actor", "rollout"):
        raise typer.BadParameter(f"{role!r} is not a role; use actor or rollout", param_hint="'--role'")
    store = state(ctx).store
    try:
        spec = store.get_run(name).spec
    except NotFound as exc:
        spec, missing = {}, exc  # a deleted run's local logs (kept unless --purge) still print
    backend = spec.get("backend", "local") if spec else None
    on_modal = backend == "modal"
    in_storage = backend == "ray" and (spec.get("ray") or {}).get("sharedFilesystem") is False
    source, errors = _log_source(on_modal, spec.get("checkpoint", {}).get("uri") if in_storage else None)
    if not _guarded(lambda: worker_logs(name, role, replica, source=source), errors):
        if backend is None:
            raise missing
        which = " ".join(filter(None, [role, None if replica is None else f"replica {replica}"]))
        if not follow:
            raise CliError(f"no logs of trainingrun/{name}{' ' + which if which else ''} yet; is a controller running?")
    stop = threading.Event()
    if follow:
        linger = 2 * VOLUME_POLL_SECONDS + 2.0 if on_modal else 2.0  # Modal: the worker function's last commit
        threading.Thread(target=_stop_when_finished, args=(store, name, stop), kwargs={"linger": linger},
                         daemon=True).start()
    lines = read_logs(name, role, replica, follow=follow, tail=tail, stop=stop, source=source,
                      poll_seconds=VOLUME_POLL_SECONDS if on_modal or in_storage else 0.5)
    try:
        while (line := _guarded(lambda: next(lines, None), errors)) is not None:
            typer.echo(plain(line, multiline=True))
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()


def _log_source(on_modal: bool, storage: str | None = None) -> tuple[Any, tuple[type[Exception], ...]]:
    """Where the run's logs are (this machine's files; for a run on Modal the app's data volume, read
    through the client library; for a Ray run whose nodes share no filesystem, `storage`, its
    spec.checkpoint.uri), and the errors that mean they could not be asked."""
    from mortal.controller.backends import BackendError
    from mortal.controller.backends.modal import data_volume, load_modal
    from mortal.controller.logs import LocalLogs, StorageLogs, VolumeLogs

    if storage is not None:
        try:
            return StorageLogs(storage), (OSError,)
        except (ImportError, ValueError) as exc:
            raise CliError(f"the run's logs are in spec.checkpoint.uri {storage!r}, which cannot be read from "
                           f"here: {exc}") from exc
    if not on_modal:
        return LocalLogs(), ()
    try:
        modal = load_modal()
    except BackendError as exc:
        raise CliError(f"the run's logs are on its Modal volume, which cannot be read from here: {exc}") from exc
    errors = (modal.exception.Error,)
    volume = _guarded(lambda: data_volume(modal), errors)
    return VolumeLogs(volume, missing=(FileNotFoundError, modal.exception.NotFoundError)), errors


def _guarded(read: Callable[[], Any], errors: tuple[type[Exception], ...]) -> Any:
    """`read()`, with a failure of the Modal client (unreachable, no such volume) as a CliError."""
    try:
        return read()
    except errors as exc:
        raise CliError(f"could not read the logs from the Modal volume: {exc}") from exc


def controller_command(
    ctx: typer.Context,
    watch: Path | None = typer.Option(
        None, "--watch", metavar="DIR", help="Apply the TrainingRun files of DIR whenever they change (GitOps)."
    ),
    idle_exit: float | None = typer.Option(
        None, "--idle-exit", metavar="SECONDS", help="Exit after this long with no active run and no live worker."
    ),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Log every reconcile step (debug level)."),
) -> None:
    from mortal.controller.manager import run_controller

    cli = state(ctx)
    if watch is not None and not watch.is_dir():
        raise CliError(f"--watch {watch}: no such directory")
    logging.basicConfig(level=logging.DEBUG if verbose or cli.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):  # SIGINT stops the controller; workers keep running
        run_controller(state_url=cli.state_url, watch=watch, idle_exit_seconds=idle_exit)


def schema_command() -> None:
    """Print the JSON Schema of a TrainingRun (for editors: yaml-language-server $schema)."""
    from mortal.specs import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mortal")
    except PackageNotFoundError:
        return "unknown"


def version_command() -> None:
    """Print the version of mortal and the API version it reads."""
    typer.echo(f"mortalctl {package_version()} (API mortal/v1, Python {platform.python_version()})")


def register(app: typer.Typer) -> None:
    app.command("logs", help=LOGS_HELP, short_help="Print the logs of a run's workers", no_args_is_help=True)(logs_command)
    app.command("controller", help=CONTROLLER_HELP, short_help="Run the controller in the foreground")(controller_command)
    app.command("schema", short_help="Print the TrainingRun JSON Schema")(schema_command)
    app.command("version", short_help="Print the version")(version_command)
