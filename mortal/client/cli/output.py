"""How mortalctl prints: rich tables (plain when stdout is not a terminal), YAML/JSON documents, ages.

Called by the verb modules (get, describe, apply, ...). It formats values it is given and never
reads the store. YAML and JSON output is the document form `apply -f -` reads back, so what `get -o
yaml` prints can be edited and applied again, like kubectl's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from ruamel.yaml import YAML

from mortal.client.cli.text import JSON_ESCAPES, cell, plain
from mortal.specs.dump import holds_bidi

OUTPUT_FORMATS = ("wide", "yaml", "json", "name")
UNBOUNDED_WIDTH = 100_000  # what a table is measured in when it is not printed to a terminal


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr) that writes plain text, without colors, when not a terminal.

    Built per call so typer's CliRunner (which swaps sys.stdout) captures what we print.
    """
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    width = None if tty else int(os.environ.get("COLUMNS", "200"))
    return Console(
        file=stream,
        no_color=not tty or "NO_COLOR" in os.environ,
        highlight=False,
        soft_wrap=not tty,
        width=width,
        emoji=False,
        force_terminal=tty,
    )


@contextlib.contextmanager
def user_output_to_stderr() -> Iterator[None]:
    """While the user's code runs in this process (a run's tools, environments, rewards), what it prints goes
    to stderr, its child processes' and C code's too (file descriptor 1 points at 2): stdout keeps only
    mortalctl's own output, so `-o json` stays one document."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def age(since: datetime | None, now: datetime | None = None) -> str:
    """kubectl's short age: 5s, 3m, 2h, 4d, 2y ('<unknown>' without a time)."""
    if since is None:
        return "<unknown>"
    now = now or datetime.now(UTC)
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    seconds = int((now - since).total_seconds())
    if seconds < 0:
        return "0s"
    for unit, size in (("y", 365 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """A kubectl-like table: no borders, header row, columns padded by two spaces; every cell shown as plain
    text (mortal/client/cli/text.py), whatever control characters or markup it holds."""
    out = Table(box=None, pad_edge=False, padding=(0, 3, 0, 0), show_edge=False, header_style="bold")
    for header in headers:
        out.add_column(cell(header), no_wrap=True, overflow="ignore")
    for row in rows:
        out.add_row(*(cell(value) for value in row))
    return out


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], empty: str) -> None:
    """Print a table, or kubectl's 'No resources found' line (on stderr) when there are no rows."""
    if not rows:
        say(empty, stderr=True)
        return
    print_renderable(table(headers, rows))


def say(message: str, stderr: bool = False) -> None:
    """Print a line that may hold text mortalctl did not write: control characters shown, markup not read."""
    console(stderr).print(plain(message, multiline=True), markup=False)


def print_renderable(renderable: Any, indent: int = 0) -> None:
    """Print a rich renderable with trailing spaces stripped from every line (as kubectl's tables).
    Not to a terminal (a pipe, a file, a test's runner), a table is printed at its full width whatever
    COLUMNS says, as kubectl does: rich would otherwise narrow a column to fit, cutting a reason or a
    name in half where a long event message (a path, say) shares its row."""
    out = console()
    if not out.is_terminal:
        unbounded = out.options.update_width(UNBOUNDED_WIDTH)
        out.width = max(out.width, Measurement.get(out, unbounded, renderable).maximum)
    with out.capture() as captured:
        out.print(renderable)
    pad = " " * indent
    out.file.write("".join(pad + line.rstrip() + "\n" for line in captured.get().splitlines()))
    out.file.flush()


def to_yaml(doc: Any) -> str:
    """Block-style YAML with keys in the order given (what `get -o yaml` prints). The emitter escapes control
    characters but counts bidirectional marks printable: a document holding one is written with every
    non-ASCII character escaped (the same data, read back alike), so that none reorders the terminal."""
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False
    yaml.allow_unicode = not holds_bidi(doc)
    buf = io.StringIO()
    yaml.dump(doc, buf)
    return buf.getvalue()


def to_json(doc: Any) -> str:
    """Indented JSON, as `kubectl get -o json`; no raw control character (C1 ones escaped too), same data."""
    return json.dumps(doc, indent=2, ensure_ascii=False).translate(JSON_ESCAPES) + "\n"


def fmt_float(value: float | None, digits: int = 3) -> str:
    """A reward-like number, or '-' when unknown."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}"
