"""Reads TrainingRun documents from YAML (or JSON) text, files and directories.

Called by `mortalctl apply -f`, `controller --watch DIR` and tests. Uses ruamel.yaml's round-trip
loader only to learn where each key sits (bounded by mortal.specs.parse_limits: aliases, nesting),
then validates plain Python data with pydantic; every problem of every document becomes a
`SpecIssue` (file, line, field path as the user wrote it, message with the fix) and all of them are
raised together as one `SpecError`. No other I/O than reading the named files; it never talks to the store.

    runs = load_path("specs/examples")          # a file, a directory of *.yaml/*.yml, or "-" for stdin
    runs = load_text(text, source="<stdin>")    # multi-document text ('---'), or a TrainingRunList
"""

from __future__ import annotations

import contextlib
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from mortal.specs import epochs, parse_limits
from mortal.specs.diagnostics import dotted, issues_from_errors, line_of
from mortal.specs.errors import SpecError, SpecIssue
from mortal.specs.run import API_VERSION, KIND, TrainingRun

LIST_KINDS = ("TrainingRunList", "List")
YAML_SUFFIXES = (".yaml", ".yml")
Lines = dict[tuple[str | int, ...], int]


def load_text(text: str, source: str = "<stdin>") -> list[TrainingRun]:
    """Every TrainingRun in `text` (documents split by '---'; empty documents skipped)."""
    runs, issues = _read_text(text, source)
    _check_unique_names(runs, issues)
    if issues:
        raise SpecError(issues)
    return [run for run, _ in runs]


def load_file(path: str | Path) -> list[TrainingRun]:
    """Every TrainingRun in one YAML/JSON file; errors name the file as given."""
    text, issue = _read(Path(path))
    if issue:
        raise SpecError([issue])
    return load_text(text, source=str(path))


def load_path(path: str | Path, recursive: bool = False) -> list[TrainingRun]:
    """A file, or every *.yaml/*.yml in a directory (sorted by path), or '-' for standard input.

    All files are read before anything is raised, so one SpecError lists the problems of all of them;
    a run name defined twice across the files is an error too. An empty directory gives [].
    """
    if str(path) == "-":
        return load_text(sys.stdin.read(), "<stdin>")
    path = Path(path)
    if not path.is_dir():
        return load_file(path)
    pattern = "**/*" if recursive else "*"
    files = sorted(p for p in path.glob(pattern) if p.suffix in YAML_SUFFIXES and p.is_file())
    runs: list[tuple[TrainingRun, SpecIssue]] = []
    issues: list[SpecIssue] = []
    for file in files:
        text, issue = _read(file)
        if issue:
            issues.append(issue)
            continue
        file_runs, file_issues = _read_text(text, str(file))
        runs += file_runs
        issues += file_issues
    _check_unique_names(runs, issues)
    if issues:
        raise SpecError(issues)
    return [run for run, _ in runs]


def field_lines(source: str, name: str) -> Lines:
    """{path: line} of run `name`'s document in file `source` (paths from the document's root), read again
    for a check made after loading (admission's, whose fields find their lines with `line_of(undotted(field),
    lines)`): empty when the file cannot be read again (stdin, it changed) or holds no such run."""
    path = Path(source)
    if not path.is_file():
        return {}
    text, issue = _read(path)
    if issue is not None:
        return {}
    try:
        docs = parse_limits.load_documents(text, source)
    except SpecError:
        return {}
    for doc in docs:
        lines: Lines = {}
        data = _plain(doc, (), lines) if doc is not None else None
        for prefix, item in _documents(data, lines, source, []):
            metadata = item.get("metadata") if isinstance(item, dict) else None
            if isinstance(metadata, dict) and metadata.get("name") == name:
                cut = len(prefix)
                return {at[cut:]: line for at, line in lines.items() if at[:cut] == prefix}
    return {}


def _read(path: Path) -> tuple[str, SpecIssue | None]:
    """The file's text, read no further than one character past what a text may hold (a larger one is
    refused by parse_limits without being read whole)."""
    try:
        with path.open(encoding="utf-8") as file:
            return file.read(parse_limits.MAX_TEXT_CHARS + 1), None
    except FileNotFoundError:
        return "", SpecIssue(str(path), None, "", "no such file or directory")
    except (OSError, UnicodeDecodeError) as exc:
        return "", SpecIssue(str(path), None, "", f"cannot read: {exc}")


