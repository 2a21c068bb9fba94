"""What made a checkpoint or a weight version: the spec generation, the reward code, the dataset, the data
position.

Who calls it: the actor, once at start (`Provenance.of(...)` after it read the dataset), then
`at(step)` for every checkpoint and weight version it records (stored in the rows' `provenance`
column and in each checkpoint's mortal.json), and mortal.workers.actor.resume_check, which compares a
checkpoint's record with the actor's own before training on from it.
Why hashes of code and rows and not names: a reward module edited in place, or a dataset file
rewritten under the same name, changes what a run trains on while the spec stays the same; only
the content tells. The dataset's fingerprint is of the rows the actor actually uses (after
maxSamples and the system prompt), in order, because the data position indexes exactly those.
What it must not do: import user code (the reward modules are found with importlib's finder, then
read as files) or decide anything: resume_check judges.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

SHORT = 12  # hex digits shown by describe; the records keep the whole sha256


class _Record(BaseModel):
    """camelCase keys in the stored JSON, like the spec and status."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True, extra="ignore")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, mode="json")


class DatasetFingerprint(_Record):
    """The rows a run trains on, as the actor read them."""

    name: str = Field(description="spec.dataset.name")
    rows: int = Field(description="rows used (after maxSamples)")
    sha256: str = Field(description="of the rows as canonical JSON, one per line, in order")
    spec: dict[str, Any] = Field(
        description="spec.dataset as applied: tells a deliberate change from a silent one"
    )


class DataPosition(_Record):
    """Where in the data a step leaves the run: mortal.workers.schedule draws prompt `consumed + j` of
    the rows for slot j of the next step, pass by pass, each pass a permutation keyed by the seed."""

    step: int
    prompts_per_step: int
    seed: int
    consumed: int = Field(description="prompts drawn so far: step x promptsPerStep")
    epoch: int = Field(description="the pass over the rows the next prompt comes from (0-based)")
    index: int = Field(description="the next prompt's place within that pass")


class Provenance(_Record):
    """One checkpoint's or weight version's record of what made it."""

    spec_generation: int | None = Field(description="metadata.generation of the spec that trained it")
    reward_code: str = Field(description="sha256 over every reward entry's hash, in spec order")
    rewards: dict[str, str] = Field(description="reward name -> sha256 of its entry and its code file")
    dataset: DatasetFingerprint
    position: DataPosition | None = Field(None, description="where the data stands after the step it records")

    @classmethod
    def of(
        cls, spec_generation: int | None, rewards: Mapping[str, str], dataset: DatasetFingerprint
    ) -> Provenance:
        """What the actor trains with now (no position yet: `at` adds it per step)."""
        return cls(
            spec_generation=spec_generation,
            reward_code=_combined(rewards),
            rewards=dict(rewards),
            dataset=dataset,
        )

    def at(self, step: int, prompts_per_step: int, seed: int) -> Provenance:
        """The record of what the step `step` leaves: this provenance with its data position."""
        return self.model_copy(
            update={"position": data_position(step, prompts_per_step, seed, self.dataset.rows)}
        )

    @classmethod
    def read(cls, record: Mapping[str, Any] | None) -> Provenance | None:
        """A stored record, or None when there is none (a checkpoint from before provenance was kept)."""
        return None if record is None else cls.model_validate(record)


def data_position(step: int, prompts_per_step: int, seed: int, rows: int) -> DataPosition:
    consumed = step * prompts_per_step
    epoch, index = divmod(consumed, rows) if rows > 0 else (0, consumed)
    return DataPosition(
        step=step, prompts_per_step=prompts_per_step, seed=seed, consumed=consumed, epoch=epoch, index=index
    )


def dataset_fingerprint(
    dataset_spec: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
) -> DatasetFingerprint:
    """Fingerprint of `rows` (mortal.workers.data.load_rows' output) read for `dataset_spec`
    (spec.dataset)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
    return DatasetFingerprint(
        name=str(dataset_spec.get("name")), rows=len(rows), sha256=digest.hexdigest(), spec=dict(dataset_spec)
    )


def reward_hashes(entries: Iterable[Mapping[str, Any]], names: Sequence[str]) -> dict[str, str]:
    """name -> sha256 of the spec entry (YAML form) and the source file of its code.

    The file of a `function` reference is its module's, found without importing it; a built-in `env`'s
    is mortal's module of that environment. A module that cannot be found here hashes as its entry
    alone (the rollouts would fail on it anyway, with their own error).
    """
    hashes = {}
    for name, entry in zip(names, entries, strict=True):
        digest = hashlib.sha256(json.dumps(dict(entry), sort_keys=True, default=str).encode())
        source = _code_file(entry)
        if source is not None:
            digest.update(source.read_bytes())
        hashes[name] = digest.hexdigest()
    return hashes


def _code_file(entry: Mapping[str, Any]) -> Path | None:
    function, env = entry.get("function"), entry.get("env")
    if function:
        module = str(function).partition(":")[0]
    elif env:
        module = "mortal.workers.rewards.environments." + str(env).replace("-", "_")
    else:
        return None
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package missing, or an empty name
        return None
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and Path(origin).is_file() else None


def _combined(rewards: Mapping[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{k}={v}" for k, v in rewards.items()).encode()).hexdigest()


def short(digest: str | None) -> str:
    return (digest or "-")[:SHORT]
