"""`mortalctl logs | controller | schema | version`: the verbs that are not about desired state.

`logs` reads worker log files through mortal.controller.logs, from this machine or, for a run on
Modal, from the app's data volume (and, with -f, stops when the run finishes); `controller` runs
mortal.controller.manager.run_controller in the foreground; `schema` prints the TrainingRun JSON
Schema; `version` the package version. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from mortal.client.cli.context import TERMINAL_PHASES, CliError, state
from mortal.client.cli.text import log_to_terminal, plain

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
`controller status` says whether one runs for this MORTAL_HOME; `controller stop` stops it.

\b
Examples:
  mortalctl controller
\b
  # GitOps: make the *.yaml files of a folder the desired state
  mortalctl controller --watch runs/
\b
  # The background controller: is one running, and stop it
  mortalctl controller status
  mortalctl controller stop
"""

CONTROLLER_STATUS_HELP = """\
Say whether a controller runs for this MORTAL_HOME: its pid, since when, the folder
it was started in and its log; and which controller holds the store's leader lease (it may be on another
machine).
"""

CONTROLLER_STOP_HELP = """Stop the controller of this MORTAL_HOME (the background one apply started, or one
in the foreground).

It is sent SIGTERM and given --timeout seconds to finish its reconcile passes and give up the leader
lease, then killed (SIGKILL). Running workers are NOT stopped: they keep training, and the next
controller (the next apply starts one) adopts them. To stop a run's workers, `mortalctl suspend run
NAME` or `mortalctl delete run NAME` first.
"""


def _replicas(spec: dict, role: str) -> int | None:
    """How many workers of `role` the spec asks for (the actor's ranks: actor.count), None if it does not
    say."""
    block, key = ("actor", "count") if role == "actor" else ("rollout", "replicas")
    value = (spec.get(block) or {}).get(key)
    return value if isinstance(value, int) else None


