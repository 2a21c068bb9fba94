"""`algorithm.numEpochs` -> `algorithm.maxSteps`, when a spec is read (MortalTrainer's num_epochs).

Called by the loader (specs/loader.py) for every document, and by MortalTrainer. Why at read time
and not in the workers: the controller ends a run by maxSteps and never reads datasets, so the
number must be in the stored spec; computing it once, when the spec is applied, keeps the stored
spec the whole truth (re-applying the same file gives the same number, and `get -o yaml` carries it).
Rows are counted for builtin datasets (shipped in the package) and local .jsonl/.json/.parquet
files. A hub dataset cannot be counted without downloading it, so such a spec must give maxSteps.
What it must not do: import the workers layer or a dataset library, or change a spec that gives
maxSteps itself.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

from mortal.specs.training import TrainingSpec

BUILTIN_PREFIX = "builtin:"


class RowsUncountable(ValueError):
    """The dataset's rows cannot be counted here; the message says why and what to give instead."""


def steps_for(num_epochs: float, rows: int, prompts_per_step: int) -> int:
    """Optimizer steps for `num_epochs` passes over `rows` prompts, at least one."""
    return max(1, math.ceil(num_epochs * rows / prompts_per_step))


def resolve(spec: TrainingSpec) -> None:
    """Set spec.algorithm.maxSteps from numEpochs when the spec gives numEpochs and not maxSteps.
    RowsUncountable when the dataset cannot be counted here."""
    algorithm = spec.algorithm
    if algorithm.num_epochs is None or "max_steps" in algorithm.model_fields_set:
        return
    counted = count_rows(spec.dataset.name)
    rows = min(counted, spec.dataset.max_samples or counted)
    algorithm.max_steps = steps_for(algorithm.num_epochs, rows, algorithm.prompts_per_step)
    spec._notes.append(
        f"spec.algorithm.maxSteps: {algorithm.max_steps}, from numEpochs "
        f"{algorithm.num_epochs:g} over {rows} rows of {spec.dataset.name} at "
        f"{algorithm.prompts_per_step} prompts per step"
    )


def count_rows(name: str) -> int:
    """Rows in a builtin dataset or a local file (`dataset.name`)."""
    if name.startswith(BUILTIN_PREFIX):
        builtin = name.removeprefix(BUILTIN_PREFIX)
        # The package's data folder, found by name: the workers layer's code is not imported here.
        file = resources.files("mortal.workers") / "builtin_data" / f"{builtin}.jsonl"
        if not file.is_file():
            raise RowsUncountable(f"there is no built-in dataset {name!r}")
        return _jsonl_rows(file.read_text(encoding="utf-8"))
    path = Path(name).expanduser()
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise RowsUncountable(
            f"{name!r} looks like a hub dataset, whose rows cannot be counted without "
            "downloading it: give maxSteps instead"
        )
    if not path.is_file():
        raise RowsUncountable(
            f"the dataset file {name!r} is not here to count its rows: give maxSteps instead"
        )
    if path.suffix == ".jsonl":
        return _jsonl_rows(path.read_text(encoding="utf-8"))
    if path.suffix == ".json":
        return _json_rows(path)
    return _parquet_rows(path)


def _jsonl_rows(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def _json_rows(path: Path) -> int:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RowsUncountable(f"{path} is not JSON ({exc})") from exc
    if not isinstance(data, list):
        raise RowsUncountable(f"{path} must hold a JSON list of rows")
    return len(data)


def _parquet_rows(path: Path) -> int:
    try:
        import pyarrow.parquet as parquet
    except ImportError as exc:
        raise RowsUncountable(
            "counting a .parquet dataset's rows needs pyarrow (pip install 'mortal[train]'), or give maxSteps"
        ) from exc
    return parquet.ParquetFile(path).metadata.num_rows
