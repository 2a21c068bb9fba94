"""`mortalctl sandbox run FILE.py`: run a Python file in the reward sandbox and print how it ended, as JSON.

What the code-execution reward does to each completion, on demand: the file runs as `main.py` in a fresh
working directory, with a spec's sandbox limits (--timeout, --memory-mb) and the confinement rewards get
on this machine, so a user sees what a reward's code meets and an operator sees which confinement works
here. Nothing is written to the store.
What it must not do: run the file unconfined, or hide how it ended (exit 1 unless it succeeded).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mortal.client.cli.context import CliError
from mortal.client.cli.output import to_json

if TYPE_CHECKING:
    from mortal.specs import SandboxSpec
    from mortal.workers.rewards.confinement import Mode
    from mortal.workers.rewards.sandbox import ExecutionResult

HELP = "Run code in the reward sandbox of this machine."
RUN_HELP = """Run FILE.py in the reward sandbox and print the result as JSON.

The file runs as the code-execution reward runs a completion: as main.py in a private working
directory, with no network, the worker's environment left out, and the time and memory limits of a
spec's `sandbox:` block. The JSON says whether it succeeded, its exit code (or the signal that ended
it), what it printed (each stream cut at 64 KiB), whether it timed out, and which confinement ran it
(and bwrap binary), and what that confines. Exit code 0 when the file succeeded, 1 when it failed, timed out
or could not run.

\b
Examples:
  mortalctl sandbox run solution.py
  mortalctl sandbox run loop.py --timeout 2 --memory-mb 256
  mortalctl sandbox run probe.py --confinement unshare
"""
CONFINEMENTS = ("auto", "bubblewrap", "unshare")

sandbox_app = typer.Typer(help=HELP, no_args_is_help=True)


def read_code(path: Path) -> str:
    """The file's text; a CliError naming the file when it is missing, a folder or not UTF-8."""
    if not path.exists():
        raise CliError(f"{path}: no such file")
    if not path.is_file():
        raise CliError(f"{path}: not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CliError(f"{path}: not UTF-8 text (byte {exc.start}); a Python source file is needed") from None
    except OSError as exc:
        raise CliError(f"{path}: cannot read it ({exc.strerror})") from None


def limits(timeout: float | None, memory_mb: int | None) -> SandboxSpec:
    """--timeout and --memory-mb checked as the spec's sandbox block is (SandboxSpec), errors naming the
    flag."""
    from pydantic import ValidationError

    from mortal.specs import SandboxSpec

    given = {"timeoutSeconds": timeout, "memoryMB": memory_mb}
    flags = {"timeoutSeconds": "--timeout", "memoryMB": "--memory-mb"}
    if timeout is not None and not math.isfinite(timeout):
        raise CliError(f"--timeout {timeout}: must be a finite number of seconds")
    try:
        return SandboxSpec.model_validate({k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        key = str(first["loc"][0])
        raise CliError(f"{flags[key]} {given[key]}: {first['msg'].lower()}") from None


def result_document(path: Path, result: ExecutionResult, spec: SandboxSpec, mode: Mode) -> dict[str, Any]:
    return {
        "file": str(path),
        "success": result.success,
        "exitCode": result.exit_code,
        "signal": result.signal,
        "timedOut": result.timed_out,
        "durationSeconds": round(result.duration_seconds, 3),
        "stdout": result.stdout,
        "stderr": result.stderr,
        "stdoutTruncated": result.stdout_truncated,
        "stderrTruncated": result.stderr_truncated,
        "confinement": result.confinement,
        "confines": mode.confines,
        "bwrap": mode.binary or None,
        "limits": {"timeoutSeconds": spec.timeout_seconds, "memoryMB": spec.memory_mb},
        "error": result.error,
    }


@sandbox_app.command("run", help=RUN_HELP, no_args_is_help=True)
def run_command(
    file: Path = typer.Argument(..., metavar="FILE.py", help="The Python file to run."),
    timeout: float | None = typer.Option(
        None, "--timeout", metavar="S", help="Wall-clock limit in seconds [default: 10]."
    ),
    memory_mb: int | None = typer.Option(
        None, "--memory-mb", metavar="M", help="Address-space limit in MiB [default: 512]."
    ),
    confinement: str = typer.Option(
        "auto",
        "--confinement",
        metavar="MODE",
        help="auto (bubblewrap, else unshare), bubblewrap or unshare.",
    ),
) -> None:
    from mortal.workers.rewards.sandbox import LocalExecutor, SandboxConfig, SandboxUnavailable

    if confinement not in CONFINEMENTS:
        raise CliError(f"--confinement {confinement}: choose {', '.join(CONFINEMENTS)}")
    code = read_code(file)
    spec = limits(timeout, memory_mb)
    executor = LocalExecutor(SandboxConfig.from_spec(spec, confinement=confinement))
    try:
        result = executor.run(code)
    except SandboxUnavailable as exc:
        raise CliError(exc.message) from None
    typer.echo(to_json(result_document(file, result, spec, executor.mode)), nl=False)
    if not result.success:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(
        sandbox_app, name="sandbox", help=HELP, short_help="Run code in the reward sandbox of this machine"
    )
