"""`mortalctl env serve module:Class ...`: serve environment classes over HTTP, for rollout workers whose spec
says `rollout.environmentService: {mode: http, url: ..., tokenEnv: NAME}`.

    MORTAL_ENV_TOKEN=$(openssl rand -hex 32) mortalctl env serve my_envs:SandboxEnv --host 0.0.0.0 --port 8700

The server (mortal.workers.rollout.environment_server) imports the classes here, once, hosts their instances
in --processes child processes, and answers a worker's sessions until interrupted. Nothing is written to
the store.
What it must not do: start without a token (the variable --token-env names must be set and non-empty), or
take the token as an argument (it would show in the process list).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import typer

from mortal.client.cli.context import CliError
from mortal.client.cli.text import log_to_terminal

HELP = "Serve environment classes to rollout workers over HTTP."
SERVE_HELP = """Serve environment classes (TRL's environment_factory shape) over HTTP.

Rollout workers whose spec sets rollout.environmentService to {mode: http, url: http://HOST:PORT,
tokenEnv: NAME} build their environments here: each instance lives in one of --processes child
processes, a call past the worker's deadline is killed, and a crashed process is replaced with its
sessions' calls replayed. Every request needs the bearer token held by the variable --token-env names
(the workers read it from the variable their tokenEnv names). Stops with Ctrl-C.

\b
Examples:
  MORTAL_ENV_TOKEN=$(openssl rand -hex 32) mortalctl env serve my_envs:SandboxEnv
  mortalctl env serve my_envs:SandboxEnv my_envs:WebEnv --host 0.0.0.0 --port 8700 --processes 32
"""
DEFAULT_PORT = 8700
DEFAULT_TOKEN_ENV = "MORTAL_ENV_TOKEN"

env_app = typer.Typer(help=HELP, no_args_is_help=True)


@env_app.command("serve", help=SERVE_HELP, no_args_is_help=True)
def serve_command(
    references: list[str] = typer.Argument(..., metavar="MODULE:CLASS...", help="The classes to serve."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port to listen on (0: any free one)."),
    token_env: str = typer.Option(
        DEFAULT_TOKEN_ENV, "--token-env", metavar="NAME", help="Variable holding the bearer token."
    ),
    processes: int = typer.Option(
        0,
        "--processes",
        metavar="N",
        show_default=False,
        help="Child processes hosting the instances [default: one per core].",
    ),
    max_sessions: int = typer.Option(4096, "--max-sessions", metavar="N", help="Most sessions held at once."),
    session_idle_seconds: float = typer.Option(
        3600.0, "--session-idle-seconds", metavar="S", help="A session idle this long is dropped."
    ),
    max_body_bytes: int = typer.Option(
        8 * 1024 * 1024, "--max-body-bytes", metavar="B", help="Largest request or answer body."
    ),
) -> None:
    from mortal.specs.rewards import FUNCTION_REF
    from mortal.workers.rollout.environment_server import ServeError, serve

    for ref in references:
        if not FUNCTION_REF.match(ref):
            raise CliError(f"{ref!r}: an environment class is named 'module:Class', e.g. my_envs:SandboxEnv")
    token = os.environ.get(token_env, "")
    if not token:
        raise CliError(
            f"${token_env} is not set: the server needs a bearer token (e.g. `export {token_env}=$(openssl "
            "rand -hex 32)`); give the rollout workers the same value through spec.secrets"
        )
    for flag, value in (("--max-sessions", max_sessions), ("--max-body-bytes", max_body_bytes)):
        if value < 1:
            raise CliError(f"{flag} {value}: must be at least 1")
    if processes < 0 or session_idle_seconds <= 0:
        raise CliError("--processes must be >= 0 and --session-idle-seconds > 0")
    # the classes import from this folder, as `apply` and `test` take a run's modules (a console script does
    # not put it on sys.path); the environment processes inherit sys.path (environment_pool)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    log_to_terminal(logging.INFO, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = serve(
            references,
            host,
            port,
            token,
            processes or os.cpu_count() or 1,
            max_sessions=max_sessions,
            session_idle_seconds=session_idle_seconds,
            max_body_bytes=max_body_bytes,
        )
    except ServeError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    bound_host, bound_port = server.server_address[:2]
    typer.echo(f"serving {', '.join(references)} on http://{bound_host}:{bound_port}", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.service.close()


def register(app: typer.Typer) -> None:
    app.add_typer(env_app, name="env", help=HELP, short_help="Serve environment classes to rollout workers")
