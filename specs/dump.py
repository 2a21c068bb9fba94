"""Writes TrainingRuns as YAML or JSON, for `mortalctl get -o yaml|json` and `mortalctl schema`-style output.

The output is meant to be applied again (`mortalctl get run x -o yaml | mortalctl apply -f -`):
`TrainingRun.to_dict` leaves out only nulls (all of which are defaults), status is kept and the
loader accepts it (apply ignores it). Several runs are '---'-separated YAML documents, or one
JSON `TrainingRunList` (kubectl's List convention), both of which the loader reads back.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from typing import Any, Literal

from ruamel.yaml import YAML

from mortal.specs.run import API_VERSION, TrainingRun


def to_yaml(run: TrainingRun, include_status: bool = True) -> str:
    """One run as a YAML document (camelCase keys, kubectl-style indentation)."""
    return dump_yaml([run.to_dict(include_status)])


def dump_runs(
    runs: Iterable[TrainingRun], fmt: Literal["yaml", "json"] = "yaml", include_status: bool = True
) -> str:
    """Runs as YAML documents or JSON (one object, or a TrainingRunList for several)."""
    docs = [run.to_dict(include_status) for run in runs]
    if fmt == "json":
        body: Any = (
            docs[0]
            if len(docs) == 1
            else {"apiVersion": API_VERSION, "kind": "TrainingRunList", "items": docs}
        )
        return json.dumps(body, indent=2) + "\n"
    if fmt != "yaml":
        raise ValueError(f"format must be 'yaml' or 'json' (got {fmt!r})")
    return dump_yaml(docs)


# Bidirectional marks: they reorder what follows them on a terminal. YAML's emitters escape control
# characters but count these printable.
BIDI_MARKS = frozenset((*range(0x202A, 0x202F), *range(0x2066, 0x206A)))


def holds_bidi(value: Any) -> bool:
    """Whether a string anywhere in `value` (mapping keys too) holds a bidirectional mark."""
    if isinstance(value, str):
        return any(ord(ch) in BIDI_MARKS for ch in value)
    if isinstance(value, dict):
        return any(holds_bidi(k) or holds_bidi(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(holds_bidi(v) for v in value)
    return False


def dump_yaml(docs: list[Any]) -> str:
    """Plain data as '---'-separated YAML documents (block style, lists indented under their key); where a
    string holds a bidirectional mark, with every non-ASCII character escaped (the same data once read)."""
    yaml = YAML(typ="rt")
    yaml.default_flow_style = False
    yaml.allow_unicode = not holds_bidi(docs)
    yaml.indent(mapping=2, sequence=4, offset=2)
    out = io.StringIO()
    if len(docs) == 1:
        yaml.dump(docs[0], out)
    else:
        yaml.dump_all(docs, out)
    return out.getvalue()