def _read_text(text: str, source: str) -> tuple[list[tuple[TrainingRun, SpecIssue]], list[SpecIssue]]:
    """(run, where its name is) pairs and the issues of every document in `text`."""
    try:
        docs = parse_limits.load_documents(text, source)
    except SpecError as exc:
        return [], exc.issues
    runs: list[tuple[TrainingRun, SpecIssue]] = []
    issues: list[SpecIssue] = []
    for doc in docs:
        if doc is None:
            continue
        lines: Lines = {}
        data = _plain(doc, (), lines)
        for prefix, item in _documents(data, lines, source, issues):
            run = _validate(item, lines, source, prefix, issues)
            if run is not None:
                where = prefix + ("metadata", "name")
                runs.append((run, SpecIssue(source, line_of(where, lines), dotted(where), "")))
    return runs, issues


def _documents(data: Any, lines: Lines, source: str, issues: list[SpecIssue]) -> list[tuple[tuple, Any]]:
    """The TrainingRun documents in one YAML document: itself, or the items of a TrainingRunList."""
    if isinstance(data, dict) and data.get("kind") in LIST_KINDS:
        items = data.get("items")
        if not isinstance(items, list):
            issues.append(
                SpecIssue(source, line_of(("items",), lines), "items", "must be a list of TrainingRuns")
            )
            return []
        return [(("items", i), item) for i, item in enumerate(items)]
    return [((), data)]


def _validate(
    data: Any, lines: Lines, source: str, prefix: tuple, issues: list[SpecIssue]
) -> TrainingRun | None:
    """The run, or None after appending its issues (a wrong header stops before the field checks)."""
    header = _header_issues(data, lines, source, prefix)
    if header:
        issues += header
        return None
    try:
        run = TrainingRun.model_validate(data)
    except ValidationError as exc:
        issues += issues_from_errors(exc.errors(), TrainingRun, data, lines, source, prefix)
        return None
    try:
        epochs.resolve(run.spec)
    except epochs.RowsUncountable as exc:
        where = prefix + ("spec", "algorithm", "numEpochs")
        issues.append(SpecIssue(source, line_of(where, lines), dotted(where), str(exc)))
        return None
    return run


def _header_issues(data: Any, lines: Lines, source: str, prefix: tuple) -> list[SpecIssue]:
    """A document that is not a mortal/v1 TrainingRun gets one clear error, not one per field."""
    line = line_of(prefix, lines)
    if not isinstance(data, dict):
        what = "a list" if isinstance(data, list) else repr(data)
        return [
            SpecIssue(
                source,
                line,
                dotted(prefix),
                f"a document must be a mapping with apiVersion, kind, metadata and spec (got {what})",
            )
        ]
    issues = []
    for key, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        path = prefix + (key,)
        if key not in data:
            issues.append(SpecIssue(source, line, dotted(path), f"is required: add '{key}: {want}'"))
        elif data[key] != want:
            extra = "; mortal reads only TrainingRun documents" if key == "kind" else ""
            issues.append(
                SpecIssue(
                    source, line_of(path, lines), dotted(path), f"must be {want!r} (got {data[key]!r}){extra}"
                )
            )
    return issues


def _check_unique_names(runs: list[tuple[TrainingRun, SpecIssue]], issues: list[SpecIssue]) -> None:
    first: dict[str, SpecIssue] = {}
    for run, where in runs:
        if run.name in first:
            seen = first[run.name]
            issues.append(
                SpecIssue(
                    where.source,
                    where.line,
                    where.path,
                    f"run {run.name!r} is defined twice (first at {seen.source}:{seen.line})",
                )
            )
        else:
            first[run.name] = where


def _plain(node: Any, path: tuple, lines: Lines) -> Any:
    """ruamel's round-trip objects -> plain dict/list/str/int/float/bool, recording each key's line."""
    if isinstance(node, CommentedMap):
        lines.setdefault(path, node.lc.line + 1)
        out = {}
        for key in node:
            position = _position(node, key)
            if position is not None:
                lines[path + (key,)] = position
            out[key] = _plain(node[key], path + (key,), lines)
        return out
    if isinstance(node, CommentedSeq):
        lines.setdefault(path, node.lc.line + 1)
        for i in range(len(node)):
            with contextlib.suppress(KeyError, IndexError, TypeError):
                lines[path + (i,)] = node.lc.item(i)[0] + 1
        return [_plain(item, path + (i,), lines) for i, item in enumerate(node)]
    return _scalar(node)


def _position(node: CommentedMap, key: Any) -> int | None:
    try:
        return node.lc.key(key)[0] + 1
    except (KeyError, IndexError, TypeError):
        return None  # keys merged in from an anchor (<<: *x) have no position of their own


def _scalar(value: Any) -> Any:
    """ruamel scalar subclasses (ScalarFloat, ScalarInt, TimeStamp, ...) -> the builtin type."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, datetime):
        return datetime.fromisoformat(value.isoformat())
    return value
