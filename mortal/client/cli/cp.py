"""`mortalctl cp RUN[:step-N] DIR`: copy a run's checkpoint out, from this machine or Modal's volume.

Like `kubectl cp`, the source names something the cluster keeps, the destination a local folder. A
thin verb: the copy is mortal.client.checkpoint_copy's.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mortal.client.checkpoint_copy import copy_checkpoint
from mortal.client.cli.context import state
from mortal.client.cli.text import plain
from mortal.client.fork import parse_source

HELP = """Copy a run's checkpoint to a local folder (the newest, or the one of step N).

The folder holds what transformers (or peft, for LoRA runs) loads: `AutoModelForCausalLM.
from_pretrained(DIR)`. For runs on Modal the checkpoint is read from the run's Modal volume.

\b
Examples:
  mortalctl cp quickstart ./quickstart-final
  mortalctl cp quickstart:step-20 ./quickstart-step-20
"""


def cp_command(
    ctx: typer.Context,
    source: str = typer.Argument(
        ..., metavar="RUN[:step-N]", help="The run, and optionally the checkpoint's step."
    ),
    dest: Path = typer.Argument(..., metavar="DIR", help="A new (or empty) local folder."),
) -> None:
    if str(dest) == "-":  # docker cp's stdout; a checkpoint is a folder of files, not one stream
        raise typer.BadParameter(
            "'-' (stdout) is not a folder: give the folder to copy into", param_hint="DIR"
        )
    run, step = parse_source(source)
    copied = copy_checkpoint(state(ctx).store, run, step, dest)
    typer.echo(
        plain(
            f"trainingrun/{run} checkpoint step-{copied.step} (weights v{copied.weight_version}) "
            f"copied to {copied.dest}"
        )
    )


def register(app: typer.Typer) -> None:
    app.command(
        "cp", help=HELP, short_help="Copy a run's checkpoint to a local folder", no_args_is_help=True
    )(cp_command)
