"""Turns pydantic validation errors into `SpecIssue`s a person can act on.

Called by `mortal.specs.loader` with the plain document, its line map (path -> 1-based line, paths
made of the keys as the user wrote them) and pydantic's errors. Three jobs: map each error's `loc`
back to the user's own keys and to a line (a missing field gets its parent's line), rewrite
pydantic's wording into "must be >= 2 (got 1)" form, and name the closest valid key for an unknown
one. Pure functions; no YAML, no I/O.
"""

from __future__ import annotations

import difflib
import inspect
import re
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_camel, to_snake
from pydantic_core import ErrorDetails

from mortal.specs.base import RULE_ERROR, blamed
from mortal.specs.errors import SpecIssue

Path = tuple[str | int, ...]


SHOWN_ISSUES = 50  # problems listed per document; the rest are counted


def issues_from_errors(
    errors: Sequence[ErrorDetails],
    root: type[BaseModel],
    data: Any,
    lines: dict[Path, int],
    source: str,
    prefix: Path = (),
) -> list[SpecIssue]:
    """One issue per pydantic error (exact repeats dropped), in document order; past SHOWN_ISSUES, one more
    that says how many were left out (a file of thousands of unknown keys is refused at once, and the
    terminal gets a readable answer)."""
    issues: dict[SpecIssue, None] = {}  # a dict: order kept, repeats found at once
    for err in errors:
        loc = blamed(err)
        path = locate(loc, data)
        issue = SpecIssue(
            source, line_of(prefix + path, lines), dotted(prefix + path), message(err, root, loc)
        )
        issues[issue] = None
    ordered = sorted(issues, key=lambda i: i.line or 0)
    if len(ordered) <= SHOWN_ISSUES:
        return ordered
    left_out = len(ordered) - SHOWN_ISSUES
    return [*ordered[:SHOWN_ISSUES], SpecIssue(source, None, "", f"and {left_out} more problems not shown")]


def locate(loc: tuple[Any, ...], data: Any) -> Path:
    """pydantic's loc -> the path as the user wrote it (their key spelling; union tags dropped)."""
    path: list[str | int] = []
    node = data
    for i, seg in enumerate(loc):
        if isinstance(node, dict):
            key = _written_key(node, seg)
            if key is not None:
                path.append(key)
                node = node[key]
            elif isinstance(seg, str) and i == len(loc) - 1 and not _is_tag(seg):
                path.append(seg)  # a missing field: report it under the parent's line
                node = None
        elif isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node):
            path.append(seg)
            node = node[seg]
    return tuple(path)


def line_of(path: Path, lines: dict[Path, int]) -> int | None:
    """Line of the longest prefix of `path` that the document has."""
    for end in range(len(path), -1, -1):
        if path[:end] in lines:
            return lines[path[:end]]
    return None


