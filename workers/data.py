"""The training prompts: read `spec.dataset` into plain rows with a normalized `prompt`.

Who calls it: the actor (it turns rows into rollout tasks; each task carries its row, so rollout
workers never read the dataset). `dataset.name` is `builtin:NAME` (a file shipped in
mortal/workers/builtin_data/, made by its make.py), a local .jsonl / .json / .parquet file, or a
hub id read with `datasets.load_dataset(name, split=...)`. Every row comes back JSON-safe (it
travels through the task queue) with the prompt under "prompt" (text, or chat messages), the
system prompt prepended, and at most `maxSamples` rows.
What it must not do: let a bad dataset look like a crash to retry. A missing or unreadable file,
an unknown builtin, a missing prompt column, a malformed or oversized prompt is a FatalWorkerError naming
spec.dataset.name (or promptColumn), the file and the 1-based line (row, where a file has no lines).
Admission (mortal.workers.probe) checks a JSON-lines file's lines with the same `jsonl_rows`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.workers.errors import FatalWorkerError

if TYPE_CHECKING:
    from mortal.specs.training import DatasetSpec

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
MAX_PROMPT_CHARS = 1 << 20
"""The most characters one prompt may hold (a chat prompt's contents together): more text than the contexts
RL trains in hold, so a real prompt never meets it. A prompt past it is a broken row, which every rollout
would otherwise tokenize and carry in its task, its worker's memory growing, before the model refused it."""
JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


class RowProblem(ValueError):
    """A dataset row that cannot be used: where it is (`line N` of a JSON-lines file, `row N` of another) and
    what is wrong, in the words both the worker and admission print."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where} {what}")


def _fatal(spec: DatasetSpec, message: str) -> FatalWorkerError:
    return FatalWorkerError("DatasetUnreadable", f"spec.dataset.name {spec.name!r}: {message}")


def builtin_names() -> list[str]:
    folder = resources.files("mortal.workers") / "builtin_data"
    return sorted(p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl"))


def _json_kind(value: Any) -> str:
    return next((name for kind, name in JSON_KINDS.items() if isinstance(value, kind)), "a number")


def prompt_problem(row: dict[str, Any], column: str) -> str | None:
    """What keeps a row's `column` from being a prompt (None: nothing), to follow `line N` or `row N`."""
    if column not in row:
        columns = ", ".join(map(str, row)) or "none"
        return f"has no {column!r} column (spec.dataset.promptColumn): {columns}"
    prompt = row[column]
    if normalize_prompt(prompt, None) is None:
        got = "an empty array" if prompt == [] else _json_kind(prompt)
        return (
            f"has a {column!r} that is {got}: a prompt must be text or a list of {{role, content}} messages"
        )
    size = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
    if size > MAX_PROMPT_CHARS:
        return (
            f"has a prompt of {size:,} characters; a prompt may hold {MAX_PROMPT_CHARS:,} "
            "(MAX_PROMPT_CHARS): shorten the row or drop it"
        )
    return None


def jsonl_rows(lines: Iterable[bytes], column: str) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines file's `lines` (blank ones skipped), each checked as it is read: RowProblem
    naming the first line that is not UTF-8, not JSON, not an object or has no usable prompt."""
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RowProblem(
                f"line {number}", f"is not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RowProblem(f"line {number}", f"is not JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(row, dict):
            raise RowProblem(f"line {number}", f"is {_json_kind(row)}, not a JSON object")
        problem = prompt_problem(row, column)
        if problem is not None:
            raise RowProblem(f"line {number}", problem)
        yield row


def _read_jsonl(path: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    """The file's rows, read no further than maxSamples of them."""
    with path.open("rb") as handle:
        try:
            return list(islice(jsonl_rows(handle, spec.prompt_column), spec.max_samples))
        except RowProblem as exc:
            raise _fatal(spec, f"{path} {exc}") from None


def _read_json(path: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise _fatal(spec, f"{path} line {line} is not UTF-8 text (byte {raw[exc.start]:#04x})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fatal(spec, f"{path} line {exc.lineno} is not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise _fatal(spec, f"{path} must hold a JSON list of objects (or use .jsonl, one object per line)")
    return data


def _read_parquet(path: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a bad file
        raise _fatal(spec, f"{path} is not a readable parquet file: {type(exc).__name__}: {exc}") from exc


def _read_file(path: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    if not path.is_file():
        raise _fatal(spec, f"no such file: {path}")
    try:
        if path.suffix == ".parquet":
            return _read_parquet(path, spec)
        if path.suffix == ".json":
            return _read_json(path, spec)
        return _read_jsonl(path, spec)
    except OSError as exc:
        raise _fatal(spec, f"cannot read {path}: {exc}") from exc


def _read_hub(spec: DatasetSpec) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as exc:
        raise _fatal(
            spec, "reading a hub dataset needs the `datasets` package (pip install mortal[train])"
        ) from exc
    try:
        return list(datasets.load_dataset(spec.name, spec.config, split=spec.split))
    except Exception as exc:  # hub errors come in many types; all mean "this dataset cannot be read"
        raise _fatal(
            spec, f"cannot load it from the hub (split {spec.split!r}): {type(exc).__name__}: {exc}"
        ) from exc


def read_raw_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    """The rows as stored, before normalization (a local file has one split: `split` is not used); a
    JSON-lines file's are checked as they are read (jsonl_rows), up to maxSamples of them."""
    if spec.name.startswith("builtin:"):
        name = spec.name.removeprefix("builtin:")
        available = builtin_names()
        if name not in available:
            raise _fatal(spec, f"no built-in dataset {name!r}; built-in: {', '.join(available)}")
        return _read_jsonl(
            Path(str(resources.files("mortal.workers") / "builtin_data" / f"{name}.jsonl")), spec
        )
    path = Path(spec.name).expanduser()
    if path.suffix in FILE_SUFFIXES or path.exists():
        if path.is_dir() or path.suffix not in FILE_SUFFIXES:
            raise _fatal(spec, f"{path} is not a .jsonl, .json or .parquet file")
        return _read_file(path, spec)
    return _read_hub(spec)


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )


def normalize_prompt(prompt: Any, system_prompt: str | None) -> str | list[dict[str, Any]] | None:
    """Text or chat messages, with the system prompt in front; None when `prompt` is neither."""
    if isinstance(prompt, str):
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    if not _is_chat(prompt) or not prompt:
        return None
    messages = [dict(m) for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """Rows travel as JSON (task payloads): dates, decimals, bytes become strings."""
    return json.loads(json.dumps(row, default=str))


def load_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    """The dataset's rows, prompt under "prompt", at most `max_samples` of them."""
    raw = read_raw_rows(spec)
    if spec.max_samples is not None:
        raw = raw[: spec.max_samples]
    if not raw:
        raise _fatal(spec, "the dataset has no rows")
    rows = []
    for number, source in enumerate(raw, 1):
        problem = prompt_problem(source, spec.prompt_column)
        if problem is not None:
            raise _fatal(spec, str(RowProblem(f"row {number}", problem)))
        row = {k: v for k, v in source.items() if k != spec.prompt_column}
        row["prompt"] = normalize_prompt(source[spec.prompt_column], spec.system_prompt)
        rows.append(_json_safe(row))
    return rows
