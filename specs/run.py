"""`TrainingRun`: the whole document (apiVersion, kind, metadata, spec, status).

Built by `mortal.specs.loader` from YAML, by `TrainingRun.from_record` from what the store keeps, and
by `MortalTrainer` from Python arguments. `spec_dict()` is the normal form the store compares to
decide created / configured / unchanged: camelCase, JSON-able, every default filled in, so two
documents that differ only in key order, formatting or spelled-out defaults are equal.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import Field, ValidationError

from mortal.specs.base import SpecModel
from mortal.specs.diagnostics import issues_from_errors
from mortal.specs.errors import SpecError
from mortal.specs.metadata import Metadata
from mortal.specs.status import RunStatus
from mortal.specs.three_way_merge import merge_applied
from mortal.specs.training import TrainingSpec

API_VERSION: Final = "mortal/v1"
KIND: Final = "TrainingRun"


class TrainingRun(SpecModel):
    """A declarative RL training job: the controller keeps its workers matching `spec`."""

    api_version: Literal["mortal/v1"] = Field(API_VERSION, description="Schema version: mortal/v1.")
    kind: Literal["TrainingRun"] = Field(KIND, description="Always TrainingRun.")
    metadata: Metadata = Field(description="Name, labels and annotations.")
    spec: TrainingSpec = Field(description="Desired state.")
    status: RunStatus = Field(
        default_factory=RunStatus, description="Observed state; written by the controller, ignored by apply."
    )

    @property
    def name(self) -> str:
        """metadata.name, the run's key everywhere."""
        return self.metadata.name

    def spec_dict(self) -> dict[str, Any]:
        """The spec's normal form (camelCase, JSON-able, defaults filled): what the store keeps."""
        return self.spec.model_dump(by_alias=True, mode="json")

    def applied_config(self) -> dict[str, Any]:
        """The spec fields this document sets (camelCase, JSON-able, no defaults): what the store keeps as
        the run's last-applied configuration, so that the next apply knows which fields a file dropped."""
        return self.spec.model_dump(by_alias=True, mode="json", exclude_unset=True)

    def applied_spec(
        self, live: dict[str, Any] | None, last_applied: dict[str, Any] | None
    ) -> dict[str, Any]:
        """What applying this document writes over a run whose spec is `live` (None: a new run) and whose
        previous apply set `last_applied`: kubectl apply's three-way merge (mortal.specs.three_way_merge),
        in normal form. SpecError when a field kept from the live run no longer fits the document's."""
        if live is None:
            return self.spec_dict()
        merged = merge_applied(live, last_applied, self.applied_config(), self.spec_dict())
        try:
            spec = TrainingSpec.model_validate(merged)
        except ValidationError as exc:
            source = f"<apply: run {self.name} with the fields kept from its live spec>"
            raise SpecError(issues_from_errors(exc.errors(), TrainingSpec, merged, {}, source)) from exc
        return spec.model_dump(by_alias=True, mode="json")

    def status_dict(self) -> dict[str, Any]:
        """The status block as the store keeps it (camelCase, JSON-able)."""
        return self.status.model_dump(by_alias=True, mode="json")

    def to_dict(self, include_status: bool = True) -> dict[str, Any]:
        """The whole document for `get -o yaml|json`: camelCase, JSON-able, nulls left out (all nulls are
        defaults, so nothing is lost and the output applies again unchanged)."""
        exclude = None if include_status else {"status"}
        return self.model_dump(by_alias=True, mode="json", exclude_none=True, exclude=exclude)

    @classmethod
    def from_record(
        cls,
        name: str,
        spec: dict[str, Any],
        status: dict[str, Any] | None = None,
        *,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        uid: str | None = None,
        generation: int | None = None,
        resource_version: int | None = None,
        creation_timestamp: datetime | None = None,
        deletion_timestamp: datetime | None = None,
    ) -> TrainingRun:
        """Rebuild a run from the store's columns; a stored spec that no longer validates -> SpecError."""
        metadata = {
            "name": name,
            "labels": labels or {},
            "annotations": annotations or {},
            "uid": uid,
            "generation": generation,
            "resource_version": resource_version,
            "creation_timestamp": creation_timestamp,
            "deletion_timestamp": deletion_timestamp,
        }
        data = {"metadata": metadata, "spec": spec, "status": status or {}}
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError(issues_from_errors(exc.errors(), cls, data, {}, f"<store: run {name}>")) from exc
