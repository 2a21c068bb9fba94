"""The training prompts: read `spec.dataset` into plain rows with a normalized `prompt`.

Who calls it: the actor (it turns rows into rollout tasks; each task carries its row, so rollout
workers never read the dataset). `dataset.name` is `builtin:NAME` (a file shipped in
mortal/workers/builtin_data/, made by its make.py), a local .jsonl / .json / .parquet file, or a
hub id read with `datasets.load_dataset(name, split=...)`. Every row comes back JSON-safe (it
travels through the task queue) with the prompt under "prompt" (text, or chat messages), the
system prompt prepended, and at most `maxSamples` rows.
What it must not do: let a bad dataset look like a crash to retry. A missing or unreadable file,
an unknown builtin, a missing prompt column or a malformed prompt is a FatalWorkerError naming
spec.dataset.name (or promptColumn) and the file.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mortal.workers.errors import FatalWorkerError

if TYPE_CHECKING:
    from mortal.specs.training import DatasetSpec

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def _fatal(spec: DatasetSpec, message: str) -> FatalWorkerError:
    return FatalWorkerError("DatasetUnreadable", f"spec.dataset.name {spec.name!r}: {message}")


def builtin_names() -> list[str]:
    folder = resources.files("mortal.workers") / "builtin_data"
    return sorted(p.name.removesuffix(".jsonl") for p in folder.iterdir() if p.name.endswith(".jsonl"))


def _read_jsonl(path: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _fatal(spec, f"{path} line {number} is not JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise _fatal(spec, f"{path} line {number} is a {type(row).__name__}, expected a JSON object")
            rows.append(row)
    return rows


def _read_json(path: Path, spec: DatasetSpec) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise _fatal(spec, f"{path} is not JSON: {exc}") from exc
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
    except (OSError, UnicodeDecodeError) as exc:
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
    """The rows as stored, before normalization (a local file has one split: `split` is not used)."""
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
    column = spec.prompt_column
    if column not in raw[0]:
        raise FatalWorkerError(
            "DatasetUnreadable",
            f"spec.dataset.promptColumn {column!r} is not a column of {spec.name!r}; "
            f"columns: {', '.join(map(str, raw[0]))}",
        )
    rows = []
    for index, source in enumerate(raw):
        row = {k: v for k, v in source.items() if k != column}
        prompt = normalize_prompt(source.get(column), spec.system_prompt)
        if prompt is None:
            raise FatalWorkerError(
                "DatasetUnreadable",
                f"spec.dataset.promptColumn {column!r} of {spec.name!r}, row {index}: a prompt must be text "
                f"or a list of {{role, content}} messages (got {type(source.get(column)).__name__})",
            )
        row["prompt"] = prompt
        rows.append(_json_safe(row))
    return rows
