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
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# A label key's name part, and a label value.
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_LABEL = 63
MAX_SUBDOMAIN = 253
SHOWN_CHARS = 80  # how much of a refused value an error message echoes (a name may be a megabyte)


def shown(value: str) -> str:
    """`value` as an error message echoes it: repr'd (a NUL or a newline stays visible), cut short."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


def is_dns1123_label(name: str) -> bool:
    """Kubernetes' DNS-1123 label: what a run name must be (it names processes, folders and URLs)."""
    return len(name) <= MAX_LABEL and DNS1123_LABEL.match(name) is not None


def suggest_dns1123_label(name: str) -> str:
    """The nearest valid label: lowercase, runs of other characters become '-', trimmed to 63."""
    label = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:63].strip("-")
    return label or "my-run"


# The rules of every name mortal stores, each a function returning what is wrong (None when nothing is).
# One place for both sides: the spec's validators below (the CLI) and the store (mortal.state.names),
# which refuses what a client that skipped the spec (HTTP, a script) sends.
def dns1123_label_problem(name: str) -> str | None:
    """Why `name` is not a DNS-1123 label (a run name, a worker role: each names folders and processes)."""
    if is_dns1123_label(name):
        return None
    return (
        "must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter "
        f"or digit, at most {MAX_LABEL} characters (got {shown(name)}); try "
        f"{suggest_dns1123_label(name)!r}"
    )


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a Kubernetes label (or annotation) key: `[prefix/]name`, the prefix a DNS-1123
    subdomain, the name at most 63 of letters, digits, '-', '_' and '.', alphanumeric at both ends."""
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= MAX_SUBDOMAIN and DNS1123_SUBDOMAIN.match(prefix)):
        return f"key {shown(key)}: its prefix before '/' must be a DNS-1123 subdomain (e.g. mortal.dev)"
    if not (len(name) <= MAX_LABEL and LABEL_NAME.match(name)):
        return (
            f"key {shown(key)}: must be at most {MAX_LABEL} letters, digits, '-', '_' or '.', starting "
            "and ending with a letter or digit (optionally after a prefix such as mortal.dev/)"
        )
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is not a Kubernetes label value: empty, or as a key's name part."""
    if value == "" or (len(value) <= MAX_LABEL and LABEL_NAME.match(value)):
        return None
    return (
        f"value {shown(value)}: must be empty or at most {MAX_LABEL} letters, digits, '-', '_' or '.', "
        "starting and ending with a letter or digit"
    )


# Annotations of one run together, keys and values (Kubernetes' own limit): they are stored with the run
# and read on every pass; a larger note belongs in a file the spec names.
MAX_ANNOTATIONS_BYTES = 256 * 1024


def labels_problem(labels: dict[str, str], values: bool = True) -> str | None:
    """The first problem of a labels (or, `values` False, annotations) mapping: its keys, and its values
    (an annotations mapping's size too)."""
    found = labels_problem_at(labels, values)
    return None if found is None else found[1]


def labels_problem_at(labels: dict[str, str], values: bool = True) -> tuple[str | None, str] | None:
    """`labels_problem` with the key it is at (None for the mapping as a whole), so that a spec's error
    points at that key's line rather than at `labels:`."""
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            return None, f"{key!r}: {value!r}: keys and values must be strings"
        problem = label_key_problem(key) or (label_value_problem(value) if values else None)
        if problem:
            return key, problem
    size = sum(len(k.encode()) + len(v.encode()) for k, v in labels.items())
    if not values and size > MAX_ANNOTATIONS_BYTES:
        return (
            None,
            f"annotations take {size} bytes, over the limit of {MAX_ANNOTATIONS_BYTES} (keys and values)",
        )
    return None


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
        default_factory=dict,
        description="Free-form key/value notes for people and tools; not used to select.",
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
        problem = dns1123_label_problem(value)
        if problem:
            raise rule_error(problem)
        return value

    @field_validator("labels")
    @classmethod
    def _labels_are_kubernetes_labels(cls, value: dict[str, str]) -> dict[str, str]:
        found = labels_problem_at(value)
        if found:
            raise rule_error(found[1], key=found[0])
        return value

    @field_validator("annotations")
    @classmethod
    def _annotation_keys_are_label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        found = labels_problem_at(value, values=False)
        if found:
            raise rule_error(found[1], key=found[0])
        return value