def dotted(path: Path) -> str:
    """('spec', 'rewards', 0, 'env') -> 'spec.rewards[0].env'."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")  # a key, or a list index in brackets


def undotted(field: str) -> Path:
    """'spec.rewards[0].env' -> ('spec', 'rewards', 0, 'env'): `dotted` read back, for a check that names
    a field (admission's) to find its line."""
    return tuple(int(index) if index else key for key, index in _PART.findall(field))


def message(err: ErrorDetails, root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """pydantic's error in our words: what is wrong, what was given, and the fix when we know it."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, show(err.get("input"))
    if kind == RULE_ERROR:
        return str(ctx["message"])
    if kind == "extra_forbidden":
        return unknown_key_message(str(loc[-1]), valid_keys(model_at(root, loc[:-1])))
    if kind == "literal_error" or kind == "enum":
        allowed = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        hint = closest(str(err.get("input")), allowed) if isinstance(err.get("input"), str) else None
        text = f"must be one of {', '.join(allowed)} (got {got})"
        return f"{text}; did you mean {hint!r}?" if hint else text
    simple = {
        "missing": "is required",
        "greater_than_equal": f"must be >= {number(ctx.get('ge'))} (got {got})",
        "greater_than": f"must be > {number(ctx.get('gt'))} (got {got})",
        "less_than_equal": f"must be <= {number(ctx.get('le'))} (got {got})",
        "less_than": f"must be < {number(ctx.get('lt'))} (got {got})",
        "string_too_short": "must not be empty",
        "too_short": f"must have at least {ctx.get('min_length')} item(s)",
        "int_parsing": f"must be a whole number (got {got})",
        "int_type": f"must be a whole number (got {got})",
        "int_from_float": f"must be a whole number (got {got})",
        "float_parsing": f"must be a number (got {got})",
        "float_type": f"must be a number (got {got})",
        "bool_parsing": f"must be true or false (got {got})",
        "bool_type": f"must be true or false (got {got})",
        "string_type": f"must be a string (got {got})" + _quote_hint(err.get("input")),
        "dict_type": f"must be a mapping of key: value (got {got})",
        "model_type": f"must be a mapping of key: value (got {got})",
        "model_attributes_type": f"must be a mapping of key: value (got {got})",
        "list_type": f"must be a list (got {got})",
        "datetime_parsing": f"must be an ISO 8601 time such as 2025-01-31T12:00:00Z (got {got})",
        "datetime_type": f"must be an ISO 8601 time such as 2025-01-31T12:00:00Z (got {got})",
    }
    return simple.get(kind, err["msg"])


def unknown_key_message(key: str, valid: list[str]) -> str:
    """'unknown field; did you mean 'numGenerations'?' or, with no close key, the list of valid keys."""
    hint = closest(key, valid)
    if hint:
        return f"unknown field; did you mean {hint!r}?"
    return f"unknown field; valid fields here: {', '.join(valid)}" if valid else "unknown field"


def closest(word: str, candidates: list[str]) -> str | None:
    """The candidate nearest to `word`, ignoring case, '_' and '-' (so num_generation -> numGenerations)."""
    norm = {_normal(c): c for c in candidates}
    match = difflib.get_close_matches(_normal(word), list(norm), n=1, cutoff=0.6)
    return norm[match[0]] if match else None


def model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that validates the value at `loc` (list indices and union tags skipped)."""
    current: type[BaseModel] | None = root
    for seg in loc:
        if current is None:
            return None
        if isinstance(seg, int):
            continue
        field = _field(current, seg)
        if field is not None:
            current = _inner_model(field.annotation)
    return current


def valid_keys(model: type[BaseModel] | None) -> list[str]:
    """The YAML keys a model accepts (aliases)."""
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def number(value: Any) -> str:
    """A bound as people write it: 0.0 -> 0, 1e-06 stays 1e-06."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def show(value: Any) -> str:
    """A value as the user would have typed it in YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value) if isinstance(value, str) else str(value)


def _quote_hint(value: Any) -> str:
    """YAML reads 2, 1.0 and true as non-strings; quoting them is the fix."""
    if isinstance(value, bool | int | float):
        return f'; quote it: "{show(value)}"'
    return ""


def _written_key(node: dict[Any, Any], seg: Any) -> Any:
    """The key in `node` that pydantic's `seg` refers to: as is, or its camelCase/snake_case twin."""
    if not isinstance(seg, str):
        return seg if seg in node else None
    for key in (seg, to_snake(seg), to_camel(seg)):
        if key in node:
            return key
    return None


def _is_tag(seg: str) -> bool:
    """pydantic's union-member labels in a loc, e.g. 'list[str]' or 'function-after[...]'."""
    return "[" in seg or seg in {"str", "int", "float", "bool", "none"}


def _field(model: type[BaseModel], seg: str) -> Any:
    for name, field in model.model_fields.items():
        if seg in (name, field.alias):
            return field
    return None


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _normal(word: str) -> str:
    return word.lower().replace("_", "").replace("-", "")
