"""Text mortalctl did not write (store, user, model, worker) made safe to print on a terminal.

Who calls it: every verb, through mortal/client/cli/output.py (`table` cells, `say`) or directly, before such
text reaches stdout or stderr. An event message, a label, a completion or a log line may carry ESC
sequences (clear the screen, recolour, an OSC 8 link hiding its target) or rich markup (`[bold red]`):
both are shown as the characters they are, never obeyed. Control characters are shown as kubectl and
`cat -v` show them (ESC as `^[`), so what was there stays visible. -o json/yaml output is data and does
not come here (JSON escapes control characters itself; YAML quotes them).
"""

from __future__ import annotations

import logging
from typing import Any

from rich.text import Text

from mortal.specs.dump import BIDI_MARKS

_BIDI = tuple(sorted(BIDI_MARKS))  # reorder what follows them on screen


def _shown(code: int) -> str:
    """How one control character is printed: caret form for C0 and DEL, a \\x or \\u escape for the rest."""
    if code < 0x20:
        return "^" + chr(code + 0x40)
    if code == 0x7F:
        return "^?"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


_MULTILINE = {code: _shown(code) for code in (*range(0x20), 0x7F, *range(0x80, 0xA0), *_BIDI)}
_MULTILINE |= {ord("\n"): "\n", ord("\t"): "\t", ord("\r"): "\\r"}
_ONE_LINE = _MULTILINE | {ord("\n"): "\\n", ord("\t"): "\\t"}


JSON_ESCAPES = {code: f"\\u{code:04x}" for code in (0x7F, *range(0x80, 0xA0), *_BIDI)}
"""What json.dumps(ensure_ascii=False) leaves raw but a terminal may obey: written as \\u escapes, the same
data."""


def plain(value: Any, multiline: bool = False) -> str:
    """`value` as printable text: no control character left but (with `multiline`) newline and tab.

    Print it with markup off (`say`, `markup=False`, or as a rich `Text`): brackets stay brackets."""
    return ("" if value is None else str(value)).translate(_MULTILINE if multiline else _ONE_LINE)


class PlainFormatter(logging.Formatter):
    """Log records on a terminal (a foreground `mortalctl controller`, `env serve`) as `plain` text: a
    record may quote a file name or a user's error, and a name can hold ESC."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record), multiline=True)


def log_to_terminal(level: int, fmt: str) -> None:
    """logging.basicConfig for a command that logs to the terminal, through PlainFormatter."""
    handler = logging.StreamHandler()
    handler.setFormatter(PlainFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler])


def cell(value: Any) -> Text:
    """A table cell or header: one line of text that rich shows as is (a `Text` is never read as markup)."""
    return Text(plain(value))