def _stop_when_finished(
    store, name: str, stop: threading.Event, every: float = 2.0, linger: float = 2.0
) -> None:
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
    role: str | None = typer.Option(
        None, "--role", metavar="ROLE", help="actor or rollout; all roles when omitted."
    ),
    replica: int | None = typer.Option(
        None, "--replica", min=0, metavar="I", help="Only this replica of the role."
    ),
    follow: bool = typer.Option(
        False, "-f", "--follow", help="Keep printing new lines until the run finishes."
    ),
    tail: int | None = typer.Option(
        None, "--tail", min=0, metavar="N", help="Only the last N lines of each log."
    ),
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
        replicas = _replicas(spec, role or "rollout")
        if replica is not None and replicas is not None and replica >= replicas:
            raise CliError(
                f"trainingrun/{name} has no {role or 'rollout'} replica {replica}: its replicas are "
                f"0..{replicas - 1}"
            )
        if not follow:
            raise CliError(
                f"no logs of trainingrun/{name}{' ' + which if which else ''} yet; is a controller running?"
            )
    stop = threading.Event()
    if follow:
        # on Modal, long enough for the worker function's last commit
        linger = 2 * VOLUME_POLL_SECONDS + 2.0 if on_modal else 2.0
        threading.Thread(
            target=_stop_when_finished, args=(store, name, stop), kwargs={"linger": linger}, daemon=True
        ).start()
    lines = read_logs(
        name,
        role,
        replica,
        follow=follow,
        tail=tail,
        stop=stop,
        source=source,
        poll_seconds=VOLUME_POLL_SECONDS if on_modal or in_storage else 0.5,
    )
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
            raise CliError(
                f"the run's logs are in spec.checkpoint.uri {storage!r}, which cannot be read from "
                f"here: {exc}"
            ) from exc
    if not on_modal:
        return LocalLogs(), ()
    try:
        modal = load_modal()
    except BackendError as exc:
        raise CliError(
            f"the run's logs are on its Modal volume, which cannot be read from here: {exc}"
        ) from exc
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
        None,
        "--watch",
        metavar="DIR",
        help="Apply the TrainingRun files of DIR whenever they change (GitOps).",
    ),
    idle_exit: float | None = typer.Option(
        None,
        "--idle-exit",
        metavar="SECONDS",
        help="Exit after this long with no active run and no live worker.",
    ),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Log every reconcile step (debug level)."),
) -> None:
    from mortal.controller.manager import run_controller

    if ctx.invoked_subcommand is not None:
        return
    cli = state(ctx)
    if watch is not None and not watch.is_dir():
        raise CliError(f"--watch {watch}: no such directory")
    log_to_terminal(
        logging.DEBUG if verbose or cli.debug else logging.INFO,
        "%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):  # SIGINT stops the controller; workers keep running
        run_controller(state_url=cli.state_url, watch=watch, idle_exit_seconds=idle_exit)


def controller_status_command(ctx: typer.Context) -> None:
    from mortal.controller.leader import LEASE_NAME
    from mortal.controller.manager import running_controller
    from mortal.state import paths

    running = running_controller()
    if running is None:
        typer.echo(f"controller: not running (MORTAL_HOME {paths.mortal_home()})")
    else:
        since = running.since.astimezone().isoformat(timespec="seconds")
        typer.echo(f"controller: running (pid {running.pid}, since {since})")
        typer.echo(f"home: {running.home}")
        typer.echo(f"started in: {plain(running.folder or '(unknown)')}")  # a folder name may hold ESC
        typer.echo(f"log: {running.log} (a foreground controller logs to its terminal)")
    try:
        lease = state(ctx).store.get_lease(LEASE_NAME)
    except Exception as exc:  # noqa: BLE001 - the process facts above stand; the store's part is unknown
        first = (str(exc).strip().splitlines() or [""])[0]
        typer.echo(
            f"leader lease: unknown (the state store cannot be read: {type(exc).__name__}: {plain(first)})"
        )
        return
    if lease is not None:
        expires = lease.expires_at if lease.expires_at.tzinfo else lease.expires_at.replace(tzinfo=UTC)
        if expires > datetime.now(UTC):
            until = expires.isoformat(timespec="seconds")
            # the holder is store text: shown as text
            typer.echo(f"leader lease: held by {plain(lease.holder)} (until {until})")
        else:
            typer.echo(f"leader lease: free (last held by {plain(lease.holder)})")


def controller_stop_command(
    ctx: typer.Context,
    timeout: float = typer.Option(
        30.0, "--timeout", min=0, metavar="SECONDS", help="How long to wait after SIGTERM before SIGKILL."
    ),
) -> None:
    from mortal.controller.manager import stop_controller
    from mortal.state import paths

    stopped = stop_controller(timeout)
    if stopped is None:
        typer.echo(f"no controller running (MORTAL_HOME {paths.mortal_home()})")
        return
    pid, killed = stopped
    if killed:
        typer.echo(
            f"controller (pid {pid}) killed after {timeout:g}s; its leader lease expires by itself "
            "shortly; workers keep running"
        )
    else:
        typer.echo(f"controller (pid {pid}) stopped; workers keep running (the next controller adopts them)")


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
    app.command("logs", help=LOGS_HELP, short_help="Print the logs of a run's workers", no_args_is_help=True)(
        logs_command
    )
    group = typer.Typer(
        help=CONTROLLER_HELP,
        short_help="Run the controller in the foreground; status, stop",
        rich_markup_mode=None,
    )
    group.callback(invoke_without_command=True)(controller_command)
    group.command(
        "status", help=CONTROLLER_STATUS_HELP, short_help="Is a controller running, where, since when"
    )(controller_status_command)
    group.command("stop", help=CONTROLLER_STOP_HELP, short_help="Stop the controller (workers keep running)")(
        controller_stop_command
    )
    app.add_typer(group, name="controller")
    app.command("schema", short_help="Print the TrainingRun JSON Schema")(schema_command)
    app.command("version", short_help="Print the version")(version_command)
