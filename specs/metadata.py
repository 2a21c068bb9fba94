"""`metadata:` of a TrainingRun: its name, labels and annotations, plus fields the store fills in.

Users write name/labels/annotations; `uid`, `generation`, `resourceVersion`, `creationTimestamp` and
`deletionTimestamp` appear in `mortalctl get -o yaml` output and are accepted (and ignored by apply)
so that output can be applied again. No I/O here.
"""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import Field, field_validator

from mortal.specs.base import SpecModel, rule_error

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def is_dns1123_label(name: str) -> bool:
    """Kubernetes' DNS-1123 label: what a run name must be (it names processes, folders and URLs)."""
    return len(name) <= 63 and DNS1123_LABEL.match(name) is not None


def suggest_dns1123_label(name: str) -> str:
    """The nearest valid label: lowercase, runs of other characters become '-', trimmed to 63."""
    label = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:63].strip("-")
    return label or "my-run"


class Metadata(SpecModel):
    """Identity of a run (Kubernetes ObjectMeta, the parts mortal uses)."""

    name: str = Field(
        description="Run name, unique in the store: a DNS-1123 label (lowercase letters, digits, '-', "
        "at most 63 characters, starting and ending with a letter or digit)."
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="Key/value tags; `mortalctl get runs -l key=value` selects by them."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Free-form key/value notes for people and tools; not used to select."
    )
    uid: str | None = Field(None, description="Set by the store (read-only): this incarnation of the name.")
    generation: int | None = Field(None, description="Set by the store (read-only): +1 on every spec change.")
    resource_version: int | None = Field(
        None, description="Set by the store (read-only): +1 on every write of the run."
    )
    creation_timestamp: datetime | None = Field(None, description="Set by the store (read-only).")
    deletion_timestamp: datetime | None = Field(
        None, description="Set by the store (read-only) once deletion is requested."
    )

    @field_validator("name")
    @classmethod
    def _name_is_dns1123_label(cls, value: str) -> str:
        if not is_dns1123_label(value):
            raise rule_error(
                "must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a "
                f"letter or digit, at most 63 characters (got {value!r}); try {suggest_dns1123_label(value)!r}"
            )
        return value
